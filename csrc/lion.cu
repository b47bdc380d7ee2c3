// Pass 2, Lion (Chen et al. 2023, decoupled weight decay) on the fp32 master, fp32 momentum,
// optional write of the rounded master into param_out (model dtype):
//
//   c = m.lerp(g, 1 - beta1);  w *= 1 - lr*wd (when lr*wd != 0);  w -= lr * sign(c);  m.lerp_(g, 1 - beta2)
//
// sign follows torch.sign: sign(+-0) = +0 and sign(NaN) = 0 (a NaN c moves w by the decay only).
// Piece walking, found_inf skip, per-group lr/wd and the dtype dispatch: see pass2.cuh.
#include "launch.h"
#include "pass2.cuh"

namespace megatron_opt {
namespace {

struct LionConsts {
  float lerp1;  // (float)(1 - beta1)
  float lerp2;  // (float)(1 - beta2)
};

struct LionSegConsts {
  float grad_scale;
  float lr;            // (float)lr
  float decay_factor;  // (float)(1 - lr * wd)
  bool decay;          // lr * wd != 0
};

// torch's lerp as its CUDA kernel computes it in fp32 (the same formula as adamw_math's m update):
// weight < 0.5 ? start + w*(end - start) : end - (1-w)*(end - start), each form one fma;
// fma(w - 1, diff, end) == fma(-(1 - w), diff, end) since w - 1 rounds exactly like 1 - w.
__device__ __forceinline__ float torch_lerp(float start, float end, float weight) {
  const float diff = __fsub_rn(end, start);
  const bool small = fabsf(weight) < 0.5f;
  const float coeff = small ? weight : __fsub_rn(weight, 1.0f);
  return fmaf(coeff, diff, small ? start : end);
}

// torch.sign for fp32: (0 < x) - (x < 0), so +-0 and NaN give +0.
__device__ __forceinline__ float torch_sign(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f); }

__device__ __forceinline__ void lion_math(float graw, float& w, float& m, const LionConsts& c,
                                          const LionSegConsts& k) {
  const float g = __fmul_rn(graw, k.grad_scale);            // grad.float() * grad_scale
  const float dir = torch_sign(torch_lerp(m, g, c.lerp1));  // m.lerp(g, 1 - beta1).sign_()
  if (k.decay) w = __fmul_rn(w, k.decay_factor);            // w.mul_(1 - lr * wd)
  w = fmaf(-k.lr, dir, w);                                  // w.sub_(dir, alpha=lr); lr * dir is exact
  m = torch_lerp(m, g, c.lerp2);                            // m.lerp_(g, 1 - beta2)
}

template <typename GT, typename PT>
__device__ __forceinline__ void lion_one(const typename GT::S* grad, float* master, float* exp_avg,
                                         typename PT::S* param_out, int64_t i, const LionConsts& c,
                                         const LionSegConsts& k) {
  float w = master[i], m = exp_avg[i];
  lion_math(GT::to_float(grad[i]), w, m, c, k);
  master[i] = w;
  exp_avg[i] = m;
  if (param_out != nullptr) param_out[i] = PT::from_float(w);
}

template <typename GT, typename PT, int VEC>
__global__ void __launch_bounds__(kThreads)
    lion_kernel(const typename GT::S* grad, float* master, float* exp_avg, typename PT::S* param_out,
                const int64_t* __restrict__ bounds, const int32_t* __restrict__ group, int64_t npiece,
                const __grid_constant__ GroupSource groups, const float* __restrict__ grad_scale_ptr,
                const float* __restrict__ found_inf_ptr, const LionConsts c, int64_t span_start, int64_t span_end,
                int64_t aligned_base, int64_t chunk, int phase, bool vec_ok) {
  using GS = typename GT::S;
  using PS = typename PT::S;
  if (found_inf_ptr != nullptr && *found_inf_ptr != 0.0f) return;  // skipped step: write nothing
  const BlockRange r = block_range(span_start, span_end, aligned_base, chunk);
  if (r.lo >= r.hi) return;

  LionSegConsts k;
  k.grad_scale = *grad_scale_ptr;

  for (int64_t s = first_piece_ending_after(bounds, npiece, r.lo); s < npiece; ++s) {
    const int64_t seg_start = bounds[2 * s];
    if (seg_start >= r.hi) break;
    const int64_t a = max(seg_start, r.lo);
    const int64_t e = min(bounds[2 * s + 1], r.hi);
    double lr, wd;
    group_lr_wd(groups, group, s, lr, wd);
    k.lr = static_cast<float>(lr);
    const double decay = lr * wd;
    k.decay = decay != 0.0;
    k.decay_factor = static_cast<float>(1.0 - decay);

    if (vec_ok) {
      const Split sp = split_range<VEC>(a, e, phase);
      if (static_cast<int64_t>(threadIdx.x) < sp.head_end - a) {
        lion_one<GT, PT>(grad, master, exp_avg, param_out, a + threadIdx.x, c, k);
      }
      if (static_cast<int64_t>(threadIdx.x) < e - sp.body_end) {
        lion_one<GT, PT>(grad, master, exp_avg, param_out, sp.body_end + threadIdx.x, c, k);
      }
      for (int64_t v = threadIdx.x; v < sp.nvec; v += kThreads) {
        const int64_t i = sp.head_end + v * VEC;
        const Pack<GS, VEC> gp = load_pack<GS, VEC>(grad + i);
        Pack<float, VEC> wp = load_pack<float, VEC>(master + i);
        Pack<float, VEC> mp = load_pack<float, VEC>(exp_avg + i);
#pragma unroll
        for (int j = 0; j < VEC; ++j) lion_math(GT::to_float(gp.e[j]), wp.e[j], mp.e[j], c, k);
        store_pack<float, VEC>(master + i, wp);
        store_pack<float, VEC>(exp_avg + i, mp);
        if (param_out != nullptr) {
          Pack<PS, VEC> pp;
#pragma unroll
          for (int j = 0; j < VEC; ++j) pp.e[j] = PT::from_float(wp.e[j]);
          store_pack<PS, VEC>(param_out + i, pp);
        }
      }
    } else {
      for (int64_t i = a + threadIdx.x; i < e; i += kThreads) {
        lion_one<GT, PT>(grad, master, exp_avg, param_out, i, c, k);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------------
template <typename GT, typename PT>
void launch_lion(const at::Tensor& grad, const at::Tensor& master, const at::Tensor& exp_avg,
                 const std::optional<at::Tensor>& param_out, const at::Tensor& bounds, const at::Tensor& group,
                 int64_t span_start, int64_t span_end, const GroupSource& groups, const at::Tensor& grad_scale,
                 const LionConsts& c, const std::optional<at::Tensor>& found_inf) {
  using GS = typename GT::S;
  using PS = typename PT::S;
  constexpr int VEC = 16 / static_cast<int>(sizeof(GS));
  auto kernel = lion_kernel<GT, PT, VEC>;
  static const int blocks_per_sm = max_blocks_per_sm(kernel);

  const GS* g = reinterpret_cast<const GS*>(grad.data_ptr());
  float* w = master.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  PS* po = param_out.has_value() ? reinterpret_cast<PS*>(param_out->data_ptr()) : nullptr;
  const int phase = common_phase(
      {{g, static_cast<int64_t>(sizeof(GS))}, {w, 4}, {m, 4}, {po, static_cast<int64_t>(sizeof(PS))}}, VEC);
  const LaunchPlan p = make_plan(span_start, span_end, phase, VEC, blocks_per_sm, static_cast<int64_t>(kThreads) * VEC);
  const float* fi = found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  kernel<<<p.grid, kThreads, 0, stream>>>(g, w, m, po, bounds.data_ptr<int64_t>(), group.data_ptr<int32_t>(),
                                          bounds.size(0), groups, grad_scale.data_ptr<float>(), fi, c, span_start,
                                          span_end, p.aligned_base, p.chunk, p.phase, p.vec_ok);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename GT, typename PT>
struct LionLauncher {
  template <typename... Args>
  static void run(Args&&... args) {
    launch_lion<GT, PT>(std::forward<Args>(args)...);
  }
};

}  // namespace

void lion_step_cuda(const at::Tensor& grad, const at::Tensor& master, const at::Tensor& exp_avg,
                    const std::optional<at::Tensor>& param_out, const at::Tensor& bounds, const at::Tensor& group,
                    int64_t span_start, int64_t span_end, const std::vector<double>& lr,
                    const std::vector<double>& weight_decay, const at::Tensor& grad_scale, double beta1, double beta2,
                    const std::optional<at::Tensor>& found_inf) {
  check_common("lion_step", grad, master, param_out, bounds, group, span_start, span_end, grad_scale, found_inf);
  const at::Device device = grad.device();
  check_state(exp_avg, "exp_avg", device, span_end);
  if (span_start == span_end || bounds.size(0) == 0) return;

  const c10::cuda::CUDAGuard guard(device);
  GroupSource groups;
  at::Tensor holder;
  prepare_groups(lr, weight_decay, device, groups, holder);
  LionConsts c;
  c.lerp1 = static_cast<float>(1.0 - beta1);
  c.lerp2 = static_cast<float>(1.0 - beta2);

  dispatch_grad_param<LionLauncher>(grad.scalar_type(), param_dtype(param_out), "lion_step", grad, master, exp_avg,
                                    param_out, bounds, group, span_start, span_end, groups, grad_scale, c,
                                    found_inf);
}

}  // namespace megatron_opt
