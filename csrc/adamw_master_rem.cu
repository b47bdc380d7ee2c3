// AdamW pass-2 kernels for an int16 remainder of the bf16 param_out (join, update, split): every grad / param_out dtype and
// supported state pair (precision.cuh, pass2.cuh).
#include "adamw_rule.cuh"

namespace megatron_opt {

void adamw_pass2_master_rem(int64_t grad_code, int64_t param_code, int64_t s0_code, int64_t s1_code,
                            const Pass2Args& p, const AdamwRule::Args& a, const int64_t* sr_step) {
  run_pass2_master<AdamwRule, MasterRem>("adamw_step", grad_code, param_code, s0_code, s1_code, p, a, sr_step);
}

}  // namespace megatron_opt
