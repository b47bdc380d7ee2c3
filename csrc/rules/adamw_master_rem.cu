// AdamW pass-2 kernels for an int16 remainder of the bf16 param_out (join, update, split): every grad /
// param_out dtype and supported state pair (precision.cuh, pass2.cuh). Its own unit: compiled in parallel.
#include "adamw.cuh"

namespace megatron_opt {

template void run_pass2_master<AdamwRule, MasterRem>(const char*, const Pass2Call&, const AdamwRule::Args&,
                                                     const int64_t*);

}  // namespace megatron_opt
