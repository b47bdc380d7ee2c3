// Pass 2, SGD: torch.optim.SGD's formula (L2 weight decay, dampening 0, optional Nesterov) on the
// fp32 master, state0 = momentum buffer (only when momentum != 0), optional write of the rounded
// master into param_out (model dtype). Registered as "sgd_step" (megatron_opt/optimizer/rules/sgd.py,
// SGDStep); constants: momentum, nesterov (0 or 1). Chunk walking, found_inf skip, the lr table: pass2.cuh.
#include "pass2.cuh"

namespace megatron_opt {
namespace {

template <bool kMomentum>
struct SgdRule {
  static constexpr int kStates = kMomentum ? 1 : 0;
  static constexpr bool kPrecisionAware = false;
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

  static Args make_args(const Pass2Call& c, at::Device) {
    const std::vector<double>& k = rule_constants(c, 2, "momentum, nesterov");
    return Args{static_cast<float>(k[0]), k[1] != 0.0};
  }

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

// Without momentum there is no state to read or write: a kernel without the buffer.
void sgd_launch(const Pass2Call& c) {
  const std::vector<double>& k = rule_constants(c, 2, "momentum, nesterov");
  if (k[0] != 0.0) {
    run_rule<SgdRule<true>>(c);
  } else {
    run_rule<SgdRule<false>>(c);
  }
}

}  // namespace
}  // namespace megatron_opt

MEGATRON_OPT_REGISTER_PASS2("sgd_step", &::megatron_opt::sgd_launch)
