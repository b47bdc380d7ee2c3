// Shared device and host helpers for the megatron_opt kernels.
//
// Conventions used by every kernel in this directory:
//   * 16-bit floats are carried as raw uint16_t bits and converted with the CUDA intrinsics, so the
//     kernels never depend on the (operator-less) __half / __nv_bfloat16 classes.
//   * All element indices are int64_t.
//   * A launch covers every shard of a step plan (megatron_opt/ops/step_plan.py): a pointer table
//     (one row of raw addresses per shard) and a chunk table (one row per chunk: shard, start, end,
//     meta). Chunks have a fixed maximum size, never cross a piece boundary and never include
//     padding, and the grid is one block per chunk. So the work of a block, and any partial result
//     it writes, depends on the table alone, never on the GPU model or the grid size.
//   * "Vector" accesses move VEC consecutive elements of every array at once (16 bytes of the grad).
//     The host records per chunk the common element phase of all its arrays modulo VEC, or "none"
//     (then the chunk runs one element per thread); heads/tails off a vector boundary are scalar.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

namespace megatron_opt {

constexpr int kThreads = 256;          // threads per block of every streaming kernel
constexpr int kFinalizeThreads = 1024;  // the one-block reduction of grad_stats chunk partials

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
// Step-plan tables (layout shared with megatron_opt/ops/step_plan.py)
// ---------------------------------------------------------------------------------------------
constexpr int kPtrCols = 5;    // per shard: grad, master, state0, state1, param_out (0 when absent)
constexpr int kChunkCols = 4;  // per chunk: shard, start, end, meta
constexpr int64_t kGroupMask = 0xffffffffLL;  // meta bits 0..31: param-group id
constexpr int kInNormBit = 32;                // meta bit 32: the piece counts in the grad norm
constexpr int kPhaseShift = 40;               // meta bits 40..47: vector phase + 1 (0: scalar only)

struct Chunk {
  int64_t shard, start, end;
  int group;
  bool in_norm;
  int phase;  // -1: no common phase, scalar path
};

__device__ __forceinline__ Chunk load_chunk(const int64_t* __restrict__ chunks, int64_t c) {
  const int64_t* r = chunks + kChunkCols * c;
  Chunk k;
  k.shard = r[0];
  k.start = r[1];
  k.end = r[2];
  const int64_t meta = r[3];
  k.group = static_cast<int>(meta & kGroupMask);
  k.in_norm = ((meta >> kInNormBit) & 1) != 0;
  k.phase = static_cast<int>((meta >> kPhaseShift) & 0xff) - 1;
  return k;
}

// dtype codes of the step-plan entry points (ops/step_plan.py DTYPE_CODES)
constexpr int kCodeF32 = 0, kCodeBF16 = 1, kCodeF16 = 2, kCodeNone = -1;
// master storage codes (ops/step_plan.py MASTER_CODES): kCodeF32, kCodeF16, or the int16 remainder
// of a bf16 param (precision.cuh)
constexpr int kCodeRem = 3;

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

// A step plan's tables: int64, contiguous, on `device`, with the expected column count.
inline void check_plan_tables(const at::Tensor& ptrs, const at::Tensor& chunks, const at::Device& device) {
  check_cuda_tensor(ptrs, "ptrs", device);
  check_dtype(ptrs, "ptrs", at::kLong);
  TORCH_CHECK(ptrs.dim() == 2 && ptrs.size(1) == kPtrCols, "ptrs must have shape [nshard, ", kPtrCols, "]");
  check_cuda_tensor(chunks, "chunks", device);
  check_dtype(chunks, "chunks", at::kLong);
  TORCH_CHECK(chunks.dim() == 2 && chunks.size(1) == kChunkCols, "chunks must have shape [nchunk, ", kChunkCols, "]");
  TORCH_CHECK(chunks.size(0) <= INT32_MAX, "too many chunks for one launch: ", chunks.size(0));
}

inline bool is_grad_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

}  // namespace megatron_opt
