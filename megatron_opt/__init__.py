"""megatron_opt: a sharded mixed-precision distributed optimizer (ZeRO-1) with Megatron-LM's interface."""
import torch  # noqa: F401  (must precede the compiled extension)

from .config import DistributedDataParallelConfig, OptimizerConfig, UnsupportedConfigError
from .distributed.buffers import LateGradientError
from .distributed.ddp import DistributedDataParallel
from .optimizer.chained import ChainedOptimizer
from .optimizer.distrib_optimizer import DistributedOptimizer
from .optimizer.factory import get_megatron_optimizer, get_param_groups
from .optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from .optimizer.step_machine import SkipReason, StepState
from .scheduler import OptimizerParamScheduler
from .training import TrainStepResult, canonical_lr, train_step

__all__ = [
    "DistributedDataParallelConfig",
    "OptimizerConfig",
    "UnsupportedConfigError",
    "DistributedDataParallel",
    "LateGradientError",
    "DistributedOptimizer",
    "ChainedOptimizer",
    "get_megatron_optimizer",
    "get_param_groups",
    "MegatronGradScaler",
    "ConstantGradScaler",
    "DynamicGradScaler",
    "SkipReason",
    "StepState",
    "OptimizerParamScheduler",
    "train_step",
    "TrainStepResult",
    "canonical_lr",
]
