// Pass 1: read the grad once over every chunk of a step plan and accumulate
//   stats[0] += number of non-finite grad elements inside the pieces
//   stats[1] += inv_scale^2 * sum over in-norm pieces of float(g)^2
//   stats[2] += number of grad elements equal to +0.0 or -0.0 inside the in-norm pieces (only if count_zeros)
// Nothing else is written.
//
// Precision: each square is taken in fp64 (exact for fp32/bf16/fp16 inputs) and summed in fp64, then
// scaled by inv_scale^2 once, as the reference does: no overflow for any finite grad, no underflow.
//
// Non-finite detection costs nothing per element: a chunk's fp64 sum of squares of finite values
// cannot overflow (at most 2^15 elements of at most 2^256 each), so the sum is non-finite exactly when
// the chunk holds an inf or NaN; only then the block re-reads its chunk to count them.
//
// Determinism: block b reduces chunk b in a fixed order and writes one partial per chunk; a one-block
// kernel sums the partials in a fixed order. Chunks depend only on the plan, so the stats are bitwise
// the same on any GPU, grid size or MIG partition.
#include "common.cuh"
#include "launch.h"

namespace megatron_opt {
namespace {

constexpr int kStatsUnroll = 4;

template <bool kCountZeros>
__device__ __forceinline__ void visit(float x, double& acc, uint32_t& zeros) {
  const double d = static_cast<double>(x);
  acc = fma(d, d, acc);
  if constexpr (kCountZeros) zeros += (x == 0.0f) ? 1u : 0u;
}

template <typename GT, bool kCountZeros>
__global__ void __launch_bounds__(kThreads)
    grad_stats_kernel(const int64_t* __restrict__ ptrs, const int64_t* __restrict__ chunks,
                      double* __restrict__ sumsq_out, uint32_t* __restrict__ counts_out) {
  using S = typename GT::S;
  constexpr int VEC = 16 / static_cast<int>(sizeof(S));
  const int64_t c = blockIdx.x;
  const Chunk k = load_chunk(chunks, c);
  const S* grad = reinterpret_cast<const S*>(ptrs[kPtrCols * k.shard]);
  double acc0 = 0.0, acc1 = 0.0;  // two chains: a dependent fp64 fma chain would stall the loop
  uint32_t zeros = 0u;

  if (k.phase >= 0) {
    const Split sp = split_range<VEC>(k.start, k.end, k.phase);
    if (static_cast<int64_t>(threadIdx.x) < sp.head_end - k.start) {
      visit<kCountZeros>(GT::to_float(grad[k.start + threadIdx.x]), acc0, zeros);
    }
    if (static_cast<int64_t>(threadIdx.x) < k.end - sp.body_end) {
      visit<kCountZeros>(GT::to_float(grad[sp.body_end + threadIdx.x]), acc1, zeros);
    }
    const S* body = grad + sp.head_end;
    for (int64_t base = 0; base < sp.nvec; base += static_cast<int64_t>(kThreads) * kStatsUnroll) {
      Pack<S, VEC> pk[kStatsUnroll];
#pragma unroll
      for (int u = 0; u < kStatsUnroll; ++u) {
        const int64_t v = base + static_cast<int64_t>(u) * kThreads + threadIdx.x;
        if (v < sp.nvec) pk[u] = load_pack<S, VEC>(body + v * VEC);
      }
#pragma unroll
      for (int u = 0; u < kStatsUnroll; ++u) {
        const int64_t v = base + static_cast<int64_t>(u) * kThreads + threadIdx.x;
        if (v < sp.nvec) {
#pragma unroll
          for (int j = 0; j < VEC; j += 2) {
            visit<kCountZeros>(GT::to_float(pk[u].e[j]), acc0, zeros);
            visit<kCountZeros>(GT::to_float(pk[u].e[j + 1]), acc1, zeros);
          }
        }
      }
    }
  } else {
    for (int64_t i = k.start + threadIdx.x; i < k.end; i += kThreads) {
      visit<kCountZeros>(GT::to_float(grad[i]), acc0, zeros);
    }
  }

  __shared__ double smem_d[32];
  __shared__ uint32_t smem_u[32];
  __shared__ int bad;
  const double total = block_sum(acc0 + acc1, smem_d);
  const uint32_t nzero = kCountZeros ? block_sum(zeros, smem_u) : 0u;
  if (threadIdx.x == 0) bad = isfinite(total) ? 0 : 1;
  __syncthreads();
  uint32_t nonfinite = 0u;
  if (bad) {  // rare: count the non-finite elements exactly
    uint32_t n = 0u;
    for (int64_t i = k.start + threadIdx.x; i < k.end; i += kThreads) n += is_finite_f(GT::to_float(grad[i])) ? 0u : 1u;
    nonfinite = block_sum(n, smem_u);
  }
  if (threadIdx.x == 0) {
    sumsq_out[c] = k.in_norm ? total : 0.0;
    counts_out[2 * c] = nonfinite;
    counts_out[2 * c + 1] = k.in_norm ? nzero : 0u;  // zeros follow the norm's counting rule
  }
}

// One block: stats[k] += the sum of the chunk partials, in a fixed order.
template <bool kCountZeros>
__global__ void __launch_bounds__(kFinalizeThreads)
    grad_stats_finalize_kernel(const double* __restrict__ sumsq, const uint32_t* __restrict__ counts, int64_t nchunk,
                               const float* __restrict__ inv_scale_ptr, double* __restrict__ stats) {
  double s = 0.0;
  unsigned long long nonfinite = 0ull, zeros = 0ull;
  for (int64_t i = threadIdx.x; i < nchunk; i += kFinalizeThreads) {
    s += sumsq[i];
    nonfinite += counts[2 * i];
    if constexpr (kCountZeros) zeros += counts[2 * i + 1];
  }
  __shared__ double smem_d[32];
  __shared__ unsigned long long smem_u[32];
  const double tot_s = block_sum(s, smem_d);
  const unsigned long long tot_nf = block_sum(nonfinite, smem_u);
  const unsigned long long tot_z = kCountZeros ? block_sum(zeros, smem_u) : 0ull;
  if (threadIdx.x == 0) {
    const double inv = static_cast<double>(*inv_scale_ptr);
    stats[0] += static_cast<double>(tot_nf);
    stats[1] += tot_s * (inv * inv);
    if constexpr (kCountZeros) stats[2] += static_cast<double>(tot_z);
  }
}

template <typename GT>
void launch_grad_stats(const at::Tensor& ptrs, const at::Tensor& chunks, const at::Tensor& inv_scale,
                       const at::Tensor& stats, const at::Tensor& sumsq_ws, const at::Tensor& counts_ws,
                       bool count_zeros) {
  const int64_t n = chunks.size(0);
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t* p = ptrs.data_ptr<int64_t>();
  const int64_t* c = chunks.data_ptr<int64_t>();
  double* ws = sumsq_ws.data_ptr<double>();
  uint32_t* cnt = reinterpret_cast<uint32_t*>(counts_ws.data_ptr<int32_t>());
  const unsigned grid = static_cast<unsigned>(n);
  if (count_zeros) {
    grad_stats_kernel<GT, true><<<grid, kThreads, 0, stream>>>(p, c, ws, cnt);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    grad_stats_finalize_kernel<true><<<1, kFinalizeThreads, 0, stream>>>(ws, cnt, n, inv_scale.data_ptr<float>(),
                                                                         stats.data_ptr<double>());
  } else {
    grad_stats_kernel<GT, false><<<grid, kThreads, 0, stream>>>(p, c, ws, cnt);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    grad_stats_finalize_kernel<false><<<1, kFinalizeThreads, 0, stream>>>(ws, cnt, n, inv_scale.data_ptr<float>(),
                                                                          stats.data_ptr<double>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void grad_stats_cuda(const at::Tensor& ptrs, const at::Tensor& chunks, int64_t grad_code,
                     const at::Tensor& inv_scale, const at::Tensor& stats, const at::Tensor& sumsq_ws,
                     const at::Tensor& counts_ws, bool count_zeros) {
  TORCH_CHECK(stats.is_cuda(), "grad_stats: stats must be a CUDA tensor");
  const at::Device device = stats.device();
  check_plan_tables(ptrs, chunks, device);
  check_scalar(inv_scale, "inv_scale", device, at::kFloat);
  check_cuda_tensor(stats, "stats", device);
  check_dtype(stats, "stats", at::kDouble);
  TORCH_CHECK(stats.numel() == 3, "stats must have 3 elements, got ", stats.numel());
  check_cuda_tensor(sumsq_ws, "sumsq_ws", device);
  check_dtype(sumsq_ws, "sumsq_ws", at::kDouble);
  check_cuda_tensor(counts_ws, "counts_ws", device);
  check_dtype(counts_ws, "counts_ws", at::kInt);
  TORCH_CHECK(sumsq_ws.numel() >= chunks.size(0) && counts_ws.numel() >= 2 * chunks.size(0),
              "grad_stats: workspace smaller than the chunk table");
  if (chunks.size(0) == 0) return;

  const c10::cuda::CUDAGuard guard(device);
  switch (grad_code) {
    case kCodeF32:
      launch_grad_stats<F32>(ptrs, chunks, inv_scale, stats, sumsq_ws, counts_ws, count_zeros);
      break;
    case kCodeBF16:
      launch_grad_stats<BF16>(ptrs, chunks, inv_scale, stats, sumsq_ws, counts_ws, count_zeros);
      break;
    case kCodeF16:
      launch_grad_stats<F16>(ptrs, chunks, inv_scale, stats, sumsq_ws, counts_ws, count_zeros);
      break;
    default:
      TORCH_CHECK(false, "grad_stats: unknown grad dtype code ", grad_code);
  }
}

}  // namespace megatron_opt
