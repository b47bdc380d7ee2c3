// AdamW pass-2 kernels for an fp16 master (param_out = the stored fp16 master rounded): every grad /
// param_out dtype and supported state pair (precision.cuh, pass2.cuh). Its own unit: compiled in parallel.
#include "adamw.cuh"

namespace megatron_opt {

template void run_pass2_master<AdamwRule, MasterF16>(const char*, const Pass2Call&, const AdamwRule::Args&,
                                                     const int64_t*);

}  // namespace megatron_opt
