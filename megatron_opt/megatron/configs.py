"""The old import path of megatron-core config conversion, which now lives in
``megatron_opt.config_conversion`` (below distributed/ and optimizer/, which both use it)."""
from ..config_conversion import (as_ddp_config, as_optimizer_config, check_transformer_config, is_ours,
                                 starts_gradient_scale_at_one)

__all__ = ["as_ddp_config", "as_optimizer_config", "check_transformer_config", "starts_gradient_scale_at_one",
           "is_ours"]
