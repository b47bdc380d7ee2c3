"""Megatron-LM's command-line flags for megatron_opt (no megatron-core needed).

The optimizer, schedule, precision, batch, data-parallel, logging and checkpoint flags of
Megatron-LM's ``megatron/training/arguments.py``, with Megatron-LM's names, defaults and checks, and
the megatron_opt objects they configure::

    from megatron_opt.megatron import arguments as megatron_args

    args = megatron_args.parse_megatron_args()          # sys.argv; WORLD_SIZE from torchrun
    ddp = mo.DistributedDataParallel(model, megatron_args.ddp_config_from_args(args))
    optimizer = mo.get_megatron_optimizer(megatron_args.optimizer_config_from_args(args), ddp)
    scheduler = megatron_args.scheduler_from_args(optimizer, args)
    # args.micro_batch_size, args.num_microbatches, args.global_batch_size, args.train_iters

With a parser of one's own: ``add_megatron_args(parser)``, then ``parse_megatron_args(parser=parser)``.
The model-parallel sizes (``--tensor-model-parallel-size`` ... ``--expert-model-parallel-size``) are
parsed and checked, and ``args.data_parallel_size`` is world / (TP x PP x CP); the program builds the
model parallelism itself (megatron-core's ``parallel_state``). Flags for what megatron_opt does not
implement (fp8, ...) are named together in one error with the reason; no-op values
(``--ckpt-format torch_dist``) are accepted.

Layout: ``flags`` defines the flags, ``unsupported`` the flags refused, ``validation`` Megatron-LM's
checks, ``mapping`` the configs, ``parsing`` the one call. A new group of Megatron-LM flags adds to
each of them, not to the scripts that use them.
"""
from .flags import CONDITIONAL_DEFAULT_FLAGS, ConditionalDefault, add_megatron_args
from .mapping import (DTYPES, ddp_config_from_args, loss_mode_from_args, optimizer_config_from_args,
                      params_dtype_from_args, scheduler_from_args, scheduler_kwargs_from_args)
from .parsing import parse_megatron_args
from .unsupported import NOOP_VALUES, UNSUPPORTED_FLAGS, UnsupportedFlags, unsupported_flags_message
from .validation import FlagNames, MegatronArgumentError, num_microbatches, validate_megatron_args

__all__ = [
    "add_megatron_args", "parse_megatron_args", "validate_megatron_args", "MegatronArgumentError",
    "ddp_config_from_args", "optimizer_config_from_args", "scheduler_kwargs_from_args", "scheduler_from_args",
    "params_dtype_from_args", "loss_mode_from_args", "num_microbatches", "unsupported_flags_message",
    "NOOP_VALUES", "UNSUPPORTED_FLAGS", "UnsupportedFlags", "CONDITIONAL_DEFAULT_FLAGS", "ConditionalDefault",
    "FlagNames", "DTYPES",
]
