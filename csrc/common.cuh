// Shared device and host helpers for the megatron_opt kernels.
//
// Conventions used by every kernel in this directory:
//   * 16-bit floats are carried as raw uint16_t bits and converted with the CUDA intrinsics, so the
//     kernels never depend on the (operator-less) __half / __nv_bfloat16 classes.
//   * All element indices are int64_t.
//   * A launch works on one flat shard [span_start, span_end).  The span is cut into one contiguous
//     range per block (grid = a few blocks per SM); inside its range a block walks the pieces of
//     the piece table in order and processes each overlap with a block-stride loop.
//   * "Vector" accesses move VEC consecutive elements of every array at once (16 bytes of the grad).
//     They are used only when every array of the launch has the same element phase modulo VEC
//     (see same_phase()); piece heads/tails that are not on a vector boundary are done one
//     element per thread.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

namespace megatron_opt {

constexpr int kThreads = 256;          // threads per block of every streaming kernel
constexpr int kMaxBlocksPerSM = 8;     // 8 * 256 = 2048 resident threads on sm_80/sm_90
constexpr int kFinalizeThreads = 256;  // the one-block reduction of grad_stats partials

// ---------------------------------------------------------------------------------------------
// dtype traits: storage type + exact conversions to/from fp32 (round to nearest even on the way down)
// ---------------------------------------------------------------------------------------------
struct F32 {
  using S = float;
  static __device__ __forceinline__ float to_float(float x) { return x; }
  static __device__ __forceinline__ float from_float(float x) { return x; }
};

struct BF16 {
  using S = uint16_t;
  static __device__ __forceinline__ float to_float(uint16_t x) {
    return __uint_as_float(static_cast<unsigned int>(x) << 16);  // exact: bf16 is the top half of fp32
  }
  static __device__ __forceinline__ uint16_t from_float(float x) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
};

struct F16 {
  using S = uint16_t;
  static __device__ __forceinline__ float to_float(uint16_t x) { return __half2float(__ushort_as_half(x)); }
  static __device__ __forceinline__ uint16_t from_float(float x) { return __half_as_ushort(__float2half_rn(x)); }
};

__device__ __forceinline__ bool is_finite_f(float x) {
  return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

// ---------------------------------------------------------------------------------------------
// Packs of N consecutive elements, moved with 16-byte (or 8/4-byte) memory instructions.
// The caller guarantees the address is aligned to N * sizeof(S) bytes.
// ---------------------------------------------------------------------------------------------
template <typename S, int N>
struct PackAlign {
  static constexpr int bytes = static_cast<int>(sizeof(S)) * N;
  static constexpr int value = bytes >= 16 ? 16 : bytes;
};

template <typename S, int N>
struct alignas(PackAlign<S, N>::value) Pack {
  S e[N];
};

template <typename S, int N>
__device__ __forceinline__ Pack<S, N> load_pack(const S* p) {
  constexpr int B = static_cast<int>(sizeof(S)) * N;
  static_assert(B == 4 || B == 8 || B % 16 == 0, "unsupported pack size");
  Pack<S, N> out;
  if constexpr (B % 16 == 0) {
    const uint4* src = reinterpret_cast<const uint4*>(p);
    uint4* dst = reinterpret_cast<uint4*>(&out);
#pragma unroll
    for (int c = 0; c < B / 16; ++c) dst[c] = __ldcs(src + c);
  } else if constexpr (B == 8) {
    *reinterpret_cast<uint2*>(&out) = __ldcs(reinterpret_cast<const uint2*>(p));
  } else {
    *reinterpret_cast<unsigned int*>(&out) = __ldcs(reinterpret_cast<const unsigned int*>(p));
  }
  return out;
}

template <typename S, int N>
__device__ __forceinline__ void store_pack(S* p, const Pack<S, N>& v) {
  constexpr int B = static_cast<int>(sizeof(S)) * N;
  static_assert(B == 4 || B == 8 || B % 16 == 0, "unsupported pack size");
  if constexpr (B % 16 == 0) {
    uint4* dst = reinterpret_cast<uint4*>(p);
    const uint4* src = reinterpret_cast<const uint4*>(&v);
#pragma unroll
    for (int c = 0; c < B / 16; ++c) __stcs(dst + c, src[c]);
  } else if constexpr (B == 8) {
    __stcs(reinterpret_cast<uint2*>(p), *reinterpret_cast<const uint2*>(&v));
  } else {
    __stcs(reinterpret_cast<unsigned int*>(p), *reinterpret_cast<const unsigned int*>(&v));
  }
}

// ---------------------------------------------------------------------------------------------
// Deterministic block reduction (fixed shuffle tree, then fixed order over warps).
// Every thread of the block must call it; the result is valid in thread 0.
// `smem` must hold at least 32 elements; consecutive calls may share it.
// ---------------------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* smem) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  __syncthreads();  // earlier readers of smem are done
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  const int nwarps = (blockDim.x + 31) >> 5;
  v = (threadIdx.x < nwarps) ? smem[threadIdx.x] : T(0);
  if (warp == 0) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  }
  return v;
}

// ---------------------------------------------------------------------------------------------
// Work partition
// ---------------------------------------------------------------------------------------------
// Range of the span owned by this block. All block ranges start on a vector boundary
// (aligned_base is one and chunk is a multiple of VEC), so vector boundaries never move.
struct BlockRange {
  int64_t lo, hi;
};

__host__ __device__ __forceinline__ BlockRange block_range_of(int64_t b, int64_t span_start, int64_t span_end,
                                                             int64_t aligned_base, int64_t chunk) {
  BlockRange r;
  const int64_t lo = aligned_base + b * chunk;
  const int64_t hi = lo + chunk;
  r.lo = lo > span_start ? lo : span_start;
  r.hi = hi < span_end ? hi : span_end;
  return r;
}

__device__ __forceinline__ BlockRange block_range(int64_t span_start, int64_t span_end, int64_t aligned_base,
                                                  int64_t chunk) {
  return block_range_of(static_cast<int64_t>(blockIdx.x), span_start, span_end, aligned_base, chunk);
}

// First piece whose end is > pos (bounds is [npiece, 2] int64 row-major: start, end).
__host__ __device__ __forceinline__ int64_t first_piece_ending_after(const int64_t* bounds, int64_t npiece, int64_t pos) {
  int64_t lo = 0, hi = npiece;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (bounds[2 * mid + 1] <= pos) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Split [a, e) into a scalar head, a vector body and a scalar tail.
// Element i starts a vector iff (i + phase) % VEC == 0.
struct Split {
  int64_t head_end;  // head = [a, head_end)
  int64_t nvec;      // body = [head_end, head_end + nvec * VEC)
  int64_t body_end;  // tail = [body_end, e)
};

template <int VEC>
__host__ __device__ __forceinline__ Split split_range(int64_t a, int64_t e, int phase) {
  Split s;
  const int64_t mis = (a + phase) % VEC;
  const int64_t aligned = a + (mis == 0 ? 0 : VEC - mis);
  s.head_end = aligned < e ? aligned : e;
  s.nvec = (e - s.head_end) / VEC;
  s.body_end = s.head_end + s.nvec * VEC;
  return s;
}

// ---------------------------------------------------------------------------------------------
// Host-side launch helpers
// ---------------------------------------------------------------------------------------------
// Common element phase (pointer / elem_size) % vec of all arrays, or -1 if they differ.
struct PtrInfo {
  const void* ptr;  // nullptr entries are ignored
  int64_t elem_size;
};

inline int common_phase(std::initializer_list<PtrInfo> arrays, int vec) {
  int phase = -1;
  for (const PtrInfo& a : arrays) {
    if (a.ptr == nullptr) continue;
    const uint64_t addr = reinterpret_cast<uint64_t>(a.ptr);
    if (addr % static_cast<uint64_t>(a.elem_size) != 0) return -1;
    const int r = static_cast<int>((addr / static_cast<uint64_t>(a.elem_size)) % static_cast<uint64_t>(vec));
    if (phase == -1) {
      phase = r;
    } else if (phase != r) {
      return -1;
    }
  }
  return phase;
}

struct LaunchPlan {
  int grid;
  int64_t aligned_base;  // a vector boundary <= span_start
  int64_t chunk;         // elements per block, a multiple of vec
  int phase;             // common phase (0 when !vec_ok)
  bool vec_ok;
};

template <typename Kernel>
inline int max_blocks_per_sm(Kernel kernel) {
  int n = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0));
  return std::max(1, std::min(n, kMaxBlocksPerSM));
}

// Pure partition math (also exercised on the host by csrc/tests/check_partition.cu).
// min_per_block: elements that make one block worth launching (one full unrolled iteration).
inline LaunchPlan plan_partition(int64_t span_start, int64_t span_end, int phase, int vec, int64_t max_grid,
                                 int64_t min_per_block) {
  LaunchPlan p;
  p.vec_ok = phase >= 0;
  p.phase = p.vec_ok ? phase : 0;
  const int64_t v = p.vec_ok ? vec : 1;
  p.aligned_base = p.vec_ok ? span_start - ((span_start + p.phase) % v) : span_start;
  const int64_t total = span_end - p.aligned_base;
  const int64_t want = (total + min_per_block - 1) / min_per_block;
  p.grid = static_cast<int>(std::max<int64_t>(1, std::min(max_grid, want)));
  int64_t chunk = (total + p.grid - 1) / p.grid;
  chunk = (chunk + v - 1) / v * v;
  p.chunk = std::max<int64_t>(chunk, v);
  return p;
}

inline LaunchPlan make_plan(int64_t span_start, int64_t span_end, int phase, int vec, int blocks_per_sm,
                            int64_t min_per_block) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return plan_partition(span_start, span_end, phase, vec, static_cast<int64_t>(sms) * blocks_per_sm, min_per_block);
}

// ---------------------------------------------------------------------------------------------
// Host-side argument checks (the Python wrapper checks first, with friendlier messages)
// ---------------------------------------------------------------------------------------------
inline void check_cuda_tensor(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == device, name, " must be on ", device, ", got ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

inline void check_dtype(const at::Tensor& t, const char* name, at::ScalarType dt) {
  TORCH_CHECK(t.scalar_type() == dt, name, " must have dtype ", dt, ", got ", t.scalar_type());
}

inline void check_flat(const at::Tensor& t, const char* name, int64_t min_numel) {
  TORCH_CHECK(t.dim() == 1, name, " must be 1-D, got shape ", t.sizes());
  TORCH_CHECK(t.numel() >= min_numel, name, " has ", t.numel(), " elements, the table needs ", min_numel);
}

inline void check_scalar(const at::Tensor& t, const char* name, const at::Device& device, at::ScalarType dt) {
  check_cuda_tensor(t, name, device);
  check_dtype(t, name, dt);
  TORCH_CHECK(t.numel() == 1, name, " must have exactly one element, got ", t.numel());
}

inline void check_table(const at::Tensor& bounds, const at::Tensor& per_piece, const char* per_piece_name,
                        at::ScalarType per_piece_dtype, const at::Device& device) {
  check_cuda_tensor(bounds, "bounds", device);
  check_dtype(bounds, "bounds", at::kLong);
  TORCH_CHECK(bounds.dim() == 2 && bounds.size(1) == 2, "bounds must have shape [npiece, 2]");
  check_cuda_tensor(per_piece, per_piece_name, device);
  check_dtype(per_piece, per_piece_name, per_piece_dtype);
  TORCH_CHECK(per_piece.dim() == 1 && per_piece.size(0) == bounds.size(0), per_piece_name,
              " must have one entry per piece");
}

inline bool is_grad_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

}  // namespace megatron_opt
