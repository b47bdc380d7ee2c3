// The AdamW rule of pass 2 (torch.optim.AdamW's formula, decoupled weight decay): per-element fp32
// math on the widened master (w) and moments (m = exp_avg = state0, v = exp_avg_sq = state1). Shared by
// adamw.cu (the host entry point) and the adamw_master_*.cu units, one per master storage, which hold
// the kernel instantiations (split so that the build compiles them in parallel).
#pragma once

#include "pass2.cuh"

namespace megatron_opt {

struct AdamwRule {
  static constexpr int kStates = 2;
  struct Args {
    double beta1, beta2;
    float lerp_weight;      // (float)(1 - beta1)
    float beta2_f;          // (float)beta2
    float one_minus_beta2;  // (float)(1 - beta2)
    float eps;              // (float)eps
    const int64_t* step;    // device: the 1-based index of this update
  };
  struct Seg {
    float grad_scale;
    float bc2_sqrt;      // (float)sqrt(1 - beta2^step)
    float step_size;     // (float)(lr / (1 - beta1^step))
    float decay_factor;  // (float)(1 - lr * wd)
    bool decay;          // lr * wd != 0
  };

  static __device__ __forceinline__ Seg seg(const Args& a, double lr, double wd, float grad_scale) {
    const double t = static_cast<double>(*a.step);
    Seg k;
    k.grad_scale = grad_scale;
    k.bc2_sqrt = static_cast<float>(sqrt(1.0 - pow(a.beta2, t)));
    k.step_size = static_cast<float>(lr / (1.0 - pow(a.beta1, t)));
    const double decay = lr * wd;
    k.decay = decay != 0.0;
    k.decay_factor = static_cast<float>(1.0 - decay);
    return k;
  }

  static __device__ __forceinline__ void math(float graw, float& w, float& m, float& v, const Args& a,
                                              const Seg& k) {
    const float g = __fmul_rn(graw, k.grad_scale);
    // m.lerp_(g, 1 - beta1), torch's lerp: weight < 0.5 ? m + w*(g-m) : g - (1-w)*(g-m)
    const float diff = __fsub_rn(g, m);
    const bool small = fabsf(a.lerp_weight) < 0.5f;
    const float coeff = small ? a.lerp_weight : __fsub_rn(a.lerp_weight, 1.0f);
    m = fmaf(coeff, diff, small ? m : g);
    // v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    v = __fadd_rn(__fmul_rn(v, a.beta2_f), __fmul_rn(__fmul_rn(a.one_minus_beta2, g), g));
    // update = m / (sqrt(v) / sqrt(bias_correction2) + eps)
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), k.bc2_sqrt), a.eps);
    const float update = __fdiv_rn(m, denom);
    if (k.decay) w = __fmul_rn(w, k.decay_factor);
    w = __fsub_rn(w, __fmul_rn(update, k.step_size));
  }
};


// Pass-2 launches for one master storage (master_code 0 fp32, 2 fp16, 3 int16 remainder); grad, param_out
// and state codes are dispatched inside. The caller has checked the arguments and set the device guard.
// sr_step: the device step when bf16 moments are rounded stochastically, else nullptr.
void adamw_pass2_master_f32(int64_t grad_code, int64_t param_code, int64_t s0_code, int64_t s1_code,
                            const Pass2Args& p, const AdamwRule::Args& a, const int64_t* sr_step);
void adamw_pass2_master_f16(int64_t grad_code, int64_t param_code, int64_t s0_code, int64_t s1_code,
                            const Pass2Args& p, const AdamwRule::Args& a, const int64_t* sr_step);
void adamw_pass2_master_rem(int64_t grad_code, int64_t param_code, int64_t s0_code, int64_t s1_code,
                            const Pass2Args& p, const AdamwRule::Args& a, const int64_t* sr_step);

}  // namespace megatron_opt
