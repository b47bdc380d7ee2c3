// The AdamW rule of pass 2 (torch.optim.AdamW's formula, decoupled weight decay): per-element fp32
// math on the widened master (w) and moments (m = exp_avg = state0, v = exp_avg_sq = state1).
// Precision-aware (precision.cuh): the master stored as fp32, fp16 or the int16 remainder of a bf16
// param_out; the moments as fp32 / bf16 / fp16 in the pairs of supported_state_pair, bf16 moments
// optionally rounded stochastically. Shared by adamw.cu (registration, fp32 masters) and
// adamw_master_{f16,rem}.cu (the other master storages, compiled in parallel).
#pragma once

#include "pass2.cuh"

namespace megatron_opt {

struct AdamwRule {
  static constexpr int kStates = 2;
  static constexpr bool kPrecisionAware = true;
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

  // constants: beta1, beta2, eps (ops: AdamWStep.cuda); step is required.
  static Args make_args(const Pass2Call& c, at::Device device) {
    TORCH_CHECK(c.step.has_value(), c.op, ": AdamW reads the device step; pass step");
    check_scalar(*c.step, "step", device, at::kLong);
    const std::vector<double>& k = rule_constants(c, 3, "beta1, beta2, eps");
    Args a;
    a.beta1 = k[0];
    a.beta2 = k[1];
    a.lerp_weight = static_cast<float>(1.0 - k[0]);
    a.beta2_f = static_cast<float>(k[1]);
    a.one_minus_beta2 = static_cast<float>(1.0 - k[1]);
    a.eps = static_cast<float>(k[2]);
    a.step = c.step->data_ptr<int64_t>();
    return a;
  }

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

// The master storages instantiated in their own files (adamw_master_f16.cu, adamw_master_rem.cu).
extern template void run_pass2_master<AdamwRule, MasterF16>(const char*, const Pass2Call&, const AdamwRule::Args&,
                                                            const int64_t*);
extern template void run_pass2_master<AdamwRule, MasterRem>(const char*, const Pass2Call&, const AdamwRule::Args&,
                                                            const int64_t*);

}  // namespace megatron_opt
