// Optional materialisation of fp32 main grads:
//   main_grad[i] = float(grad[i]) * inv_scale   for every i in [span_start, span_end)
//   found_inf    = max(found_inf, 1)            if any of those grads is inf or NaN
// Like the reference this covers the whole span (padding gaps hold zero grads, so they become 0).
// main_grad may be the very same tensor as an fp32 grad (in-place unscale): every element is read
// and written by the same thread.
#include "common.cuh"
#include "launch.h"

namespace megatron_opt {
namespace {

template <typename GT, int VEC, int UNROLL>
__global__ void __launch_bounds__(kThreads)
    copy_grads_kernel(const typename GT::S* grad, float* main_grad, const float* __restrict__ inv_scale_ptr,
                      float* found_inf, int64_t span_start, int64_t span_end, int64_t aligned_base, int64_t chunk,
                      int phase, bool vec_ok) {
  using S = typename GT::S;
  const float inv = *inv_scale_ptr;
  bool bad = false;

  const BlockRange r = block_range(span_start, span_end, aligned_base, chunk);
  if (r.lo < r.hi) {
    const int64_t a = r.lo, e = r.hi;
    if (vec_ok) {
      const Split sp = split_range<VEC>(a, e, phase);
      if (static_cast<int64_t>(threadIdx.x) < sp.head_end - a) {
        const int64_t i = a + threadIdx.x;
        const float x = GT::to_float(grad[i]);
        bad |= !is_finite_f(x);
        main_grad[i] = x * inv;
      }
      if (static_cast<int64_t>(threadIdx.x) < e - sp.body_end) {
        const int64_t i = sp.body_end + threadIdx.x;
        const float x = GT::to_float(grad[i]);
        bad |= !is_finite_f(x);
        main_grad[i] = x * inv;
      }
      for (int64_t base = 0; base < sp.nvec; base += static_cast<int64_t>(kThreads) * UNROLL) {
        Pack<S, VEC> pk[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const int64_t v = base + static_cast<int64_t>(u) * kThreads + threadIdx.x;
          if (v < sp.nvec) pk[u] = load_pack<S, VEC>(grad + sp.head_end + v * VEC);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const int64_t v = base + static_cast<int64_t>(u) * kThreads + threadIdx.x;
          if (v < sp.nvec) {
            Pack<float, VEC> out;
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
              const float x = GT::to_float(pk[u].e[j]);
              bad |= !is_finite_f(x);
              out.e[j] = x * inv;
            }
            store_pack<float, VEC>(main_grad + sp.head_end + v * VEC, out);
          }
        }
      }
    } else {
      for (int64_t i = a + threadIdx.x; i < e; i += kThreads) {
        const float x = GT::to_float(grad[i]);
        bad |= !is_finite_f(x);
        main_grad[i] = x * inv;
      }
    }
  }

  // All blocks that saw a non-finite value write the same value, so the race is benign.
  if (__syncthreads_or(bad ? 1 : 0) && threadIdx.x == 0) {
    const float cur = *found_inf;
    // torch.maximum(found_inf, 1): keeps values >= 1 and NaN, raises everything else to 1.
    if (!(cur >= 1.0f) && !(cur != cur)) *found_inf = 1.0f;
  }
}

template <typename GT>
void launch_copy(const at::Tensor& grad, const at::Tensor& main_grad, int64_t span_start, int64_t span_end,
                 const at::Tensor& inv_scale, const at::Tensor& found_inf) {
  using S = typename GT::S;
  constexpr int VEC = 16 / static_cast<int>(sizeof(S));
  constexpr int UNROLL = 2;
  auto kernel = copy_grads_kernel<GT, VEC, UNROLL>;
  static const int blocks_per_sm = max_blocks_per_sm(kernel);

  const S* g = reinterpret_cast<const S*>(grad.data_ptr());
  float* mg = main_grad.data_ptr<float>();
  const int phase = common_phase({{g, static_cast<int64_t>(sizeof(S))}, {mg, 4}}, VEC);
  const LaunchPlan p =
      make_plan(span_start, span_end, phase, VEC, blocks_per_sm, static_cast<int64_t>(kThreads) * VEC * UNROLL);
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  kernel<<<p.grid, kThreads, 0, stream>>>(g, mg, inv_scale.data_ptr<float>(), found_inf.data_ptr<float>(), span_start,
                                          span_end, p.aligned_base, p.chunk, p.phase, p.vec_ok);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void copy_grads_to_main_cuda(const at::Tensor& grad, const at::Tensor& main_grad, int64_t span_start,
                             int64_t span_end, const at::Tensor& inv_scale, const at::Tensor& found_inf) {
  TORCH_CHECK(grad.is_cuda(), "copy_grads_to_main: grad must be a CUDA tensor");
  const at::Device device = grad.device();
  check_cuda_tensor(grad, "grad", device);
  TORCH_CHECK(is_grad_dtype(grad.scalar_type()),
              "copy_grads_to_main: grad must be float32, bfloat16 or float16, got ", grad.scalar_type());
  TORCH_CHECK(0 <= span_start && span_start <= span_end, "copy_grads_to_main: bad span [", span_start, ", ",
              span_end, ")");
  check_flat(grad, "grad", span_end);
  check_cuda_tensor(main_grad, "main_grad", device);
  check_dtype(main_grad, "main_grad", at::kFloat);
  check_flat(main_grad, "main_grad", span_end);
  check_scalar(inv_scale, "inv_scale", device, at::kFloat);
  check_scalar(found_inf, "found_inf", device, at::kFloat);
  if (span_start == span_end) return;

  const c10::cuda::CUDAGuard guard(device);
  switch (grad.scalar_type()) {
    case at::kFloat:
      launch_copy<F32>(grad, main_grad, span_start, span_end, inv_scale, found_inf);
      break;
    case at::kBFloat16:
      launch_copy<BF16>(grad, main_grad, span_start, span_end, inv_scale, found_inf);
      break;
    case at::kHalf:
      launch_copy<F16>(grad, main_grad, span_start, span_end, inv_scale, found_inf);
      break;
    default:
      TORCH_CHECK(false, "copy_grads_to_main: unsupported grad dtype ", grad.scalar_type());
  }
}

}  // namespace megatron_opt
