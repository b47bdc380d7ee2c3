"""megatron_opt: a sharded mixed-precision distributed optimizer (ZeRO-1) with Megatron-LM's interface."""
import torch  # noqa: F401  (must precede the compiled extension)

from . import old_module_paths
from .config import DistributedDataParallelConfig, OptimizerConfig
from .errors import (CheckpointError, ConfigError, InvalidConfigError, LateGradientError, MegatronOptError, RankError,
                     StepOrderError, UnsupportedConfigError, VerificationError)
from .distributed.ddp import DistributedDataParallel
from .distributed.parallel_groups import ModelParallelGroups
from .distributed.shard_view import GradSource, LocalShard, ParamGather, ShardPiece, assemble_full_tensors
from .optimizer.chained import ChainedOptimizer
from .optimizer.distrib_optimizer import DistributedOptimizer
from .optimizer.build.factory import get_megatron_optimizer, get_param_groups
from .optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from .optimizer.megatron_optimizer import MegatronOptimizer
from .optimizer.step.driver import SkipReason, StepState
from .optimizer.rules import SGD, AdamW, Lion, UpdateRule
from .optimizer.verify.step_verifier import Finding, VerifyReport
from .scheduler import OptimizerParamScheduler
from .training import TrainStepResult, canonical_lr, train_step

__all__ = [
    "ModelParallelGroups",
    "DistributedDataParallelConfig",
    "OptimizerConfig",
    "ConfigError",
    "InvalidConfigError",
    "UnsupportedConfigError",
    "StepOrderError",
    "CheckpointError",
    "RankError",
    "MegatronOptError",
    "VerificationError",
    "VerifyReport",
    "Finding",
    "GradSource",
    "LocalShard",
    "ParamGather",
    "ShardPiece",
    "assemble_full_tensors",
    "MegatronOptimizer",
    "UpdateRule",
    "AdamW",
    "SGD",
    "Lion",
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

old_module_paths.install()  # the old paths of moved modules (issue 38) still import
