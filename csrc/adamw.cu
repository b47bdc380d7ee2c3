// Pass 2, AdamW: torch.optim.AdamW's formula on the fp32 master (decoupled weight decay), fp32
// moments, optional write of the rounded master into param_out (model dtype).
//
// Piece walking, found_inf skip, per-group lr/wd and the dtype dispatch: see pass2.cuh.
#include "launch.h"
#include "pass2.cuh"

namespace megatron_opt {
namespace {

// ------------------------------------------------------------------------------------------------
// AdamW
// ------------------------------------------------------------------------------------------------
struct AdamConsts {
  double beta1, beta2;
  float lerp_weight;      // (float)(1 - beta1)
  float beta2_f;          // (float)beta2
  float one_minus_beta2;  // (float)(1 - beta2)
  float eps;              // (float)eps
};

struct AdamSegConsts {
  float grad_scale;
  float bc2_sqrt;      // (float)sqrt(1 - beta2^step)
  float step_size;     // (float)(lr / (1 - beta1^step))
  float decay_factor;  // (float)(1 - lr * wd)
  bool decay;          // lr * wd != 0
};

__device__ __forceinline__ void adamw_math(float graw, float& w, float& m, float& v, const AdamConsts& c,
                                           const AdamSegConsts& k) {
  const float g = __fmul_rn(graw, k.grad_scale);
  // m.lerp_(g, 1 - beta1), torch's lerp: weight < 0.5 ? m + w*(g-m) : g - (1-w)*(g-m)
  const float diff = __fsub_rn(g, m);
  const bool small = fabsf(c.lerp_weight) < 0.5f;
  const float coeff = small ? c.lerp_weight : __fsub_rn(c.lerp_weight, 1.0f);
  m = fmaf(coeff, diff, small ? m : g);
  // v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
  v = __fadd_rn(__fmul_rn(v, c.beta2_f), __fmul_rn(__fmul_rn(c.one_minus_beta2, g), g));
  // update = m / (sqrt(v) / sqrt(bias_correction2) + eps)
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), k.bc2_sqrt), c.eps);
  const float update = __fdiv_rn(m, denom);
  if (k.decay) w = __fmul_rn(w, k.decay_factor);
  w = __fsub_rn(w, __fmul_rn(update, k.step_size));
}

template <typename GT, typename PT>
__device__ __forceinline__ void adamw_one(const typename GT::S* grad, float* master, float* exp_avg,
                                          float* exp_avg_sq, typename PT::S* param_out, int64_t i,
                                          const AdamConsts& c, const AdamSegConsts& k) {
  float w = master[i], m = exp_avg[i], v = exp_avg_sq[i];
  adamw_math(GT::to_float(grad[i]), w, m, v, c, k);
  master[i] = w;
  exp_avg[i] = m;
  exp_avg_sq[i] = v;
  if (param_out != nullptr) param_out[i] = PT::from_float(w);
}

template <typename GT, typename PT, int VEC>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(const typename GT::S* grad, float* master, float* exp_avg, float* exp_avg_sq,
                 typename PT::S* param_out, const int64_t* __restrict__ bounds, const int32_t* __restrict__ group,
                 int64_t npiece, const __grid_constant__ GroupSource groups, const float* __restrict__ grad_scale_ptr,
                 const int64_t* __restrict__ step_ptr, const float* __restrict__ found_inf_ptr, const AdamConsts c,
                 int64_t span_start, int64_t span_end, int64_t aligned_base, int64_t chunk, int phase, bool vec_ok) {
  using GS = typename GT::S;
  using PS = typename PT::S;
  if (found_inf_ptr != nullptr && *found_inf_ptr != 0.0f) return;  // skipped step: write nothing
  const BlockRange r = block_range(span_start, span_end, aligned_base, chunk);
  if (r.lo >= r.hi) return;

  const double t = static_cast<double>(*step_ptr);
  const double bc1 = 1.0 - pow(c.beta1, t);
  AdamSegConsts k;
  k.grad_scale = *grad_scale_ptr;
  k.bc2_sqrt = static_cast<float>(sqrt(1.0 - pow(c.beta2, t)));

  for (int64_t s = first_piece_ending_after(bounds, npiece, r.lo); s < npiece; ++s) {
    const int64_t seg_start = bounds[2 * s];
    if (seg_start >= r.hi) break;
    const int64_t a = max(seg_start, r.lo);
    const int64_t e = min(bounds[2 * s + 1], r.hi);
    double lr, wd;
    group_lr_wd(groups, group, s, lr, wd);
    k.step_size = static_cast<float>(lr / bc1);
    const double decay = lr * wd;
    k.decay = decay != 0.0;
    k.decay_factor = static_cast<float>(1.0 - decay);

    if (vec_ok) {
      const Split sp = split_range<VEC>(a, e, phase);
      if (static_cast<int64_t>(threadIdx.x) < sp.head_end - a) {
        adamw_one<GT, PT>(grad, master, exp_avg, exp_avg_sq, param_out, a + threadIdx.x, c, k);
      }
      if (static_cast<int64_t>(threadIdx.x) < e - sp.body_end) {
        adamw_one<GT, PT>(grad, master, exp_avg, exp_avg_sq, param_out, sp.body_end + threadIdx.x, c, k);
      }
      for (int64_t v = threadIdx.x; v < sp.nvec; v += kThreads) {
        const int64_t i = sp.head_end + v * VEC;
        const Pack<GS, VEC> gp = load_pack<GS, VEC>(grad + i);
        Pack<float, VEC> wp = load_pack<float, VEC>(master + i);
        Pack<float, VEC> mp = load_pack<float, VEC>(exp_avg + i);
        Pack<float, VEC> vp = load_pack<float, VEC>(exp_avg_sq + i);
#pragma unroll
        for (int j = 0; j < VEC; ++j) adamw_math(GT::to_float(gp.e[j]), wp.e[j], mp.e[j], vp.e[j], c, k);
        store_pack<float, VEC>(master + i, wp);
        store_pack<float, VEC>(exp_avg + i, mp);
        store_pack<float, VEC>(exp_avg_sq + i, vp);
        if (param_out != nullptr) {
          Pack<PS, VEC> pp;
#pragma unroll
          for (int j = 0; j < VEC; ++j) pp.e[j] = PT::from_float(wp.e[j]);
          store_pack<PS, VEC>(param_out + i, pp);
        }
      }
    } else {
      for (int64_t i = a + threadIdx.x; i < e; i += kThreads) {
        adamw_one<GT, PT>(grad, master, exp_avg, exp_avg_sq, param_out, i, c, k);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------------
template <typename GT, typename PT>
void launch_adamw(const at::Tensor& grad, const at::Tensor& master, const at::Tensor& exp_avg,
                  const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out, const at::Tensor& bounds,
                  const at::Tensor& group, int64_t span_start, int64_t span_end, const GroupSource& groups,
                  const at::Tensor& grad_scale, const at::Tensor& step, const AdamConsts& c,
                  const std::optional<at::Tensor>& found_inf) {
  using GS = typename GT::S;
  using PS = typename PT::S;
  constexpr int VEC = 16 / static_cast<int>(sizeof(GS));
  auto kernel = adamw_kernel<GT, PT, VEC>;
  static const int blocks_per_sm = max_blocks_per_sm(kernel);

  const GS* g = reinterpret_cast<const GS*>(grad.data_ptr());
  float* w = master.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  PS* po = param_out.has_value() ? reinterpret_cast<PS*>(param_out->data_ptr()) : nullptr;
  const int phase = common_phase({{g, static_cast<int64_t>(sizeof(GS))},
                                  {w, 4},
                                  {m, 4},
                                  {v, 4},
                                  {po, static_cast<int64_t>(sizeof(PS))}},
                                 VEC);
  const LaunchPlan p = make_plan(span_start, span_end, phase, VEC, blocks_per_sm, static_cast<int64_t>(kThreads) * VEC);
  const float* fi = found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  kernel<<<p.grid, kThreads, 0, stream>>>(g, w, m, v, po, bounds.data_ptr<int64_t>(), group.data_ptr<int32_t>(),
                                          bounds.size(0), groups, grad_scale.data_ptr<float>(),
                                          step.data_ptr<int64_t>(), fi, c, span_start, span_end, p.aligned_base,
                                          p.chunk, p.phase, p.vec_ok);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename GT, typename PT>
struct AdamwLauncher {
  template <typename... Args>
  static void run(Args&&... args) {
    launch_adamw<GT, PT>(std::forward<Args>(args)...);
  }
};

}  // namespace

void adamw_step_cuda(const at::Tensor& grad, const at::Tensor& master, const at::Tensor& exp_avg,
                     const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out,
                     const at::Tensor& bounds, const at::Tensor& group, int64_t span_start, int64_t span_end,
                     const std::vector<double>& lr, const std::vector<double>& weight_decay,
                     const at::Tensor& grad_scale, const at::Tensor& step, double beta1, double beta2, double eps,
                     const std::optional<at::Tensor>& found_inf) {
  check_common("adamw_step", grad, master, param_out, bounds, group, span_start, span_end, grad_scale, found_inf);
  const at::Device device = grad.device();
  check_state(exp_avg, "exp_avg", device, span_end);
  check_state(exp_avg_sq, "exp_avg_sq", device, span_end);
  check_scalar(step, "step", device, at::kLong);
  if (span_start == span_end || bounds.size(0) == 0) return;

  const c10::cuda::CUDAGuard guard(device);
  GroupSource groups;
  at::Tensor holder;
  prepare_groups(lr, weight_decay, device, groups, holder);
  AdamConsts c;
  c.beta1 = beta1;
  c.beta2 = beta2;
  c.lerp_weight = static_cast<float>(1.0 - beta1);
  c.beta2_f = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);

  dispatch_grad_param<AdamwLauncher>(grad.scalar_type(), param_dtype(param_out), "adamw_step", grad, master,
                                     exp_avg, exp_avg_sq, param_out, bounds, group, span_start, span_end, groups,
                                     grad_scale, step, c, found_inf);
}

}  // namespace megatron_opt
