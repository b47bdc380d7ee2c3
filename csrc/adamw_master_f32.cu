// AdamW pass-2 kernels for the fp32 master (with or without param_out): every grad / param_out dtype and
// supported state pair (precision.cuh, pass2.cuh).
#include "adamw_rule.cuh"

namespace megatron_opt {

void adamw_pass2_master_f32(int64_t grad_code, int64_t param_code, int64_t s0_code, int64_t s1_code,
                            const Pass2Args& p, const AdamwRule::Args& a, const int64_t* sr_step) {
  run_pass2_master<AdamwRule, MasterF32>("adamw_step", grad_code, param_code, s0_code, s1_code, p, a, sr_step);
}

}  // namespace megatron_opt
