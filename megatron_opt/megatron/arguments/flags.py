"""The flag definitions: Megatron-LM's flags (megatron/training/arguments.py) that megatron_opt
implements, in Megatron-LM's groups, with Megatron-LM's names, types and defaults.

A new group of flags is one more ``_add_*_args`` function in ``FLAG_GROUPS`` (and its checks in
``validation.py``, its mapping in ``mapping.py``, its prefixes out of ``unsupported.py``).
"""
from __future__ import annotations

import argparse
from typing import Any, Callable, Mapping, Optional

from ...config import VERIFY_ACTIONS
from ...optimizer.rules.base import SAME_AS_CONFIG, Constant
from ...optimizer.rules.registry import OPTIMIZER_NAMES, RULES
from ...scheduler import LR_DECAY_STYLES, WD_INCR_STYLES, WSD_DECAY_STYLES
from ...training import LOSS_MODES

# Namespace attributes these flags add besides their destinations.
TYPED_FLAGS = "typed_flags"  # dest -> the option string typed for it (messages name flags as typed)
FLAG_ALIASES = "flag_aliases"  # dest -> the caller's extra option string (add_megatron_args' aliases)


class ConditionalDefault:
    """The default of a flag that another flag can rule out: it applies only when that flag is
    absent (``--train-iters`` yields to ``--train-samples``, ``--lr-warmup-iters`` to sample-based
    training and ``--lr-warmup-fraction``); validate_megatron_args resolves it to a value or None.
    A callable value is a default that scales with the run: called with the namespace, after
    ``train_iters`` is resolved (a demo's ``--lr-warmup-iters`` as a fraction of ``--train-iters``)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def resolve(self, args: argparse.Namespace) -> Any:
        return self.value(args) if callable(self.value) else self.value

    def __repr__(self) -> str:
        return f"ConditionalDefault({self.value!r})"


# The flags whose default another flag can rule out (their defaults become ConditionalDefault).
CONDITIONAL_DEFAULT_FLAGS = frozenset({"train_iters", "lr_warmup_iters"})


class _RecordTyped(argparse.Action):
    """argparse's store (nargs=None) or store_const (nargs=0, a switch) that also records which
    option string was typed, so that an error names ``--steps`` when the user typed ``--steps``."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        # A new dict: the parser's default dict is shared by every parse.
        setattr(namespace, TYPED_FLAGS, {**getattr(namespace, TYPED_FLAGS, {}), self.dest: option_string})


class _Group:
    """Adds flags to one argument group: values, switches, each with the caller's alias if any."""

    def __init__(self, group: Any, defaults: Mapping[str, Any], aliases: Mapping[str, str], dests: set[str]) -> None:
        self.group, self.defaults, self.aliases, self.dests = group, defaults, aliases, dests

    def _names(self, flag: str, dest: Optional[str], spellings: tuple[str, ...] = ()) -> tuple[list[str], str]:
        dest = dest or flag[2:].replace("-", "_")
        self.dests.add(dest)
        return [flag, *spellings, *([self.aliases[dest]] if dest in self.aliases else [])], dest

    def value(self, flag: str, type: Callable[[str], Any], default: Any = None, dest: Optional[str] = None,
              **kwargs: Any) -> None:
        names, dest = self._names(flag, dest)
        default = self.defaults.get(dest, default)
        if dest in CONDITIONAL_DEFAULT_FLAGS:
            default = ConditionalDefault(default)
        self.group.add_argument(*names, dest=dest, type=type, default=default, action=_RecordTyped, **kwargs)

    def switch(self, flag: str, dest: Optional[str] = None, store: bool = True, spellings: tuple[str, ...] = (),
               **kwargs: Any) -> None:
        """A flag without a value: ``dest`` becomes ``store`` (default: the opposite). ``spellings``:
        Megatron-LM's other names for the flag."""
        names, dest = self._names(flag, dest, spellings)
        self.group.add_argument(*names, dest=dest, action=_RecordTyped, nargs=0, const=store,
                                default=self.defaults.get(dest, not store), **kwargs)


def _add_network_size_args(g: _Group) -> None:
    g.value("--num-layers", int)
    g.value("--hidden-size", int)
    g.value("--ffn-hidden-size", int, help="default 4 x --hidden-size")
    g.value("--num-attention-heads", int)
    g.value("--seq-length", int)
    g.value("--max-position-embeddings", int, help="default --seq-length")
    g.value("--init-method-std", float, 0.02)
    g.switch("--untie-embeddings-and-output-weights")


def _add_training_args(g: _Group) -> None:
    g.value("--micro-batch-size", int)
    g.value("--global-batch-size", int, help="default micro-batch-size x data-parallel size (one micro-batch "
                                             "per step)")
    g.value("--num-microbatches", int, help="megatron_opt's own: global batch = micro-batch-size x this x "
                                            "data-parallel size")
    g.value("--train-iters", int, help="the run length in iterations (or --train-samples)")
    g.value("--train-samples", int)
    g.value("--exit-interval", int, help="save (with --save) and exit after an iteration divisible by this")
    g.value("--seed", int, 1234)
    # Megatron-LM's check, on by default; argparse takes a destination's default from its first flag.
    g.switch("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", store=False,
             help="train on when the loss is non-finite (default: stop the run, as Megatron-LM does)")
    g.switch("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
             help="stop the run when the loss, or the gradients outside the fp16 loss scaler's backoff, are "
                  "non-finite (the default)")
    g.switch("--calculate-per-token-loss",
             help="normalise the loss by the step's supervised token count over all micro-batches and ranks "
                  "(default: the mean of each micro-batch's mean token loss)")
    g.value("--loss-mode", str, choices=LOSS_MODES,
            help="megatron_opt's own: per_token = --calculate-per-token-loss, mean = without it")


def _add_optimizer_args(g: _Group) -> None:
    g.value("--optimizer", str, "adam", choices=OPTIMIZER_NAMES,
            help="adam is AdamW (decoupled weight decay), as in Megatron-LM")
    g.value("--lr", float)
    g.value("--min-lr", float, 0.0)
    g.value("--decoupled-lr", float, help="max lr of the input embedding and output layer (their own schedule)")
    g.value("--decoupled-min-lr", float)
    g.value("--weight-decay", float, 0.01)
    g.value("--clip-grad", float, 1.0, help="0 turns clipping off")
    _add_rule_constant_args(g)
    _add_muon_args(g)
    g.switch("--use-precision-aware-optimizer",
             help="Megatron-LM's precision-aware optimizer: the dtypes below, and bf16 params' masters kept as the "
                  "param plus a 16-bit remainder")
    g.value("--main-params-dtype", str, "fp32", choices=("fp32", "fp16"))
    g.value("--exp-avg-dtype", str, "fp32", choices=("fp32", "bf16", "fp16"))
    g.value("--exp-avg-sq-dtype", str, "fp32", choices=("fp32", "bf16", "fp16"))
    g.switch("--no-store-param-remainders", dest="store_param_remainders", store=False,
             help="megatron_opt's own: fp32 masters for bf16 params even with the precision-aware optimizer")
    g.switch("--stochastic-rounding", help="megatron_opt's own: round bf16 moments stochastically")
    g.value("--num-distributed-optimizer-instances", int, 1,
            help="shard the optimizer within DP/N-rank instances and replicate it across them (needs "
                 "--use-distributed-optimizer)")
    g.switch("--use-distributed-optimizer",
             help="shard the optimizer state over the data-parallel ranks (ZeRO-1); without it every rank holds "
                  "the whole optimizer (plain data parallelism)")
    g.value("--verify-interval", int, 0,
            help="megatron_opt's own: every N-th optimizer step checks the replicas, the update and the "
                 "param/master cast (verify mode, docs/usage.md); 0 (the default) turns it off")
    g.value("--verify-action", str, "raise", choices=VERIFY_ACTIONS,
            help="megatron_opt's own: on a failed verification raise VerificationError on every rank, or warn")


def _add_rule_constant_args(g: _Group) -> None:
    """One flag per declared constant of every update rule (optimizer/rules/<rule>.py, ``constant(...)``),
    rules in registry order: ``--`` and the config field with dashes (``--adam-beta1``), or the declared
    ``flag``; the declared flag default (Megatron-LM's, where it differs from the config's); a bool is a
    switch to the other value. Nothing here names a rule."""
    for flag, dest, default, declared in rule_constant_flags():
        # The values are checked by the rule's declaration (validation.py builds the rule), not by argparse,
        # so a refused value gets the declaration's message.
        what = " / ".join(str(c) for c in declared.choices)
        help_text = "; ".join(t for t in (declared.help, what) if t) or None
        if isinstance(default, bool):
            g.switch(flag, dest=dest, store=not default, help=help_text)
        else:
            g.value(flag, type(default), default, dest=dest, help=help_text)


def rule_constant_flags() -> list[tuple[str, str, Any, Constant]]:
    """(flag, destination = config field, flag default, declaration) of every rule constant with a config
    field, once each, in registry order."""
    out, seen = [], set()
    for rule in RULES:
        defaults = rule.constant_defaults()
        for name, declared in rule.constants().items():
            field = declared.config_field
            if field is None or field in seen:
                continue
            seen.add(field)
            default = defaults[name] if declared.flag_default is SAME_AS_CONFIG else declared.flag_default
            flag = declared.flag or ("--" + field.replace("_", "-"))
            out.append((flag, field, default, declared))
    return out


def _add_muon_args(g: _Group) -> None:
    """Megatron-LM main's --muon-* flags that are not Muon's constants (those come from its declaration,
    with Megatron-LM's defaults: --muon-momentum 0.9, --muon-tp-mode duplicated)."""
    g.value("--muon-coefficient-type", str, "quintic", help="Newton-Schulz coefficients (megatron_opt: quintic)")
    g.switch("--muon-use-syrk", help="a Triton kernel of megatron-core's; accepted, no effect on the result")
    g.value("--muon-scalar-optimizer", str, "adam", choices=("adam", "lion"),
            help="the optimizer of the params Muon does not take (megatron_opt: adam, i.e. AdamW)")


def _add_learning_rate_args(g: _Group) -> None:
    g.value("--lr-decay-style", str, "linear", choices=LR_DECAY_STYLES)
    g.value("--lr-decay-iters", int, help="default --train-iters")
    g.value("--lr-decay-samples", int, help="default --train-samples")
    g.value("--lr-warmup-iters", int, 0, help="with iteration-based training, unless --lr-warmup-fraction")
    g.value("--lr-warmup-samples", int, help="default 0")
    g.value("--lr-warmup-fraction", float, help="warm up over this fraction of the LR decay length")
    g.value("--lr-warmup-init", float, 0.0)
    g.value("--lr-wsd-decay-style", str, "exponential", choices=WSD_DECAY_STYLES)
    g.value("--lr-wsd-decay-iters", int)
    g.value("--lr-wsd-decay-samples", int)
    g.value("--start-weight-decay", float)
    g.value("--end-weight-decay", float)
    g.value("--weight-decay-incr-style", str, "constant", choices=WD_INCR_STYLES)
    # Megatron-LM spells them with "opt_param" and accepts "opt-param" too.
    g.switch("--override-opt_param-scheduler", dest="override_opt_param_scheduler",
             spellings=("--override-opt-param-scheduler",),
             help="on --load, follow this command line's schedule instead of the checkpoint's")
    g.switch("--use-checkpoint-opt_param-scheduler", dest="use_checkpoint_opt_param_scheduler",
             spellings=("--use-checkpoint-opt-param-scheduler",),
             help="on --load, keep the checkpoint's schedule (the default when neither is given; Megatron-LM "
                  "instead refuses a schedule that differs)")


def _add_mixed_precision_args(g: _Group) -> None:
    precision = _Group(g.group.add_mutually_exclusive_group(), g.defaults, g.aliases, g.dests)
    precision.switch("--bf16")
    precision.switch("--fp16")
    g.value("--loss-scale", float, help="a constant loss scale (with --fp16 or --bf16); default: dynamic for --fp16")
    g.value("--initial-loss-scale", float, 2.0**32)
    g.value("--min-loss-scale", float, 1.0)
    g.value("--loss-scale-window", float, 1000)
    g.value("--hysteresis", int, 2)
    g.switch("--accumulate-allreduce-grads-in-fp32",
             help="fp32 gradient buffers (always on with --bf16 unless --grad-reduce-in-bf16)")
    g.switch("--grad-reduce-in-bf16")


def _add_distributed_args(g: _Group) -> None:
    g.switch("--overlap-grad-reduce")
    g.switch("--overlap-param-gather", help="needs --use-distributed-optimizer")
    g.value("--ddp-bucket-size", int, help="elements per gradient bucket (default: megatron_opt chooses)")
    g.value("--distributed-timeout-minutes", int, 10,
            help="timeout of every collective (default 10; gloo's own default is 30)")


def _add_model_parallel_args(g: _Group) -> None:
    # The program builds the model parallelism (megatron-core's parallel_state); these set the sizes, and
    # the data-parallel size is world / (tensor x pipeline x context).
    g.value("--tensor-model-parallel-size", int, 1)
    g.switch("--sequence-parallel", help="split LayerNorm and dropout activations over the tensor-parallel ranks "
                                         "(ignored at tensor-parallel size 1, as in Megatron-LM)")
    g.value("--pipeline-model-parallel-size", int, 1)
    g.value("--num-layers-per-virtual-pipeline-stage", int,
            help="interleaved pipeline: layers per virtual stage (virtual stages per rank = layers / pipeline size "
                 "/ this)")
    g.value("--context-parallel-size", int, 1)
    g.value("--expert-model-parallel-size", int, 1)
    g.value("--expert-tensor-parallel-size", int, help="default --tensor-model-parallel-size")


def _add_logging_args(g: _Group) -> None:
    g.value("--log-interval", int, 100)
    g.switch("--log-throughput", help="log model TFLOP/s per rank")
    g.switch("--log-num-zeros-in-grad")
    g.value("--tensorboard-dir", str, help="write Megatron-LM's scalars (needs tensorboard)")
    g.value("--tensorboard-log-interval", int, 1)
    g.switch("--log-timers-to-tensorboard", help="also write iteration-time (and throughput with --log-throughput)")


def _add_checkpointing_args(g: _Group) -> None:
    g.value("--save", str, help="checkpoint folder to save into")
    g.value("--save-interval", int, help="save every N iterations (and at the end)")
    g.value("--load", str, help="checkpoint folder to resume from (its latest iteration)")
    g.switch("--no-load-optim", help="load the model only")
    g.switch("--no-load-rng", help="do not restore the RNG states")
    g.switch("--no-save-rng", help="do not save the RNG states (a resume keeps its fresh ones)")
    g.switch("--async-save", help="write checkpoints in the background")
    g.value("--keep-latest-k", int, help="megatron_opt's own: delete older checkpoints")


# (argument group title, the function adding its flags), in --help order.
FLAG_GROUPS: tuple[tuple[str, Callable[[_Group], None]], ...] = (
    ("network size", _add_network_size_args),
    ("training", _add_training_args),
    ("optimizer", _add_optimizer_args),
    ("learning-rate and weight-decay schedule (counted in samples)", _add_learning_rate_args),
    ("mixed precision", _add_mixed_precision_args),
    ("data-parallel communication", _add_distributed_args),
    ("model parallelism", _add_model_parallel_args),
    ("logging", _add_logging_args),
    ("checkpointing", _add_checkpointing_args),
)


def add_megatron_args(parser: argparse.ArgumentParser, *, defaults: Optional[Mapping[str, Any]] = None,
                      aliases: Optional[Mapping[str, str]] = None) -> None:
    """Add Megatron-LM's flags that megatron_opt implements to ``parser``, in Megatron-LM's groups.

    ``defaults`` (dest -> value) replaces Megatron-LM's defaults, for example where it has none
    (``lr``, ``num_layers``, ...); a default for ``train_iters`` or ``lr_warmup_iters`` applies only
    when no flag rules it out (``--train-samples``; sample-based training or ``--lr-warmup-fraction``).
    ``aliases`` (dest -> option string) adds another name for a flag, such as ``--steps`` for
    ``--train-iters``; error messages then name an untyped flag by its alias when the command line
    uses aliases. Build ``parser`` with ``allow_abbrev=False``, or ``--lr-warmup`` would be taken as
    ``--lr-warmup-iters``.
    """
    defaults, aliases = dict(defaults or {}), dict(aliases or {})
    dests: set[str] = set()
    for title, add in FLAG_GROUPS:
        add(_Group(parser.add_argument_group(title), defaults, aliases, dests))
    unknown = sorted((set(defaults) | set(aliases)) - dests)
    if unknown:
        raise ValueError(f"add_megatron_args: defaults or aliases for {unknown}, which are not flags it adds")
    parser.set_defaults(**{TYPED_FLAGS: {}, FLAG_ALIASES: aliases})
