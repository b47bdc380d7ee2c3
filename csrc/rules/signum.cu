// Pass 2, Signum with a step scale (throwaway rule, issue 38) on the fp32 master, fp32 momentum,
// optional write of the rounded master into param_out (model dtype):
//
//   m.lerp_(g, 1 - beta);  w *= 1 - lr*wd (when lr*wd != 0);  w -= lr * (sign(m) * scale)
//
// state0 = exp_avg. Registered as "signum_step" (megatron_opt/optimizer/rules/signum.py, SignumStep);
// constants: beta, scale. Chunk walking, found_inf skip, the lr table: pass2.cuh.
#include "pass2.cuh"

namespace megatron_opt {
namespace {

__device__ __forceinline__ float signum_lerp(float start, float end, float weight) {
  const float diff = __fsub_rn(end, start);
  const bool small = fabsf(weight) < 0.5f;
  const float coeff = small ? weight : __fsub_rn(weight, 1.0f);
  return fmaf(coeff, diff, small ? start : end);
}

__device__ __forceinline__ float signum_sign(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f); }

struct SignumRule {
  static constexpr int kStates = 1;
  static constexpr bool kPrecisionAware = false;
  struct Args {
    float lerp;   // (float)(1 - beta)
    float scale;  // (float)scale
  };
  struct Seg {
    float grad_scale;
    float lr;            // (float)lr
    float decay_factor;  // (float)(1 - lr * wd)
    bool decay;          // lr * wd != 0
  };

  static Args make_args(const Pass2Call& c, at::Device) {
    const std::vector<double>& k = rule_constants(c, 2, "beta, scale");
    return Args{static_cast<float>(1.0 - k[0]), static_cast<float>(k[1])};
  }

  static __device__ __forceinline__ Seg seg(const Args&, double lr, double wd, float grad_scale) {
    Seg k;
    k.grad_scale = grad_scale;
    k.lr = static_cast<float>(lr);
    const double decay = lr * wd;
    k.decay = decay != 0.0;
    k.decay_factor = static_cast<float>(1.0 - decay);
    return k;
  }

  static __device__ __forceinline__ void math(float graw, float& w, float& m, float&, const Args& a,
                                              const Seg& k) {
    const float g = __fmul_rn(graw, k.grad_scale);               // grad.float() * grad_scale
    m = signum_lerp(m, g, a.lerp);                               // m.lerp_(g, 1 - beta)
    const float dir = __fmul_rn(signum_sign(m), a.scale);        // m.sign() * scale
    if (k.decay) w = __fmul_rn(w, k.decay_factor);               // w.mul_(1 - lr * wd)
    w = __fsub_rn(w, __fmul_rn(k.lr, dir));                      // w.sub_(dir, alpha=lr)
  }
};

}  // namespace
}  // namespace megatron_opt

MEGATRON_OPT_REGISTER_RULE("signum_step", ::megatron_opt::SignumRule)
