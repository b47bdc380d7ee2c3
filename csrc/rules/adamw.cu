// Pass 2, AdamW (adamw.cuh): registered as "adamw_step" (megatron_opt/optimizer/rules/adamw.py, AdamWStep).
// This unit holds the fp32-master kernels; adamw_master_{f16,rem}.cu the other master storages.
#include "adamw.cuh"

MEGATRON_OPT_REGISTER_RULE("adamw_step", ::megatron_opt::AdamwRule)
