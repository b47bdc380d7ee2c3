// Pass 2, SGD: torch.optim.SGD's formula (L2 weight decay, dampening 0, optional Nesterov) on the
// fp32 master, state0 = momentum buffer (only when momentum != 0), optional write of the rounded
// master into param_out (model dtype). Chunk walking, found_inf skip, the lr table: see pass2.cuh.
#include "launch.h"
#include "pass2.cuh"

namespace megatron_opt {
namespace {

template <bool kMomentum>
struct SgdRule {
  static constexpr int kStates = kMomentum ? 1 : 0;
  struct Args {
    float momentum;
    bool nesterov;
  };
  struct Seg {
    float grad_scale;
    float lr;     // (float)lr
    float wd;     // (float)wd
    bool has_wd;  // wd != 0
  };

  static __device__ __forceinline__ Seg seg(const Args&, double lr, double wd, float grad_scale) {
    Seg k;
    k.grad_scale = grad_scale;
    k.lr = static_cast<float>(lr);
    k.wd = static_cast<float>(wd);
    k.has_wd = wd != 0.0;
    return k;
  }

  static __device__ __forceinline__ void math(float graw, float& w, float& buf, float&, const Args& a,
                                              const Seg& k) {
    float g = __fmul_rn(graw, k.grad_scale);
    if (k.has_wd) g = fmaf(k.wd, w, g);  // g.add_(w, alpha=wd)
    float dir = g;
    if constexpr (kMomentum) {
      buf = __fadd_rn(__fmul_rn(buf, a.momentum), g);  // buf.mul_(momentum).add_(g)
      dir = a.nesterov ? fmaf(a.momentum, buf, g) : buf;
    }
    w = fmaf(-k.lr, dir, w);  // w.sub_(dir, alpha=lr)
  }
};

}  // namespace

void sgd_step_cuda(const at::Tensor& ptrs, const at::Tensor& chunks, int64_t grad_code, int64_t param_code,
                   const at::Tensor& lr_wd, const at::Tensor& grad_scale, double clip_coef, double momentum,
                   bool nesterov, const std::optional<at::Tensor>& found_inf) {
  const Pass2Args p{ptrs, chunks, lr_wd, grad_scale, clip_coef, found_inf};
  if (momentum != 0.0) {
    SgdRule<true>::Args a{static_cast<float>(momentum), nesterov};
    run_pass2<SgdRule<true>>("sgd_step", grad_code, param_code, p, a);
  } else {
    SgdRule<false>::Args a{0.0f, nesterov};
    run_pass2<SgdRule<false>>("sgd_step", grad_code, param_code, p, a);
  }
}

}  // namespace megatron_opt
