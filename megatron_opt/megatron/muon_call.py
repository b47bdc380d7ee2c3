"""Megatron-LM's Muon through install(): what megatron-core's own Muon path does to the model before it
builds the optimizer, done before megatron_opt's get_megatron_optimizer.

Megatron-LM main sends ``--optimizer muon`` (and ``dist_muon``) to ``get_megatron_optimizer``; megatron-core's
emerging-optimizer path then tags each attention ``linear_qkv.weight`` with ``qkv_split_shapes`` (the rows
of Q, K and V in one query group, from the chunk's TransformerConfig), which Muon needs for
``muon_split_qkv``. install() replaces that function, so the tagging is done here, on the same params.
core_v0.16.1 sends Muon to ``get_megatron_muon_optimizer`` instead, and its own validate_args refuses Muon
with the distributed optimizer and the overlap flags: install() replaces that entry point by a clear error
(Muon through install() needs Megatron-LM main).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from ..errors import UnsupportedConfigError
from ..optimizer.build import factory
from ..optimizer.rules.base import Needs
from ..optimizer.rules.muon import QKV_SPLIT_ATTR
from ..optimizer.rules.registry import RULES

# Every optimizer name of the whole-tensor family: megatron-core tags the QKV weights for each (its
# _adaptive_muon_config_to_kwargs starts from Muon's).
WHOLE_TENSOR_NAMES = tuple(n for rule in RULES if rule.needs is Needs.WHOLE_TENSORS for n in rule.names())

QKV_WEIGHT = "linear_qkv.weight"  # megatron-core's name test for the fused QKV projection


def qkv_split_shapes(transformer_config: Any) -> Optional[tuple[int, ...]]:
    """Rows of (Q, K, V) in one query group, as megatron-core derives them from a TransformerConfig (with
    an attention output gate: (Q, gate, K, V)); None when the config lacks the attention sizes."""
    heads = getattr(transformer_config, "num_attention_heads", None)
    kv_channels = getattr(transformer_config, "kv_channels", None)
    groups = getattr(transformer_config, "num_query_groups", None) or heads
    if not heads or not kv_channels or not groups:
        return None
    query = heads // groups * kv_channels
    if getattr(transformer_config, "attention_output_gate", False):
        return (query, query, kv_channels, kv_channels)
    return (query, kv_channels, kv_channels)


def tag_qkv_split_shapes(model_chunks: Sequence[Any]) -> int:
    """megatron-core's tagging: every trainable 2-D param named ``*linear_qkv.weight*`` whose rows are a
    multiple of its chunk's split gets ``param.qkv_split_shapes``; others are left alone, as megatron-core
    leaves them. Returns how many params were tagged."""
    tagged = 0
    for chunk in model_chunks:
        split = qkv_split_shapes(getattr(chunk, "config", None))
        if split is None:
            continue
        for name, param in chunk.named_parameters():
            if param.requires_grad and QKV_WEIGHT in name and param.dim() == 2 and param.shape[0] % sum(split) == 0:
                setattr(param, QKV_SPLIT_ATTR, split)
                tagged += 1
    return tagged


def get_megatron_optimizer(config: Any, model_chunks: Any, *args: Any, **kwargs: Any) -> Any:
    """megatron_opt's get_megatron_optimizer (same call shape) as install() puts it where megatron-core's
    was: with ``optimizer='muon'`` (or ``'dist_muon'``, or another whole-tensor rule: ``'adaptive_muon'``) the
    QKV weights are tagged first, as megatron-core's
    own Muon path does."""
    if getattr(config, "optimizer", None) in WHOLE_TENSOR_NAMES:
        chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        tag_qkv_split_shapes(chunks)
    return factory.get_megatron_optimizer(config, model_chunks, *args, **kwargs)


def get_megatron_muon_optimizer(*args: Any, **kwargs: Any) -> Any:
    """core_v0.16.1's Muon entry point, replaced by install(): refused with the fix (every rank calls it at
    the same point, so every rank raises)."""
    raise UnsupportedConfigError(
        "megatron_opt.megatron.install(): this Megatron-LM builds Muon with megatron-core's "
        "get_megatron_muon_optimizer (core_v0.16.1), which megatron_opt does not replace. Muon through install() "
        "needs Megatron-LM main (d98e8a64 or later), where --optimizer muon goes through get_megatron_optimizer "
        "(core_v0.16.1's validate_args also refuses Muon with --use-distributed-optimizer and --overlap-*); "
        "upgrade Megatron-LM, or use megatron_opt's own API: get_megatron_optimizer(OptimizerConfig("
        "optimizer='muon', ...)) (docs/usage.md, 'Muon').")


__all__ = ["qkv_split_shapes", "tag_qkv_split_shapes", "get_megatron_optimizer", "get_megatron_muon_optimizer"]
