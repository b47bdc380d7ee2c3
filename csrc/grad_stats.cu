// Pass 1: read the grad shard once and accumulate
//   stats[0] += number of non-finite grad elements inside the pieces
//   stats[1] += sum over in-norm pieces of (float(g) * inv_scale)^2
//   stats[2] += number of grad elements equal to +0.0 or -0.0 inside the pieces (if count_zeros)
// Nothing else is written.
//
// Determinism: every thread visits a fixed set of elements in a fixed order, blocks reduce with a
// fixed tree and write one partial each to a workspace, and a second one-block kernel sums the
// partials in index order. The grid depends only on the span and the device, so two runs on the
// same device give bitwise equal stats.
//
// Precision: squares are summed in fp32 over at most UNROLL*VEC (= 32 or 16) elements, and those
// short partial sums are accumulated in fp64 per thread, per block and across blocks.
#include "common.cuh"
#include "launch.h"

namespace megatron_opt {
namespace {

template <typename GT>
__device__ __forceinline__ void stats_one(typename GT::S raw, float inv, bool norm, double& sumsq,
                                          unsigned long long& nonfinite, unsigned long long& zeros) {
  const float x = GT::to_float(raw);
  nonfinite += is_finite_f(x) ? 0ull : 1ull;
  zeros += (x == 0.0f) ? 1ull : 0ull;
  if (norm) {
    const float y = x * inv;
    sumsq += static_cast<double>(y * y);
  }
}

template <typename GT, int VEC, int UNROLL>
__global__ void __launch_bounds__(kThreads)
    grad_stats_kernel(const typename GT::S* __restrict__ grad, const int64_t* __restrict__ bounds,
                      const uint8_t* __restrict__ in_norm, int64_t npiece, const float* __restrict__ inv_scale_ptr,
                      double* __restrict__ partials, int64_t span_start, int64_t span_end, int64_t aligned_base,
                      int64_t chunk, int phase, bool vec_ok) {
  using S = typename GT::S;
  const float inv = *inv_scale_ptr;
  double sumsq = 0.0;
  unsigned long long nonfinite = 0ull, zeros = 0ull;

  const BlockRange r = block_range(span_start, span_end, aligned_base, chunk);
  if (r.lo < r.hi) {
    for (int64_t s = first_piece_ending_after(bounds, npiece, r.lo); s < npiece; ++s) {
      const int64_t seg_start = bounds[2 * s];
      if (seg_start >= r.hi) break;
      const int64_t a = max(seg_start, r.lo);
      const int64_t e = min(bounds[2 * s + 1], r.hi);
      const bool norm = in_norm[s] != 0;
      if (vec_ok) {
        const Split sp = split_range<VEC>(a, e, phase);
        if (static_cast<int64_t>(threadIdx.x) < sp.head_end - a) {
          stats_one<GT>(grad[a + threadIdx.x], inv, norm, sumsq, nonfinite, zeros);
        }
        if (static_cast<int64_t>(threadIdx.x) < e - sp.body_end) {
          stats_one<GT>(grad[sp.body_end + threadIdx.x], inv, norm, sumsq, nonfinite, zeros);
        }
        const S* body = grad + sp.head_end;
        for (int64_t base = 0; base < sp.nvec; base += static_cast<int64_t>(kThreads) * UNROLL) {
          Pack<S, VEC> pk[UNROLL];
#pragma unroll
          for (int u = 0; u < UNROLL; ++u) {
            const int64_t v = base + static_cast<int64_t>(u) * kThreads + threadIdx.x;
            if (v < sp.nvec) pk[u] = load_pack<S, VEC>(body + v * VEC);
          }
          float part = 0.0f;
#pragma unroll
          for (int u = 0; u < UNROLL; ++u) {
            const int64_t v = base + static_cast<int64_t>(u) * kThreads + threadIdx.x;
            if (v < sp.nvec) {
#pragma unroll
              for (int j = 0; j < VEC; ++j) {
                const float x = GT::to_float(pk[u].e[j]);
                nonfinite += is_finite_f(x) ? 0ull : 1ull;
                zeros += (x == 0.0f) ? 1ull : 0ull;
                const float y = x * inv;
                part += y * y;
              }
            }
          }
          if (norm) sumsq += static_cast<double>(part);
        }
      } else {
        for (int64_t i = a + threadIdx.x; i < e; i += kThreads) {
          stats_one<GT>(grad[i], inv, norm, sumsq, nonfinite, zeros);
        }
      }
    }
  }

  __shared__ double smem_d[32];
  __shared__ unsigned long long smem_u[32];
  const double b_sumsq = block_sum(sumsq, smem_d);
  const unsigned long long b_nonfinite = block_sum(nonfinite, smem_u);
  const unsigned long long b_zeros = block_sum(zeros, smem_u);
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = static_cast<double>(b_nonfinite);
    partials[gridDim.x + blockIdx.x] = b_sumsq;
    partials[2 * gridDim.x + blockIdx.x] = static_cast<double>(b_zeros);
  }
}

// One block: stats[k] += sum_b partials[k][b], in a fixed order.
__global__ void __launch_bounds__(kFinalizeThreads)
    grad_stats_finalize_kernel(const double* __restrict__ partials, int nblocks, double* __restrict__ stats,
                               bool count_zeros) {
  double acc[3] = {0.0, 0.0, 0.0};
  for (int b = threadIdx.x; b < nblocks; b += blockDim.x) {
#pragma unroll
    for (int k = 0; k < 3; ++k) acc[k] += partials[k * nblocks + b];
  }
  __shared__ double smem[32];
  double tot[3];
#pragma unroll
  for (int k = 0; k < 3; ++k) tot[k] = block_sum(acc[k], smem);
  if (threadIdx.x == 0) {
    stats[0] += tot[0];
    stats[1] += tot[1];
    if (count_zeros) stats[2] += tot[2];
  }
}

template <typename GT>
void launch_grad_stats(const at::Tensor& grad, const at::Tensor& bounds, const at::Tensor& in_norm,
                       int64_t span_start, int64_t span_end, const at::Tensor& inv_scale, const at::Tensor& stats,
                       bool count_zeros) {
  using S = typename GT::S;
  constexpr int VEC = 16 / static_cast<int>(sizeof(S));
  constexpr int UNROLL = 4;
  auto kernel = grad_stats_kernel<GT, VEC, UNROLL>;
  static const int blocks_per_sm = max_blocks_per_sm(kernel);

  const S* g = reinterpret_cast<const S*>(grad.data_ptr());
  const int phase = common_phase({{g, static_cast<int64_t>(sizeof(S))}}, VEC);
  const LaunchPlan p =
      make_plan(span_start, span_end, phase, VEC, blocks_per_sm, static_cast<int64_t>(kThreads) * VEC * UNROLL);
  at::Tensor partials = at::empty({3 * static_cast<int64_t>(p.grid)}, grad.options().dtype(at::kDouble));
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  kernel<<<p.grid, kThreads, 0, stream>>>(g, bounds.data_ptr<int64_t>(), in_norm.data_ptr<uint8_t>(), bounds.size(0),
                                          inv_scale.data_ptr<float>(), partials.data_ptr<double>(), span_start,
                                          span_end, p.aligned_base, p.chunk, p.phase, p.vec_ok);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  grad_stats_finalize_kernel<<<1, kFinalizeThreads, 0, stream>>>(partials.data_ptr<double>(), p.grid,
                                                                  stats.data_ptr<double>(), count_zeros);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void grad_stats_cuda(const at::Tensor& grad, const at::Tensor& bounds, const at::Tensor& in_norm,
                     int64_t span_start, int64_t span_end, const at::Tensor& inv_scale, const at::Tensor& stats,
                     bool count_zeros) {
  TORCH_CHECK(grad.is_cuda(), "grad_stats: grad must be a CUDA tensor");
  const at::Device device = grad.device();
  check_cuda_tensor(grad, "grad", device);
  TORCH_CHECK(is_grad_dtype(grad.scalar_type()), "grad_stats: grad must be float32, bfloat16 or float16, got ",
              grad.scalar_type());
  TORCH_CHECK(0 <= span_start && span_start <= span_end, "grad_stats: bad span [", span_start, ", ", span_end, ")");
  check_flat(grad, "grad", span_end);
  check_table(bounds, in_norm, "in_norm", at::kByte, device);
  check_scalar(inv_scale, "inv_scale", device, at::kFloat);
  check_cuda_tensor(stats, "stats", device);
  check_dtype(stats, "stats", at::kDouble);
  TORCH_CHECK(stats.numel() == 3, "stats must have 3 elements, got ", stats.numel());
  if (span_start == span_end || bounds.size(0) == 0) return;

  const c10::cuda::CUDAGuard guard(device);
  switch (grad.scalar_type()) {
    case at::kFloat:
      launch_grad_stats<F32>(grad, bounds, in_norm, span_start, span_end, inv_scale, stats, count_zeros);
      break;
    case at::kBFloat16:
      launch_grad_stats<BF16>(grad, bounds, in_norm, span_start, span_end, inv_scale, stats, count_zeros);
      break;
    case at::kHalf:
      launch_grad_stats<F16>(grad, bounds, in_norm, span_start, span_end, inv_scale, stats, count_zeros);
      break;
    default:
      TORCH_CHECK(false, "grad_stats: unsupported grad dtype ", grad.scalar_type());
  }
}

}  // namespace megatron_opt
