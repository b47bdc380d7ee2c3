// Pass 2, AdamW: torch.optim.AdamW's formula (decoupled weight decay) on the master, with the moments
// state0 = exp_avg, state1 = exp_avg_sq, optional write of the rounded master into param_out (model
// dtype). Precision-aware state (precision.cuh): the master stored as fp32, fp16 or the int16 remainder
// of a bf16 param_out; the moments as fp32 / bf16 / fp16 in the pairs (fp32, fp32), (bf16, bf16),
// (fp16, fp16) and (bf16, fp32), bf16 moments optionally rounded stochastically. One pass, per element:
// load (widen), fp32 update (AdamwRule::math), round, store. Chunk walking, found_inf skip, the lr
// table: see pass2.cuh; the kernel instantiations live in adamw_master_*.cu.
#include "adamw_rule.cuh"
#include "launch.h"

namespace megatron_opt {
namespace {

// The dtype codes alone (no tensor needed): checked first, so the messages are the same on any device.
void check_adamw_codes(int64_t grad_code, int64_t param_code, int64_t master_code, int64_t s0_code,
                       int64_t s1_code) {
  const auto is_float_code = [](int64_t c) { return c == kCodeF32 || c == kCodeBF16 || c == kCodeF16; };
  TORCH_CHECK(is_float_code(grad_code), "adamw_step: unknown grad dtype code ", grad_code,
              " (0 float32, 1 bfloat16, 2 float16)");
  TORCH_CHECK(param_code == kCodeNone || is_float_code(param_code), "adamw_step: unknown param_out dtype code ",
              param_code, " (-1 none, 0 float32, 1 bfloat16, 2 float16)");
  TORCH_CHECK(master_code == kCodeF32 || master_code == kCodeF16 || master_code == kCodeRem,
              "adamw_step: unknown master storage code ", master_code,
              " (0 float32, 2 float16, 3 int16 remainder of a bfloat16 param)");
  TORCH_CHECK(master_code != kCodeRem || param_code == kCodeBF16,
              "adamw_step: an int16 remainder master needs a bfloat16 param_out (code 1), got param_out code ",
              param_code);
  TORCH_CHECK(is_float_code(s0_code) && is_float_code(s1_code), "adamw_step: unknown state dtype codes (",
              s0_code, ", ", s1_code, "): AdamW needs two states, each 0 float32, 1 bfloat16 or 2 float16");
  TORCH_CHECK(supported_state_pair(s0_code, s1_code), "adamw_step: no kernel for state dtype codes (", s0_code, ", ",
              s1_code, "); the kernels take (exp_avg, exp_avg_sq) = (0, 0), (1, 1), (2, 2) or (1, 0) "
              "(ops.cuda runs the reference for other pairs)");
}

}  // namespace

void adamw_step_cuda(const at::Tensor& ptrs, const at::Tensor& chunks, int64_t grad_code, int64_t param_code,
                     int64_t master_code, int64_t state0_code, int64_t state1_code, const at::Tensor& lr_wd,
                     const at::Tensor& grad_scale, double clip_coef, const at::Tensor& step, double beta1,
                     double beta2, double eps, const std::optional<at::Tensor>& found_inf, bool stochastic) {
  check_adamw_codes(grad_code, param_code, master_code, state0_code, state1_code);
  const Pass2Args p{ptrs, chunks, lr_wd, grad_scale, clip_coef, found_inf};
  const at::Device device = check_pass2("adamw_step", p);
  check_scalar(step, "step", device, at::kLong);
  AdamwRule::Args a;
  a.beta1 = beta1;
  a.beta2 = beta2;
  a.lerp_weight = static_cast<float>(1.0 - beta1);
  a.beta2_f = static_cast<float>(beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  a.eps = static_cast<float>(eps);
  a.step = step.data_ptr<int64_t>();
  if (chunks.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(device);
  // Stochastic rounding applies to bf16 slots only; on fp32 / fp16 slots the flag changes nothing.
  const int64_t* sr_step = stochastic ? a.step : nullptr;
  switch (master_code) {
    case kCodeF32:
      adamw_pass2_master_f32(grad_code, param_code, state0_code, state1_code, p, a, sr_step);
      break;
    case kCodeF16:
      adamw_pass2_master_f16(grad_code, param_code, state0_code, state1_code, p, a, sr_step);
      break;
    default:  // kCodeRem (checked above)
      adamw_pass2_master_rem(grad_code, param_code, state0_code, state1_code, p, a, sr_step);
      break;
  }
}

}  // namespace megatron_opt
