// Pass 2, Lion (Chen et al. 2023, decoupled weight decay) on the fp32 master, fp32 momentum,
// optional write of the rounded master into param_out (model dtype):
//
//   c = m.lerp(g, 1 - beta1);  w *= 1 - lr*wd (when lr*wd != 0);  w -= lr * sign(c);  m.lerp_(g, 1 - beta2)
//
// sign follows torch.sign: sign(+-0) = +0 and sign(NaN) = 0 (a NaN c moves w by the decay only).
// state0 = exp_avg. Registered as "lion_step" (megatron_opt/optimizer/rules/lion.py, LionStep);
// constants: beta1, beta2. Chunk walking, found_inf skip, the lr table: pass2.cuh.
#include "pass2.cuh"

namespace megatron_opt {
namespace {

// torch's lerp as its CUDA kernel computes it in fp32 (the same formula as AdamW's m update):
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

struct LionRule {
  static constexpr int kStates = 1;
  static constexpr bool kPrecisionAware = false;
  struct Args {
    float lerp1;  // (float)(1 - beta1)
    float lerp2;  // (float)(1 - beta2)
  };
  struct Seg {
    float grad_scale;
    float lr;            // (float)lr
    float decay_factor;  // (float)(1 - lr * wd)
    bool decay;          // lr * wd != 0
  };

  static Args make_args(const Pass2Call& c, at::Device) {
    const std::vector<double>& k = rule_constants(c, 2, "beta1, beta2");
    return Args{static_cast<float>(1.0 - k[0]), static_cast<float>(1.0 - k[1])};
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
    const float g = __fmul_rn(graw, k.grad_scale);            // grad.float() * grad_scale
    const float dir = torch_sign(torch_lerp(m, g, a.lerp1));  // m.lerp(g, 1 - beta1).sign_()
    if (k.decay) w = __fmul_rn(w, k.decay_factor);            // w.mul_(1 - lr * wd)
    w = fmaf(-k.lr, dir, w);                                  // w.sub_(dir, alpha=lr); lr * dir is exact
    m = torch_lerp(m, g, a.lerp2);                            // m.lerp_(g, 1 - beta2)
  }
};

}  // namespace
}  // namespace megatron_opt

MEGATRON_OPT_REGISTER_RULE("lion_step", ::megatron_opt::LionRule)
