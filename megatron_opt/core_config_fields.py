"""The treatment of every megatron-core config field that megatron_opt lacks or never reads.

megatron-core keeps adding fields to its ``OptimizerConfig`` and ``DistributedDataParallelConfig``, and
Megatron-LM fills many of them from its argument parser with values other than the dataclass
defaults. A converted config (config_conversion.py) keeps each field megatron_opt has; every other
field gets one of the treatments below, decided here once and for all megatron-core versions checked
(0.16.1, 0.19.2 and Megatron-LM main's core, 2026-08):

- ``Inert``: any value is accepted, because the field cannot change what megatron_opt computes: it is
  read only by a feature megatron_opt refuses (Megatron-FSDP, CPU offload, fp8 params, adaptive Muon),
  or it is a kernel-fusion or registration detail.
- ``Renamed``: an older megatron-core name of one of megatron_opt's fields; its value is converted.
- ``DefaultOnly``: accepted at megatron-core's default only, refused by name otherwise: another value
  would change the training and megatron_opt does not implement it.
- ``ShardsOptimizer``: megatron-core's own switch for a sharded optimizer of some optimizers only
  (``use_layer_wise_distributed_optimizer``: Muon sharded over the data-parallel ranks); True becomes
  megatron_opt's ``use_distributed_optimizer=True`` for those optimizers and is refused for the others.

A field missing from this table is treated as ``DefaultOnly`` at run time (never silently ignored),
and ``tests/mcore/test_stock_megatron_lm.py`` fails when the installed megatron-core has a field that
is neither megatron_opt's nor in this table, so a new megatron-core field is decided here, not in a
user's run.

megatron_opt's own configs declare some megatron-core fields only so that Megatron launch code setting
them keeps working; nothing in megatron_opt reads them. They are decided in ``UNREAD_DDP_FIELDS`` and
``UNREAD_OPTIMIZER_FIELDS``: ``Inert`` ones are accepted at any value, ``DefaultOnly`` ones are refused
by config.py (the class's ``_UNSUPPORTED``). ``tests/unit/test_unread_config_fields.py`` fails on a
declared field that the library never reads and that is neither there nor refused by config.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class Inert:
    """Accepted at any value; ``reason`` says why it cannot change the result."""

    reason: str


@dataclass(frozen=True)
class DefaultOnly:
    """Accepted at megatron-core's default only; ``reason`` says what to do instead."""

    reason: str


@dataclass(frozen=True)
class Renamed:
    """megatron-core's older name of one of megatron_opt's fields: its value is converted into ``ours``."""

    ours: str


@dataclass(frozen=True)
class ShardsOptimizer:
    """A megatron-core switch that shards ``optimizers``: True means megatron_opt's
    ``use_distributed_optimizer=True`` for them; with another optimizer only False is accepted (``reason``)."""

    optimizers: tuple[str, ...]
    reason: str


Treatment = Union[Inert, DefaultOnly, Renamed, ShardsOptimizer]

_FSDP = Inert("read only by Megatron-FSDP (use_megatron_fsdp, which megatron_opt refuses)")
_OFFLOAD = Inert("read only by the CPU-offloaded optimizer (optimizer_cpu_offload, which megatron_opt refuses)")
_MUON = Inert("a kernel detail of Muon")
_FP8 = Inert("read only with fp8 params (TransformerConfig.fp8_param / fp8_param_gather, which megatron_opt refuses)")

DDP_FIELDS: dict[str, Treatment] = {
    "gradient_reduce_div_fusion": Inert("a kernel fusion of the pre-reduction division; the same result"),
    "disable_symmetric_registration": Inert("NCCL symmetric-memory registration; no numerical effect"),
    "suggested_communication_unit_size": _FSDP,
    "preserve_fp32_weights": _FSDP,
    "fsdp_double_buffer": _FSDP,
    "fsdp_db_use_persist_buf_on_alloc_fail": _FSDP,
    "fsdp_all_gather_in_start_param_sync": _FSDP,
    "fsdp_manual_registration": _FSDP,
    "outer_dp_sharding_strategy": _FSDP,
    "megatron_fsdp_version": _FSDP,
    "megatron_fsdp_main_params_dtype": _FSDP,
    "megatron_fsdp_main_grads_dtype": _FSDP,
    "megatron_fsdp_grad_comm_dtype": _FSDP,
    "megatron_fsdp_use_decoupled_grad": _FSDP,
    "megatron_fsdp_cuda_graph_mode": _FSDP,
    "megatron_fsdp_enable_fine_grained_param_gather": _FSDP,
    "megatron_fsdp_max_pool_double_buffer": _FSDP,
    "keep_fp8_transpose_cache": _FP8,
    "num_buckets": DefaultOnly("set bucket_size (elements per bucket) instead"),
    "param_name_patterns_for_fp32_local_accumulation": DefaultOnly(
        "per-param fp32 accumulation is not implemented; grad_reduce_in_fp32=True accumulates every grad in fp32"),
    "fp4_param_gather": DefaultOnly("fp4 params are not supported"),
}

OPTIMIZER_FIELDS: dict[str, Treatment] = {
    "fp8_recipe": _FP8,
    "reuse_grad_buf_for_mxfp8_param_ag": DefaultOnly("mxfp8 params are not supported"),
    "use_torch_optimizer_for_cpu_offload": _OFFLOAD,
    "overlap_cpu_optimizer_d2h_h2d": _OFFLOAD,
    "pin_cpu_grads": _OFFLOAD,
    "pin_cpu_params": _OFFLOAD,
    "muon_use_nesterov": Renamed("muon_nesterov"),  # megatron-core 0.16.1's name
    "muon_use_syrk": _MUON,
    "muon_scalar_optimizer": DefaultOnly("the non-matrix params of optimizer='muon' use AdamW ('adam') only"),
    "soap_precondition_frequency": DefaultOnly(
        "emerging-optimizers' SOAP refreshes its eigenbases every step (megatron-core passes it no frequency)"),
    # Megatron-LM main turns --optimizer muon --use-distributed-optimizer (and dist_muon) into this flag with
    # use_distributed_optimizer=False, and wraps the model with ddp_config.use_distributed_optimizer=True:
    # for megatron_opt it asks for Muon sharded over the data-parallel ranks (its MatrixExchange homes).
    "use_layer_wise_distributed_optimizer": ShardsOptimizer(
        ("adaptive_muon", "muon", "dist_muon", "soap", "lion"), "megatron-core's layer-wise distributed optimizer is "
        "for its emerging optimizers (megatron_opt runs 'muon' / 'dist_muon', 'adaptive_muon', 'soap' and 'lion' "
        "sharded); for optimizer='adam' or 'sgd' use use_distributed_optimizer=True"),
}


# Fields megatron_opt's configs declare and never read (see the module docstring).
UNREAD_DDP_FIELDS: dict[str, Treatment] = {
    "align_param_gather": Inert("when overlap_param_gather's all-gathers start across virtual-pipeline chunks "
                                "(megatron_opt's forward pre-hooks dispatch them); the gathered params are the same"),
    "data_parallel_sharding_strategy": _FSDP,
    "delay_wgrad_compute": DefaultOnly(
        "megatron_opt's gradient hooks fire when a param's gradient is accumulated; Transformer Engine's delayed "
        "weight gradients (backward_dw) are not hooked, so delayed weight-gradient reduction is not implemented"),
}

UNREAD_OPTIMIZER_FIELDS: dict[str, Treatment] = {
    "params_dtype": Inert("the params' dtypes are read from the params (fp16 / bf16 name the model dtype); "
                          "megatron-core's optimizer does not read it either"),
    "config_logger_dir": Inert("where megatron-core's config logger dumps configs for debugging; "
                               "no effect on training"),
    "overlap_param_gather": Inert(
        "the overlap of the param all-gather is the model's DistributedDataParallelConfig.overlap_param_gather "
        "(Megatron-LM sets both from --overlap-param-gather); megatron-core reads this copy only with mxfp8 params "
        "and in its layer-wise optimizer"),
    "optimizer_offload_fraction": _OFFLOAD,
}


def treatment(kind: str, name: str) -> Treatment | None:
    """The treatment of megatron-core field ``name`` of a DDP (``kind='ddp'``) or optimizer
    (``kind='optimizer'``) config that megatron_opt's config lacks; None when undecided (then only
    megatron-core's default is accepted)."""
    table = {"ddp": DDP_FIELDS, "optimizer": OPTIMIZER_FIELDS}[kind]
    return table.get(name)


__all__ = ["Inert", "DefaultOnly", "Renamed", "ShardsOptimizer", "Treatment", "DDP_FIELDS", "OPTIMIZER_FIELDS",
           "UNREAD_DDP_FIELDS", "UNREAD_OPTIMIZER_FIELDS", "treatment"]
