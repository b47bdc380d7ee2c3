// Pass 2, SGD: torch.optim.SGD's formula (L2 weight decay, dampening 0, optional Nesterov) on the
// fp32 master, optional write of the rounded master into param_out (model dtype).
//
// Piece walking, found_inf skip, per-group lr/wd and the dtype dispatch: see pass2.cuh.
#include "launch.h"
#include "pass2.cuh"

namespace megatron_opt {
namespace {

// ------------------------------------------------------------------------------------------------
// SGD (momentum, Nesterov, L2 weight decay)
// ------------------------------------------------------------------------------------------------
struct SgdSegConsts {
  float grad_scale;
  float lr;         // (float)lr
  float wd;         // (float)wd
  bool has_wd;      // wd != 0
  float momentum;   // (float)momentum
  bool use_buf;     // momentum != 0 (the buffer is then given)
  bool nesterov;
};

__device__ __forceinline__ void sgd_math(float graw, float& w, float& buf, const SgdSegConsts& k) {
  float g = __fmul_rn(graw, k.grad_scale);
  if (k.has_wd) g = fmaf(k.wd, w, g);  // g.add_(w, alpha=wd)
  float dir = g;
  if (k.use_buf) {
    buf = __fadd_rn(__fmul_rn(buf, k.momentum), g);  // buf.mul_(momentum).add_(g)
    dir = k.nesterov ? fmaf(k.momentum, buf, g) : buf;
  }
  w = fmaf(-k.lr, dir, w);  // w.sub_(dir, alpha=lr)
}

template <typename GT, typename PT>
__device__ __forceinline__ void sgd_one(const typename GT::S* grad, float* master, float* momentum_buffer,
                                        typename PT::S* param_out, int64_t i, const SgdSegConsts& k) {
  float w = master[i];
  float buf = k.use_buf ? momentum_buffer[i] : 0.0f;
  sgd_math(GT::to_float(grad[i]), w, buf, k);
  master[i] = w;
  if (k.use_buf) momentum_buffer[i] = buf;
  if (param_out != nullptr) param_out[i] = PT::from_float(w);
}

template <typename GT, typename PT, int VEC>
__global__ void __launch_bounds__(kThreads)
    sgd_kernel(const typename GT::S* grad, float* master, float* momentum_buffer, typename PT::S* param_out,
               const int64_t* __restrict__ bounds, const int32_t* __restrict__ group, int64_t npiece,
               const __grid_constant__ GroupSource groups, const float* __restrict__ grad_scale_ptr,
               const float* __restrict__ found_inf_ptr, float momentum, bool nesterov, int64_t span_start,
               int64_t span_end, int64_t aligned_base, int64_t chunk, int phase, bool vec_ok) {
  using GS = typename GT::S;
  using PS = typename PT::S;
  if (found_inf_ptr != nullptr && *found_inf_ptr != 0.0f) return;  // skipped step: write nothing
  const BlockRange r = block_range(span_start, span_end, aligned_base, chunk);
  if (r.lo >= r.hi) return;

  SgdSegConsts k;
  k.grad_scale = *grad_scale_ptr;
  k.momentum = momentum;
  k.use_buf = momentum_buffer != nullptr;  // the launcher passes a buffer only when momentum != 0
  k.nesterov = nesterov;

  for (int64_t s = first_piece_ending_after(bounds, npiece, r.lo); s < npiece; ++s) {
    const int64_t seg_start = bounds[2 * s];
    if (seg_start >= r.hi) break;
    const int64_t a = max(seg_start, r.lo);
    const int64_t e = min(bounds[2 * s + 1], r.hi);
    double lr, wd;
    group_lr_wd(groups, group, s, lr, wd);
    k.lr = static_cast<float>(lr);
    k.wd = static_cast<float>(wd);
    k.has_wd = wd != 0.0;

    if (vec_ok) {
      const Split sp = split_range<VEC>(a, e, phase);
      if (static_cast<int64_t>(threadIdx.x) < sp.head_end - a) {
        sgd_one<GT, PT>(grad, master, momentum_buffer, param_out, a + threadIdx.x, k);
      }
      if (static_cast<int64_t>(threadIdx.x) < e - sp.body_end) {
        sgd_one<GT, PT>(grad, master, momentum_buffer, param_out, sp.body_end + threadIdx.x, k);
      }
      for (int64_t v = threadIdx.x; v < sp.nvec; v += kThreads) {
        const int64_t i = sp.head_end + v * VEC;
        const Pack<GS, VEC> gp = load_pack<GS, VEC>(grad + i);
        Pack<float, VEC> wp = load_pack<float, VEC>(master + i);
        Pack<float, VEC> bp;
        if (k.use_buf) {
          bp = load_pack<float, VEC>(momentum_buffer + i);
        } else {
#pragma unroll
          for (int j = 0; j < VEC; ++j) bp.e[j] = 0.0f;
        }
#pragma unroll
        for (int j = 0; j < VEC; ++j) sgd_math(GT::to_float(gp.e[j]), wp.e[j], bp.e[j], k);
        store_pack<float, VEC>(master + i, wp);
        if (k.use_buf) store_pack<float, VEC>(momentum_buffer + i, bp);
        if (param_out != nullptr) {
          Pack<PS, VEC> pp;
#pragma unroll
          for (int j = 0; j < VEC; ++j) pp.e[j] = PT::from_float(wp.e[j]);
          store_pack<PS, VEC>(param_out + i, pp);
        }
      }
    } else {
      for (int64_t i = a + threadIdx.x; i < e; i += kThreads) {
        sgd_one<GT, PT>(grad, master, momentum_buffer, param_out, i, k);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------------
template <typename GT, typename PT>
void launch_sgd(const at::Tensor& grad, const at::Tensor& master, const std::optional<at::Tensor>& momentum_buffer,
                const std::optional<at::Tensor>& param_out, const at::Tensor& bounds, const at::Tensor& group,
                int64_t span_start, int64_t span_end, const GroupSource& groups, const at::Tensor& grad_scale,
                double momentum, bool nesterov, const std::optional<at::Tensor>& found_inf) {
  using GS = typename GT::S;
  using PS = typename PT::S;
  constexpr int VEC = 16 / static_cast<int>(sizeof(GS));
  auto kernel = sgd_kernel<GT, PT, VEC>;
  static const int blocks_per_sm = max_blocks_per_sm(kernel);

  const GS* g = reinterpret_cast<const GS*>(grad.data_ptr());
  float* w = master.data_ptr<float>();
  float* b = (momentum != 0.0 && momentum_buffer.has_value()) ? momentum_buffer->data_ptr<float>() : nullptr;
  PS* po = param_out.has_value() ? reinterpret_cast<PS*>(param_out->data_ptr()) : nullptr;
  const int phase = common_phase(
      {{g, static_cast<int64_t>(sizeof(GS))}, {w, 4}, {b, 4}, {po, static_cast<int64_t>(sizeof(PS))}}, VEC);
  const LaunchPlan p = make_plan(span_start, span_end, phase, VEC, blocks_per_sm, static_cast<int64_t>(kThreads) * VEC);
  const float* fi = found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  kernel<<<p.grid, kThreads, 0, stream>>>(g, w, b, po, bounds.data_ptr<int64_t>(), group.data_ptr<int32_t>(),
                                          bounds.size(0), groups, grad_scale.data_ptr<float>(), fi,
                                          static_cast<float>(momentum), nesterov, span_start, span_end,
                                          p.aligned_base, p.chunk, p.phase, p.vec_ok);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename GT, typename PT>
struct SgdLauncher {
  template <typename... Args>
  static void run(Args&&... args) {
    launch_sgd<GT, PT>(std::forward<Args>(args)...);
  }
};

}  // namespace

void sgd_step_cuda(const at::Tensor& grad, const at::Tensor& master, const std::optional<at::Tensor>& momentum_buffer,
                   const std::optional<at::Tensor>& param_out, const at::Tensor& bounds, const at::Tensor& group,
                   int64_t span_start, int64_t span_end, const std::vector<double>& lr,
                   const std::vector<double>& weight_decay, const at::Tensor& grad_scale, double momentum,
                   bool nesterov, const std::optional<at::Tensor>& found_inf) {
  check_common("sgd_step", grad, master, param_out, bounds, group, span_start, span_end, grad_scale, found_inf);
  const at::Device device = grad.device();
  TORCH_CHECK(momentum == 0.0 || momentum_buffer.has_value(), "sgd_step: momentum != 0 needs a momentum buffer");
  if (momentum_buffer.has_value()) check_state(*momentum_buffer, "momentum_buffer", device, span_end);
  if (span_start == span_end || bounds.size(0) == 0) return;

  const c10::cuda::CUDAGuard guard(device);
  GroupSource groups;
  at::Tensor holder;
  prepare_groups(lr, weight_decay, device, groups, holder);

  dispatch_grad_param<SgdLauncher>(grad.scalar_type(), param_dtype(param_out), "sgd_step", grad, master,
                                   momentum_buffer, param_out, bounds, group, span_start, span_end, groups, grad_scale,
                                   momentum, nesterov, found_inf);
}

}  // namespace megatron_opt
