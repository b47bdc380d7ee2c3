"""Megatron-LM's flags that megatron_opt does not implement: why, which values are harmless no-ops,
and the one message that names every such flag of a command line before anything runs."""
from __future__ import annotations

import difflib
from types import MappingProxyType
from typing import Mapping, NamedTuple, Optional, Sequence, Union

NoopValue = Union[None, str, tuple[str, ...]]
# Megatron-LM flags accepted when their value makes them a no-op (None: a switch that changes nothing; a
# tuple: any of these values).
NOOP_VALUES: Mapping[str, NoopValue] = MappingProxyType({
    # megatron_opt.checkpoint writes torch.distributed.checkpoint folders, like both of these formats
    "--ckpt-format": ("torch_dist", "torch_dcp"),
})


class UnsupportedFlags(NamedTuple):
    prefixes: tuple[str, ...]  # a flag starting with one of these belongs here
    reason: str  # the default reason; a caller can phrase its own (parse_megatron_args' reasons)


# Megatron-LM's flags megatron_opt does not implement, by feature; a flag belongs to the first feature
# whose prefix it starts with. Supporting a feature later removes its entry (and adds its flags).
UNSUPPORTED_FLAGS: Mapping[str, UnsupportedFlags] = MappingProxyType({
    "fp8": UnsupportedFlags(
        ("--fp8", "--fp4", "--first-last-layers-bf16", "--num-layers-at-"),
        "fp8/fp4 training is not implemented (precision: --bf16, --fp16 or fp32)"),
    "model_parallel": UnsupportedFlags(
        ("--tensor-model-parallel", "--pipeline-model-parallel", "--context-parallel", "--expert-model-parallel",
         "--expert-tensor-parallel", "--sequence-parallel", "--num-layers-per-virtual", "--virtual-pipeline",
         "--num-virtual-stages", "--decoder-first-pipeline", "--decoder-last-pipeline", "--account-for-",
         "--tp-comm", "--cp-comm", "--hierarchical-context"),
        "this model-parallel option is not implemented (supported: --tensor-model-parallel-size, "
        "--sequence-parallel, --pipeline-model-parallel-size, --num-layers-per-virtual-pipeline-stage, "
        "--context-parallel-size, --expert-model-parallel-size, --expert-tensor-parallel-size)"),
    "data": UnsupportedFlags(
        ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path", "--data-args-path",
         "--per-split-data-args", "--mock-data", "--split", "--data-cache-path", "--vocab-file", "--merge-file",
         "--vocab-size", "--vocab-extra-ids", "--tokenizer", "--tiktoken", "--null-tokenizer", "--num-workers",
         "--no-mmap-bin-files", "--mmap-bin-files", "--no-create-attention-mask", "--create-attention-mask",
         "--dataloader-type", "--num-dataset-builder-threads", "--reset-position-ids", "--reset-attention-mask",
         "--eod-mask-loss", "--make-vocab-size-divisible-by", "--object-storage-cache-path"),
        "data and tokenizer flags are not implemented: the program brings its own data"),
    "model": UnsupportedFlags(
        ("--use-mcore-models", "--use-legacy-models", "--transformer-impl", "--spec", "--swiglu", "--squared-relu",
         "--num-query-groups", "--group-query-attention", "--kv-channels", "--position-embedding-type", "--rotary",
         "--use-rotary", "--rope", "--no-rope", "--normalization", "--norm-epsilon", "--apply-layernorm-1p",
         "--disable-bias-linear", "--add-bias-linear", "--add-qkv-bias", "--qk-layernorm", "--attention-dropout",
         "--hidden-dropout", "--attention-backend", "--num-experts", "--moe-", "--multi-latent-attention",
         "--q-lora-rank", "--kv-lora-rank", "--mtp-", "--cross-entropy", "--attention-softmax-in-fp32",
         "--apply-residual-connection-post-layernorm", "--fp32-residual-connection", "--openai-gelu",
         "--onnx-safe", "--bert-no-binary-head", "--hybrid-", "--heterogeneous", "--recompute",
         "--masked-softmax-fusion", "--no-masked-softmax-fusion", "--no-bias-", "--no-rope-fusion",
         "--use-flash-attn", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
         "--no-position-embedding", "--embedding-", "--output-logit-dtype", "--fp16-lm-cross-entropy"),
        "model architecture flags are not implemented (only the network size): the program brings its own model"),
    "evaluation": UnsupportedFlags(
        ("--eval-", "--skip-train", "--test-mode", "--full-validation", "--multiple-validation-sets"),
        "evaluation is not implemented"),
    "batch_rampup": UnsupportedFlags(
        ("--rampup-batch-size", "--step-batch-size-schedule", "--decrease-batch-size-if-needed"),
        "the global batch size is constant"),
    "logging": UnsupportedFlags(
        ("--wandb-", "--one-logger", "--enable-one-logger", "--log-"),
        "this logging option is not implemented (supported: --log-interval, --log-throughput, "
        "--log-num-zeros-in-grad, --log-timers-to-tensorboard, --tensorboard-dir, --tensorboard-log-interval)"),
    "profiling": UnsupportedFlags(
        ("--profile", "--use-pytorch-profiler", "--record-memory-history", "--memory-snapshot-path"),
        "profiling is not implemented"),
    "overlap_param_gather_with_optimizer_step": UnsupportedFlags(
        ("--overlap-param-gather-with-optimizer-step",),
        "it overlaps the first model chunk's all-gather with the other chunks' update, and needs virtual pipeline "
        "chunks (as in Megatron-LM); megatron_opt's API supports it "
        "(OptimizerConfig.overlap_param_gather_with_optimizer_step, docs/usage.md)"),
    "not_implemented": UnsupportedFlags(
        ("--optimizer-cpu-offload", "--optimizer-offload-fraction", "--main-grads-dtype", "--use-torch-fsdp2",
         "--use-megatron-fsdp", "--use-custom-fsdp", "--data-parallel-sharding-strategy", "--ddp-num-buckets",
         "--ddp-average-in-collective", "--ddp-pad-buckets", "--ddp-reduce-scatter-with-fp32", "--nccl-ub",
         "--optimizer-cuda-graph", "--no-align-param-gather", "--apply-wd-to-qk-layernorm",
         "--manual-gc", "--empty-unused-memory-level", "--exit-duration-in-mins", "--exit-signal-handler",
         "--rerun-mode", "--check-weight-hash-across-dp-replicas-interval"),
        "not implemented by megatron_opt or by this script"),
})

UNKNOWN = "unknown flag"  # not a flag of the program, nor one of UNSUPPORTED_FLAGS' Megatron-LM flags
NOT_YET = "not supported yet"  # a Megatron-LM flag of UNSUPPORTED_FLAGS


def unsupported_flags_message(extras: Sequence[str], program: str, *, reasons: Optional[Mapping[str, str]] = None,
                              noop_values: Optional[Mapping[str, NoopValue]] = None,
                              known_flags: Sequence[str] = ()) -> Optional[str]:
    """One message naming every flag of ``extras`` (what ``parse_known_args`` did not know), or None
    when each is an accepted no-op. A Megatron-LM flag megatron_opt does not implement (UNSUPPORTED_FLAGS)
    reads ``--data-path x: not supported yet: <reason>``; any other is ``unknown flag --micro-batch-szie;
    did you mean --micro-batch-size?`` (the closest of ``known_flags``, the program's own option
    strings, when one is close). ``reasons`` (feature of UNSUPPORTED_FLAGS -> text) rephrases a
    reason for the program; ``noop_values`` adds to NOOP_VALUES. One flag: its line alone; more: a
    count, then a line each."""
    noop = {**NOOP_VALUES, **(noop_values or {})}
    unknown = sorted(set(reasons or {}) - set(UNSUPPORTED_FLAGS))
    if unknown:
        raise ValueError(f"unsupported_flags_message: reasons for {unknown}, which are not in UNSUPPORTED_FLAGS")
    bad = [(flag, values) for flag, values in _group_words(extras) if not _is_noop(flag, values, noop)]
    if not bad:
        return None
    lines = [_line(flag, values, reasons or {}, known_flags, noop) for flag, values in bad]
    not_yet = any(UNKNOWN not in line for line in lines)
    accepted = ", ".join(k if v is None else f"{k} {v if isinstance(v, str) else '|'.join(v)}"
                         for k, v in noop.items())
    footer = f"\nMegatron-LM flags accepted as no-ops here: {accepted}." if not_yet else ""
    if len(lines) == 1:
        return lines[0] + footer
    return (f"{len(bad)} flags refused by {program} (nothing was run):\n" + "\n".join("  " + line for line in lines)
            + footer)


def _feature(flag: str) -> Optional[str]:
    for feature, unsupported in UNSUPPORTED_FLAGS.items():
        if flag.startswith(unsupported.prefixes):
            return feature
    return None


def _line(flag: str, values: list[str], reasons: Mapping[str, str], known_flags: Sequence[str],
          noop: Mapping[str, NoopValue]) -> str:
    known = [f for f in known_flags if f.startswith("--")]
    feature = _feature(flag)
    if feature is None and flag in noop:  # a Megatron-LM flag accepted only with its no-op value
        values_ok = noop[flag]
        want = (f"only as {flag} without a value" if values_ok is None else
                f"only as {flag} {values_ok}" if isinstance(values_ok, str) else
                f"only as {flag} {'|'.join(values_ok)}")
        return f"{' '.join([flag, *values])}: {NOT_YET}: accepted {want}, a no-op here"
    # A feature's prefix (--log-) also covers typos of the program's own flags (--log-intervall): a flag
    # this close to one of them is taken for a typo.
    if feature is None or difflib.get_close_matches(flag, known, n=1, cutoff=0.9):
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        return f"{UNKNOWN} {flag}" + (f"; did you mean {close[0]}?" if close else "")
    return f"{' '.join([flag, *values])}: {NOT_YET}: {reasons.get(feature, UNSUPPORTED_FLAGS[feature].reason)}"


def _group_words(extras: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Unknown command-line words as (flag, its values); a word that is no flag follows the flag before it."""
    groups: list[tuple[str, list[str]]] = []
    for word in extras:
        if word.startswith("-") and not _is_number(word):
            flag, _, value = word.partition("=")
            groups.append((flag, [value] if value else []))
        elif groups:
            groups[-1][1].append(word)
        else:
            groups.append((word, []))
    return groups


def _is_number(word: str) -> bool:
    try:
        float(word)
        return True
    except ValueError:
        return False


def _is_noop(flag: str, values: list[str], noop: Mapping[str, NoopValue]) -> bool:
    if flag not in noop:
        return False
    want = noop[flag]
    if want is None:
        return not values
    if len(values) != 1:
        return False
    return any(_is_number(values[0]) and float(values[0]) == float(w) if _is_number(w) else values[0] == w
               for w in ((want,) if isinstance(want, str) else want))
