"""Pretrain a small GPT with megatron_opt under torchrun: CPU/gloo without a GPU, CUDA/NCCL with one.

    torchrun --standalone --nproc_per_node=2 scripts/pretrain_gpt.py
    torchrun --standalone --nproc_per_node=2 scripts/pretrain_gpt.py --train-iters 30 --save ckpt --save-interval 10
    torchrun --standalone --nproc_per_node=3 scripts/pretrain_gpt.py --train-iters 40 --load ckpt --save ckpt  # DP 2 -> 3
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT scripts/pretrain_gpt.py ...

Megatron-LM's flags (megatron/training/arguments.py), with Megatron-LM's meaning, so that the optimizer,
schedule, precision, batch, logging and checkpoint block of a Megatron-LM launch script runs with only
the entry point changed:

  batch      --micro-batch-size --global-batch-size (micro-batches per step = global / (micro x DP),
             which must divide; default global = micro x DP) --train-iters | --train-samples
  schedule   --lr --min-lr --lr-decay-style --lr-decay-iters | --lr-decay-samples --lr-warmup-iters |
             --lr-warmup-samples | --lr-warmup-fraction --lr-warmup-init --lr-wsd-decay-style
             --lr-wsd-decay-iters | --lr-wsd-decay-samples --weight-decay --start-weight-decay
             --end-weight-decay --weight-decay-incr-style --override-opt-param-scheduler
             --use-checkpoint-opt-param-scheduler (the scheduler counts samples: iterations x global batch)
  optimizer  --optimizer adam|sgd|lion --adam-beta1 --adam-beta2 --adam-eps --sgd-momentum --clip-grad
             --use-distributed-optimizer (ZeRO-1; without it, plain data parallelism with every rank
             holding the whole optimizer)
  precision  --bf16 | --fp16, --loss-scale (constant) | dynamic: --initial-loss-scale --min-loss-scale
             --loss-scale-window --hysteresis; --accumulate-allreduce-grads-in-fp32 --grad-reduce-in-bf16
  DDP        --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size --distributed-timeout-minutes
  loss       --calculate-per-token-loss (default: the mean of each micro-batch's mean token loss)
  model      --num-layers --hidden-size --ffn-hidden-size --num-attention-heads --seq-length
             --max-position-embeddings --init-method-std --untie-embeddings-and-output-weights --seed
  logging    --log-interval --log-throughput --log-num-zeros-in-grad --tensorboard-dir
             --tensorboard-log-interval --log-timers-to-tensorboard (Megatron-LM's scalar names; needs
             `pip install tensorboard`); this script's own --log-json FILE: one JSON line per iteration
  checkpoint --save --save-interval --load --no-load-optim --no-load-rng --async-save --exit-interval

Defaults are Megatron-LM's, except where Megatron-LM has none or a run with no flags should stay a short
demo (DEMO_DEFAULTS): --lr 3e-3, --train-iters 30, --micro-batch-size 4, --seq-length 64, --hidden-size
128, --num-layers 2, --num-attention-heads 4, --lr-warmup-iters 5 (Megatron-LM: 0), --log-interval 1
(Megatron-LM: 100); on --load the checkpoint's schedule is kept unless --override-opt-param-scheduler
(Megatron-LM refuses a changed one unless told). The flags this script had before are aliases:
--steps (--train-iters), --seq-len, --hidden, --layers, --heads, --warmup-steps (--lr-warmup-iters),
--bucket-size (--ddp-bucket-size), and its own --num-microbatches N (global = micro x N x DP) and
--loss-mode per_token|mean (--calculate-per-token-loss or not).

Megatron-LM flags for what this script does not have (fp8, tensor/pipeline/context/expert parallelism,
data and tokenizer paths, other model architectures, evaluation, ...) and unknown flags are all named in
one error (exit code 2) before any process group exists; values that are no-ops here are accepted
(NOOP_VALUES: --tensor-model-parallel-size 1, --sequence-parallel, --attention-dropout 0, --ckpt-format
torch_dist, ...).

The model is Megatron-LM's default GPT without dropout: learned absolute positions, pre-LayerNorm
blocks with multi-head causal attention and a GELU MLP, biases, and an output layer tied to the input
embedding. The built-in dataset is character-level text taken from the docstrings of Python's standard
library (present on every machine, nothing is downloaded), cut into documents of random length and
padded with ignored labels, so micro-batches carry different numbers of supervised tokens and the
per-token loss normalisation matters. Every --log-interval iterations rank 0 logs loss (the interval's
mean), grad norm, loss scale, lr, skipped iterations, tokens/s and time per iteration.

Checkpoints (megatron_opt.checkpoint): ``--save DIR`` saves every ``--save-interval`` iterations and at
the end; ``--load DIR`` resumes the model, optimizer, schedule, loss scale, iteration, RNG and data
position (at any data-parallel size; the RNG and data position only at the same size),
``--no-load-optim`` / ``--no-load-rng`` skip those parts; ``--exit-interval N`` saves and exits after an
iteration divisible by N.

Hangs: every collective gives up after ``--distributed-timeout-minutes`` (default 10), and a watchdog
ends a rank whose training step runs for more than max(``--watchdog-min-seconds``,
``--watchdog-multiple`` x the median step time), so a stopped or hung peer never leaves the others
waiting silently (exit code 3, with a message on stderr; ``--watchdog-multiple 0`` turns it off).
Invalid flag values are rejected before any process group is created (exit code 2).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import importlib
import json
import logging
import math
import os
import pydoc
import re
import statistics
import sys
import threading
import time
import warnings
from typing import Iterator, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

import megatron_opt as mo
import megatron_opt.checkpoint  # noqa: F401  (mo.checkpoint)

STDLIB_MODULES = ("collections", "functools", "itertools", "json", "os", "pathlib", "re", "string",
                  "textwrap", "typing", "argparse", "logging", "dataclasses", "statistics", "heapq")


# ----------------------------------------------------------------------------- data
def build_corpus() -> str:
    parts = []
    for name in STDLIB_MODULES:
        module = __import__(name)
        parts.append(pydoc.getdoc(module))
        for attr in sorted(dir(module)):
            obj = getattr(module, attr, None)
            if not attr.startswith("_") and callable(obj):
                parts.append(pydoc.getdoc(obj))
    return "\n\n".join(p for p in parts if p)


class CharDataset:
    """Random-length documents from the corpus; labels past a document's end are ignored (-100)."""

    def __init__(self, text: str, seq_len: int, seed: int) -> None:
        chars = sorted(set(text))
        self.vocab = ["<pad>"] + chars
        index = {c: i + 1 for i, c in enumerate(chars)}
        self.data = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.seq_len = seq_len
        self.gen = torch.Generator().manual_seed(seed)

    def microbatch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.data) - self.seq_len - 1, (size,), generator=self.gen)
        lengths = torch.randint(self.seq_len // 4, self.seq_len + 1, (size,), generator=self.gen)
        tokens = torch.stack([self.data[s : s + self.seq_len] for s in starts])
        labels = torch.stack([self.data[s + 1 : s + self.seq_len + 1] for s in starts])
        past_end = torch.arange(self.seq_len)[None, :] >= lengths[:, None]
        return tokens.masked_fill(past_end, 0), labels.masked_fill(past_end, -100)


# ----------------------------------------------------------------------------- model
class Block(torch.nn.Module):
    """Megatron-LM's default GPT layer: pre-LayerNorm, multi-head causal attention, GELU MLP, biases."""

    def __init__(self, hidden: int, heads: int, ffn_hidden: Optional[int] = None) -> None:
        super().__init__()
        ffn_hidden = ffn_hidden or 4 * hidden
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.ln2 = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, ffn_hidden)
        self.fc2 = torch.nn.Linear(ffn_hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, h // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(torch.nn.Module):
    """Learned absolute positions (``max_positions`` of them), ``layers`` blocks, a final LayerNorm and the
    output layer, tied to the input embedding unless ``tie_embeddings=False`` (Megatron-LM's defaults;
    no dropout). Weights ~ N(0, init_std), the output projections of each block N(0, init_std /
    sqrt(2 layers)), biases zero, as Megatron-LM initialises them."""

    def __init__(self, vocab: int, max_positions: int, hidden: int, layers: int, heads: int,
                 ffn_hidden: Optional[int] = None, init_std: float = 0.02, tie_embeddings: bool = True) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, hidden)
        self.pos = torch.nn.Embedding(max_positions, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden, heads, ffn_hidden) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(hidden)
        self.head = None if tie_embeddings else torch.nn.Linear(hidden, vocab, bias=False)
        # What --decoupled-lr applies to (megatron-core marks the same params).
        self.tok.weight.is_embedding_or_output_parameter = True
        if self.head is not None:
            self.head.weight.is_embedding_or_output_parameter = True
        for name, p in self.named_parameters():
            if p.ndim > 1:
                scaled = name.endswith(("proj.weight", "fc2.weight"))
                torch.nn.init.normal_(p, std=init_std / (math.sqrt(2 * layers) if scaled else 1))
            elif name.endswith(".bias"):
                torch.nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return F.linear(x, self.tok.weight) if self.head is None else self.head(x)


def gpt_loss(model: torch.nn.Module, batch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token cross-entropies, supervised token count): Megatron's per-token loss form."""
    tokens, labels = batch
    logits = model(tokens)
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return loss, (labels != -100).sum()


def gpt_mean_loss(model: torch.nn.Module, batch: tuple) -> tuple[torch.Tensor]:
    loss_sum, count = gpt_loss(model, batch)
    return (loss_sum / count.clamp(min=1),)


# ----------------------------------------------------------------------------- watchdog
class Watchdog:
    """Ends this process when a training step runs far longer than the steps before it.

    A rank waiting in a collective for a peer that is stopped, hung or gone would otherwise sit there
    until the process group's timeout. Wrap each step in ``with watchdog.step(iteration):``. The first
    ``warmup`` steps are neither timed nor watched; from then on a daemon thread checks the running
    step and, once it has run longer than max(min_seconds, multiple x the median of the recent step
    times), prints the rank, iteration, elapsed time and median to stderr and calls
    ``os._exit(EXIT_CODE)``: no clean-up, since the main thread is the one that is stuck.
    """

    EXIT_CODE = 3

    def __init__(self, rank: int, multiple: float, min_seconds: float, warmup: int = 3, window: int = 1000) -> None:
        self.rank, self.multiple, self.min_seconds, self.warmup = rank, multiple, min_seconds, warmup
        self.durations: collections.deque[float] = collections.deque(maxlen=window)
        self.steps_seen = 0
        self.current: tuple[int, float] | None = None  # (iteration, start time) of the watched step
        self.lock = threading.Lock()
        if multiple > 0:
            threading.Thread(target=self._watch, name="step-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def step(self, iteration: int) -> Iterator[None]:
        start, watched = time.monotonic(), self.steps_seen >= self.warmup
        with self.lock:
            self.current = (iteration, start) if watched else None
        try:
            yield
        finally:
            with self.lock:
                if watched:
                    self.durations.append(time.monotonic() - start)
                self.current = None
            self.steps_seen += 1

    def _watch(self) -> None:
        while True:
            time.sleep(max(0.1, min(1.0, self.min_seconds / 10)))
            with self.lock:
                if self.current is None:
                    continue
                (iteration, start), durations = self.current, list(self.durations)
            median = statistics.median(durations) if durations else 0.0
            elapsed, limit = time.monotonic() - start, max(self.min_seconds, self.multiple * median)
            if elapsed > limit:
                sys.stderr.write(
                    f"\n[watchdog] rank {self.rank}: iteration {iteration} has been running for {elapsed:.1f} s, "
                    f"longer than max(--watchdog-min-seconds {self.min_seconds:g}, --watchdog-multiple "
                    f"{self.multiple:g} x median step time {median:.3f} s) = {limit:.1f} s. A peer rank is probably "
                    f"stopped, hung or dead, or a collective is stuck. Exiting with code {self.EXIT_CODE} "
                    f"(--watchdog-multiple 0 turns the watchdog off).\n")
                sys.stderr.flush()
                os._exit(self.EXIT_CODE)


# ----------------------------------------------------------------------------- flags
# Flags this script had before it spoke Megatron-LM's names; each is an alias of the Megatron-LM flag
# (same destination). Messages name a flag as it was typed, and a flag that was not typed in the
# style of the command line: the old name when the command line uses old names, else Megatron-LM's.
LEGACY_ALIASES = {
    "train_iters": "--steps", "seq_length": "--seq-len", "hidden_size": "--hidden", "num_layers": "--layers",
    "num_attention_heads": "--heads", "lr_warmup_iters": "--warmup-steps", "ddp_bucket_size": "--bucket-size",
}

# Defaults that differ from Megatron-LM's, so that the script runs with no flags at all (Megatron-LM
# has no default for the first group) and its no-flag run stays a short demo.
DEMO_DEFAULTS = {
    "lr": 3e-3, "train_iters": 30, "micro_batch_size": 4, "seq_length": 64, "hidden_size": 128, "num_layers": 2,
    "num_attention_heads": 4,                       # Megatron-LM: required
    "lr_warmup_iters": 5,                           # Megatron-LM: 0
    "log_interval": 1,                              # Megatron-LM: 100
}

# Megatron-LM flags this script does not implement, accepted when their value makes them a no-op
# here (a flag with value None: a switch that changes nothing here).
NOOP_VALUES: dict[str, Optional[str]] = {
    "--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "1", "--context-parallel-size": "1",
    "--expert-model-parallel-size": "1", "--expert-tensor-parallel-size": "1",
    "--sequence-parallel": None,  # Megatron-LM itself turns it off when the tensor-parallel size is 1
    "--attention-dropout": "0", "--hidden-dropout": "0",  # the model has no dropout
    "--attention-backend": "auto",  # torch's scaled_dot_product_attention picks its kernel
    "--ckpt-format": "torch_dist",  # torch.distributed.checkpoint folders, like Megatron-LM's default
    "--eval-iters": "0",
    "--no-check-for-nan-in-loss-and-grad": None,  # there is no such check to turn off
}

# Why an unsupported flag is unsupported: (flag prefixes, reason), first match wins.
UNSUPPORTED_REASONS: list[tuple[tuple[str, ...], str]] = [
    (("--fp8", "--fp4", "--first-last-layers-bf16", "--num-layers-at-"),
     "fp8/fp4 training is not implemented (precision: --bf16, --fp16 or fp32)"),
    (("--tensor-model-parallel", "--pipeline-model-parallel", "--context-parallel", "--expert-model-parallel",
      "--expert-tensor-parallel", "--sequence-parallel", "--num-layers-per-virtual", "--virtual-pipeline",
      "--num-virtual-stages", "--decoder-first-pipeline", "--decoder-last-pipeline", "--account-for-",
      "--tp-comm", "--cp-comm", "--hierarchical-context"),
     "only data parallelism: tensor, pipeline, context and expert parallel sizes must be 1"),
    (("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path", "--data-args-path",
      "--per-split-data-args", "--mock-data", "--split", "--data-cache-path", "--vocab-file", "--merge-file",
      "--vocab-size", "--vocab-extra-ids", "--tokenizer", "--tiktoken", "--null-tokenizer", "--num-workers",
      "--no-mmap-bin-files", "--mmap-bin-files", "--no-create-attention-mask", "--create-attention-mask",
      "--dataloader-type", "--num-dataset-builder-threads", "--reset-position-ids", "--reset-attention-mask",
      "--eod-mask-loss", "--make-vocab-size-divisible-by", "--object-storage-cache-path"),
     "the script trains on its built-in character-level dataset; there is no data or tokenizer to configure"),
    (("--use-mcore-models", "--use-legacy-models", "--transformer-impl", "--spec", "--swiglu", "--squared-relu",
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
     "the model is this script's own GPT (learned positions, LayerNorm, GELU MLP, multi-head attention, no dropout)"),
    (("--eval-", "--skip-train", "--test-mode", "--full-validation", "--multiple-validation-sets"),
     "evaluation is not implemented"),
    (("--rampup-batch-size", "--step-batch-size-schedule", "--decrease-batch-size-if-needed"),
     "the global batch size is constant"),
    (("--wandb-", "--one-logger", "--enable-one-logger", "--log-"),
     "this logging option is not implemented (supported: --log-interval, --log-throughput, "
     "--log-num-zeros-in-grad, --log-timers-to-tensorboard, --log-json, --tensorboard-dir, "
     "--tensorboard-log-interval)"),
    (("--profile", "--use-pytorch-profiler", "--record-memory-history", "--memory-snapshot-path"),
     "profiling is not implemented"),
    (("--overlap-param-gather-with-optimizer-step",),
     "it overlaps the first model chunk's all-gather with the other chunks' update, and this script builds one "
     "model chunk (Megatron-LM also requires virtual pipeline chunks); megatron_opt's API supports it "
     "(OptimizerConfig.overlap_param_gather_with_optimizer_step, docs/usage.md)"),
    (("--optimizer-cpu-offload", "--optimizer-offload-fraction", "--main-grads-dtype", "--use-torch-fsdp2", "--use-megatron-fsdp",
      "--use-custom-fsdp", "--data-parallel-sharding-strategy", "--ddp-num-buckets", "--ddp-average-in-collective",
      "--ddp-pad-buckets", "--ddp-reduce-scatter-with-fp32", "--nccl-ub", "--optimizer-cuda-graph",
      "--no-align-param-gather", "--muon", "--apply-wd-to-qk-layernorm"),
     "not implemented by megatron_opt or by this script"),
]


def _unsupported_reason(flag: str) -> str:
    for prefixes, reason in UNSUPPORTED_REASONS:
        if flag.startswith(prefixes):
            return reason
    return "not a flag this script implements"


def build_parser() -> argparse.ArgumentParser:
    """Megatron-LM's flags (megatron/training/arguments.py), with Megatron-LM's defaults except DEMO_DEFAULTS."""
    p = argparse.ArgumentParser(prog="pretrain_gpt.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    d = DEMO_DEFAULTS
    model = p.add_argument_group("model (Megatron-LM's GPT flags)")
    model.add_argument("--num-layers", "--layers", dest="num_layers", type=int, default=d["num_layers"])
    model.add_argument("--hidden-size", "--hidden", dest="hidden_size", type=int, default=d["hidden_size"])
    model.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x --hidden-size")
    model.add_argument("--num-attention-heads", "--heads", dest="num_attention_heads", type=int,
                       default=d["num_attention_heads"])
    model.add_argument("--seq-length", "--seq-len", dest="seq_length", type=int, default=d["seq_length"])
    model.add_argument("--max-position-embeddings", type=int, default=None, help="default --seq-length")
    model.add_argument("--init-method-std", type=float, default=0.02)
    model.add_argument("--untie-embeddings-and-output-weights", action="store_true")

    train = p.add_argument_group("training")
    train.add_argument("--micro-batch-size", type=int, default=d["micro_batch_size"])
    train.add_argument("--global-batch-size", type=int, default=None,
                       help="default micro-batch-size x data-parallel size (one micro-batch per step)")
    train.add_argument("--num-microbatches", type=int, default=None,
                       help="this script's own: global batch = micro-batch-size x this x data-parallel size")
    train.add_argument("--train-iters", "--steps", dest="train_iters", type=int, default=None,
                       help=f"default {d['train_iters']} when --train-samples is not given")
    train.add_argument("--train-samples", type=int, default=None)
    train.add_argument("--exit-interval", type=int, default=None,
                       help="save (with --save) and exit after an iteration divisible by this")
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument("--calculate-per-token-loss", action="store_true",
                       help="normalise the loss by the step's supervised token count over all micro-batches and "
                            "ranks (default: the mean of each micro-batch's mean token loss)")
    train.add_argument("--loss-mode", choices=mo.training.LOSS_MODES, default=None,
                       help="this script's own: per_token = --calculate-per-token-loss, mean = without it")
    train.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                       help="auto: one GPU per local rank when there are enough GPUs (NCCL), else CPU (gloo)")

    opt = p.add_argument_group("optimizer")
    opt.add_argument("--optimizer", choices=("adam", "sgd", "lion"), default="adam",
                     help="adam is AdamW (decoupled weight decay), as in Megatron-LM")
    opt.add_argument("--lr", type=float, default=d["lr"])
    opt.add_argument("--min-lr", type=float, default=0.0)
    opt.add_argument("--decoupled-lr", type=float, default=None,
                     help="max lr of the input embedding and output layer (their own schedule)")
    opt.add_argument("--decoupled-min-lr", type=float, default=None)
    opt.add_argument("--weight-decay", type=float, default=0.01)
    opt.add_argument("--clip-grad", type=float, default=1.0, help="0 turns clipping off")
    opt.add_argument("--adam-beta1", type=float, default=0.9)
    opt.add_argument("--adam-beta2", type=float, default=0.999)
    opt.add_argument("--adam-eps", type=float, default=1e-8)
    opt.add_argument("--sgd-momentum", type=float, default=0.9)
    opt.add_argument("--use-precision-aware-optimizer", action="store_true",
                     help="Megatron-LM's precision-aware optimizer: the dtypes below, and bf16 params' masters kept "
                          "as the param plus a 16-bit remainder")
    opt.add_argument("--main-params-dtype", choices=("fp32", "fp16"), default="fp32")
    opt.add_argument("--exp-avg-dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    opt.add_argument("--exp-avg-sq-dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    opt.add_argument("--no-store-param-remainders", dest="store_param_remainders", action="store_false",
                     help="this script's own: fp32 masters for bf16 params even with the precision-aware optimizer")
    opt.add_argument("--stochastic-rounding", action="store_true",
                     help="this script's own: round bf16 moments stochastically")
    opt.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                     help="shard the optimizer within DP/N-rank instances and replicate it across them "
                          "(needs --use-distributed-optimizer)")
    opt.add_argument("--use-distributed-optimizer", action="store_true",
                     help="shard the optimizer state over the data-parallel ranks (ZeRO-1); without it every "
                          "rank holds the whole optimizer (plain data parallelism)")

    sched = p.add_argument_group("learning-rate and weight-decay schedule (counted in samples)")
    sched.add_argument("--lr-decay-style", choices=mo.scheduler.LR_DECAY_STYLES, default="linear")
    sched.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    sched.add_argument("--lr-decay-samples", type=int, default=None, help="default --train-samples")
    sched.add_argument("--lr-warmup-iters", "--warmup-steps", dest="lr_warmup_iters", type=int, default=None,
                       help=f"default {d['lr_warmup_iters']} with iteration-based training (Megatron-LM: 0)")
    sched.add_argument("--lr-warmup-samples", type=int, default=None, help="default 0")
    sched.add_argument("--lr-warmup-fraction", type=float, default=None,
                       help="warm up over this fraction of the LR decay length")
    sched.add_argument("--lr-warmup-init", type=float, default=0.0)
    sched.add_argument("--lr-wsd-decay-style", choices=mo.scheduler.WSD_DECAY_STYLES, default="exponential")
    sched.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    sched.add_argument("--lr-wsd-decay-samples", type=int, default=None)
    sched.add_argument("--start-weight-decay", type=float, default=None)
    sched.add_argument("--end-weight-decay", type=float, default=None)
    sched.add_argument("--weight-decay-incr-style", choices=mo.scheduler.WD_INCR_STYLES, default="constant")
    sched.add_argument("--override-opt-param-scheduler", action="store_true",
                       help="on --load, keep this command line's schedule over the checkpoint's")
    sched.add_argument("--use-checkpoint-opt-param-scheduler", action="store_true",
                       help="on --load, take the checkpoint's schedule (this script's default when neither is given)")

    prec = p.add_argument_group("mixed precision")
    precision = prec.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true")
    precision.add_argument("--fp16", action="store_true")
    prec.add_argument("--loss-scale", type=float, default=None,
                      help="a constant loss scale (with --fp16 or --bf16); default: dynamic for --fp16")
    prec.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    prec.add_argument("--min-loss-scale", type=float, default=1.0)
    prec.add_argument("--loss-scale-window", type=float, default=1000)
    prec.add_argument("--hysteresis", type=int, default=2)
    prec.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                      help="fp32 gradient buffers (always on with --bf16 unless --grad-reduce-in-bf16)")
    prec.add_argument("--grad-reduce-in-bf16", action="store_true")

    ddp = p.add_argument_group("data-parallel communication")
    ddp.add_argument("--overlap-grad-reduce", action="store_true")
    ddp.add_argument("--overlap-param-gather", action="store_true", help="needs --use-distributed-optimizer")
    ddp.add_argument("--ddp-bucket-size", "--bucket-size", dest="ddp_bucket_size", type=int, default=None,
                     help="elements per gradient bucket (default: megatron_opt chooses)")
    ddp.add_argument("--distributed-timeout-minutes", type=int, default=10,
                     help="timeout of every collective (default 10; gloo's own default is 30)")

    log = p.add_argument_group("logging")
    log.add_argument("--log-interval", type=int, default=d["log_interval"])
    log.add_argument("--log-throughput", action="store_true", help="log model TFLOP/s per rank")
    log.add_argument("--log-num-zeros-in-grad", action="store_true")
    log.add_argument("--tensorboard-dir", default=None, help="write Megatron-LM's scalars (needs tensorboard)")
    log.add_argument("--tensorboard-log-interval", type=int, default=1)
    log.add_argument("--log-timers-to-tensorboard", action="store_true",
                     help="also write iteration-time (and throughput with --log-throughput)")
    log.add_argument("--log-json", default=None, metavar="FILE",
                     help="this script's own: append one JSON line per iteration (rank 0): the exact values")

    ck = p.add_argument_group("checkpoints")
    ck.add_argument("--save", default=None, help="checkpoint folder to save into")
    ck.add_argument("--save-interval", type=int, default=None, help="save every N iterations (and at the end)")
    ck.add_argument("--load", default=None, help="checkpoint folder to resume from (its latest iteration)")
    ck.add_argument("--no-load-optim", action="store_true", help="load the model only")
    ck.add_argument("--no-load-rng", action="store_true", help="do not restore the RNG states")
    ck.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    ck.add_argument("--keep-latest-k", type=int, default=None, help="delete older checkpoints")

    hang = p.add_argument_group("hangs")
    hang.add_argument("--watchdog-multiple", type=float, default=20.0,
                      help="exit (code 3) when a step runs longer than this many median step times "
                           "and --watchdog-min-seconds; 0 disables the watchdog (default 20)")
    hang.add_argument("--watchdog-min-seconds", type=float, default=60.0,
                      help="never fire before a step has run this long (default 60)")
    return p


def _given_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> dict[str, str]:
    """dest -> the option string last typed for it."""
    given = {}
    for token in argv:
        if token.startswith("-"):
            action = parser._option_string_actions.get(token.split("=", 1)[0])
            if action is not None:
                given[action.dest] = token.split("=", 1)[0]
    return given


def _group_unknown(extras: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Unknown command-line words as (flag, its values); a word that is no flag follows the flag before it."""
    groups: list[tuple[str, list[str]]] = []
    for word in extras:
        is_flag = word.startswith("-") and not _is_number(word)
        if is_flag:
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


def _is_noop(flag: str, values: list[str]) -> bool:
    if flag not in NOOP_VALUES:
        return False
    want = NOOP_VALUES[flag]
    if want is None:
        return not values
    if len(values) != 1:
        return False
    if _is_number(want):
        return _is_number(values[0]) and float(values[0]) == float(want)
    return values[0] == want


def unsupported_flags_message(extras: Sequence[str]) -> Optional[str]:
    """One message naming every flag of ``extras`` this script does not implement, or None."""
    bad = [(flag, values) for flag, values in _group_unknown(extras) if not _is_noop(flag, values)]
    if not bad:
        return None
    lines = [f"  {' '.join([flag, *values])}: {_unsupported_reason(flag)}" for flag, values in bad]
    accepted = ", ".join(f"{k} {v}" if v is not None else k for k, v in NOOP_VALUES.items())
    return (f"{len(bad)} flag{'s' if len(bad) > 1 else ''} not supported by pretrain_gpt.py (nothing was run):\n"
            + "\n".join(lines)
            + f"\nRemove {'them' if len(bad) > 1 else 'it'}. Megatron-LM flags accepted as no-ops here: {accepted}.")


class FlagNames:
    """Names flags in messages: as typed; an untyped one in the command line's style (old or Megatron-LM)."""

    def __init__(self, given: dict[str, str]) -> None:
        self.given = given
        self.legacy_style = any(given.get(dest) == old for dest, old in LEGACY_ALIASES.items())

    def __call__(self, dest: str) -> str:
        if dest in self.given:
            return self.given[dest]
        if self.legacy_style and dest in LEGACY_ALIASES:
            return LEGACY_ALIASES[dest]
        return "--" + dest.replace("_", "-")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and check the command line; every error exits with code 2 before any process group exists.

    The data-parallel size for the micro-batch count is read from torchrun's WORLD_SIZE (1 without it).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    args, extras = p.parse_known_args(argv)
    message = unsupported_flags_message(extras)
    if message:
        p.error(message)
    args.given = _given_flags(p, argv)
    check_args(p, args, int(os.environ.get("WORLD_SIZE", "1")))
    return args


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace, data_parallel_size: int = 1) -> None:
    """Megatron-LM's checks on the flags, and the value ranges megatron_opt needs, as parser errors."""
    given = getattr(args, "given", {})
    name = FlagNames(given)

    def positive(*dests: str, optional: bool = False) -> None:
        for dest in dests:
            value = getattr(args, dest)
            if (value is not None or not optional) and (value is None or value <= 0):
                p.error(f"{name(dest)} must be a positive integer, got {value}")

    positive("micro_batch_size", "seq_length", "hidden_size", "num_layers", "num_attention_heads",
             "distributed_timeout_minutes", "log_interval", "tensorboard_log_interval")
    positive("train_iters", "train_samples", "num_microbatches", "global_batch_size", "save_interval",
             "exit_interval", "keep_latest_k", "ddp_bucket_size", "lr_decay_iters", "lr_decay_samples",
             "ffn_hidden_size", "max_position_embeddings", "lr_wsd_decay_iters", "lr_wsd_decay_samples",
             optional=True)
    for dest in ("lr_warmup_samples",):
        if getattr(args, dest) is not None and getattr(args, dest) < 0:
            p.error(f"{name(dest)} must be >= 0, got {getattr(args, dest)}")
    if args.hidden_size % args.num_attention_heads:
        p.error(f"{name('hidden_size')} {args.hidden_size} is not divisible by {name('num_attention_heads')} "
                f"{args.num_attention_heads}: each head gets hidden/heads channels; pick "
                f"{name('num_attention_heads')} that divides {name('hidden_size')} (or a {name('hidden_size')} that "
                f"is a multiple of {name('num_attention_heads')})")
    if args.max_position_embeddings is not None and args.max_position_embeddings < args.seq_length:
        p.error(f"--max-position-embeddings {args.max_position_embeddings} must be >= {name('seq_length')} "
                f"{args.seq_length}")

    # Batch: Megatron-LM's global batch, or this script's --num-microbatches.
    if args.num_microbatches is not None:
        implied = args.micro_batch_size * args.num_microbatches * data_parallel_size
        if args.global_batch_size is not None and args.global_batch_size != implied:
            p.error(f"--global-batch-size {args.global_batch_size} contradicts --num-microbatches "
                    f"{args.num_microbatches} (x --micro-batch-size {args.micro_batch_size} x data-parallel size "
                    f"{data_parallel_size} = {implied}); give one of them")
        args.global_batch_size = implied
    elif args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * data_parallel_size
    try:
        args.num_microbatches = num_microbatches(args.global_batch_size, args.micro_batch_size, data_parallel_size)
    except ValueError as exc:
        p.error(str(exc))

    # Run length: iterations or samples (Megatron-LM: exactly one).
    if args.train_iters is not None and args.train_samples is not None:
        p.error(f"{name('train_iters')} and --train-samples are exclusive: train for a number of iterations or "
                f"of samples")
    if args.train_samples is None and args.train_iters is None:
        args.train_iters = DEMO_DEFAULTS["train_iters"]
    sample_based = args.train_samples is not None
    # Megatron-LM's asserts: the schedule is counted in the unit of the run length.
    wrong = ({"train_iters": "--train-samples alone", "lr_decay_iters": "--lr-decay-samples",
              "lr_warmup_iters": "--lr-warmup-samples or --lr-warmup-fraction",
              "lr_wsd_decay_iters": "--lr-wsd-decay-samples"} if sample_based else
             {"lr_decay_samples": "--lr-decay-iters", "lr_warmup_samples": "--lr-warmup-iters or --lr-warmup-fraction",
              "lr_wsd_decay_samples": "--lr-wsd-decay-iters"})
    for dest, instead in wrong.items():
        if getattr(args, dest) is not None:
            length = "--train-samples" if sample_based else name("train_iters")
            p.error(f"{name(dest)} does not go with {length}: with {'sample' if sample_based else 'iteration'}-based "
                    f"training ({length}) the schedule is given in {'samples' if sample_based else 'iterations'}; "
                    f"use {instead}")
    if args.lr_warmup_fraction is not None:
        other = "lr_warmup_samples" if sample_based else "lr_warmup_iters"
        if getattr(args, other) is not None:
            p.error(f"--lr-warmup-fraction and {name(other)} are exclusive: give one of them")
        if not (math.isfinite(args.lr_warmup_fraction) and 0 <= args.lr_warmup_fraction < 1):
            p.error(f"--lr-warmup-fraction must be in [0, 1), got {args.lr_warmup_fraction:g}")
    if sample_based:
        if args.train_samples < args.global_batch_size:
            p.error(f"--train-samples {args.train_samples} is less than one global batch ({args.global_batch_size} "
                    f"samples): nothing to train")
        args.train_iters_resolved = args.train_samples // args.global_batch_size
    else:
        args.train_iters_resolved = args.train_iters
        if args.lr_warmup_iters is None and args.lr_warmup_fraction is None:
            args.lr_warmup_iters = DEMO_DEFAULTS["lr_warmup_iters"]
        decay = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
        decay_name = name("lr_decay_iters") if args.lr_decay_iters is not None else name("train_iters")
        if args.lr_warmup_iters is not None and not 0 <= args.lr_warmup_iters < decay:
            p.error(f"{name('lr_warmup_iters')} {args.lr_warmup_iters} must be >= 0 and less than the LR decay "
                    f"length {decay_name} {decay} (the LR warms up over {name('lr_warmup_iters')} iterations, then "
                    f"decays until {decay_name}); lower {name('lr_warmup_iters')} or raise {decay_name}")

    # Optimizer values.
    if not (math.isfinite(args.lr) and math.isfinite(args.min_lr) and 0 <= args.min_lr <= args.lr):
        p.error(f"need 0 <= --min-lr <= --lr (both finite), got --lr {args.lr:g} and --min-lr {args.min_lr:g}")
    if not (math.isfinite(args.lr_warmup_init) and 0 <= args.lr_warmup_init <= args.lr):
        p.error(f"need 0 <= --lr-warmup-init <= --lr, got {args.lr_warmup_init:g}")
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        p.error(f"--weight-decay must be a finite number >= 0, got {args.weight_decay:g}")
    if args.weight_decay_incr_style == "constant":
        for dest in ("start_weight_decay", "end_weight_decay"):
            if getattr(args, dest) is not None:
                p.error(f"{name(dest)} needs --weight-decay-incr-style linear or cosine (with the default "
                        f"'constant' the weight decay is --weight-decay throughout)")
    else:
        if args.start_weight_decay is None or args.end_weight_decay is None:
            p.error(f"--weight-decay-incr-style {args.weight_decay_incr_style} needs --start-weight-decay and "
                    f"--end-weight-decay")
        if not (math.isfinite(args.end_weight_decay) and 0 <= args.start_weight_decay <= args.end_weight_decay):
            p.error(f"need 0 <= --start-weight-decay <= --end-weight-decay, got {args.start_weight_decay:g} and "
                    f"{args.end_weight_decay:g}")
    if args.lr_decay_style == "WSD" and (args.lr_wsd_decay_samples if sample_based else args.lr_wsd_decay_iters) is None:
        p.error(f"--lr-decay-style WSD needs {'--lr-wsd-decay-samples' if sample_based else '--lr-wsd-decay-iters'}")
    if not (math.isfinite(args.min_loss_scale) and args.min_loss_scale > 0):
        p.error(f"--min-loss-scale must be a finite number > 0, got {args.min_loss_scale:g}")
    if not (math.isfinite(args.initial_loss_scale) and args.initial_loss_scale >= args.min_loss_scale):
        p.error(f"--initial-loss-scale must be a finite number >= --min-loss-scale {args.min_loss_scale:g}, got "
                f"{args.initial_loss_scale:g}; fp16 training usually starts at a power of two such as 65536")
    if args.loss_scale is not None and not (math.isfinite(args.loss_scale) and args.loss_scale > 0):
        p.error(f"--loss-scale must be a finite number > 0 (a constant loss scale), got {args.loss_scale:g}")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        p.error("--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are exclusive")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        p.error("--overlap-param-gather needs --use-distributed-optimizer (only the sharded optimizer all-gathers "
                "parameters), as in Megatron-LM")
    if args.grad_reduce_in_bf16 and not args.bf16:
        p.error("--grad-reduce-in-bf16 needs --bf16")
    if args.grad_reduce_in_bf16 and args.accumulate_allreduce_grads_in_fp32:
        p.error("--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 are exclusive")

    # Loss normalisation: Megatron-LM's flag or this script's --loss-mode.
    if args.loss_mode == "mean" and args.calculate_per_token_loss:
        p.error("--loss-mode mean contradicts --calculate-per-token-loss (which is --loss-mode per_token)")
    args.loss_mode = args.loss_mode or ("per_token" if args.calculate_per_token_loss else "mean")
    args.calculate_per_token_loss = args.loss_mode == "per_token"

    if not (math.isfinite(args.watchdog_multiple) and args.watchdog_multiple >= 0):
        p.error(f"--watchdog-multiple must be a finite number >= 0 (0 disables the watchdog), "
                f"got {args.watchdog_multiple:g}")
    if not (math.isfinite(args.watchdog_min_seconds) and args.watchdog_min_seconds > 0):
        p.error(f"--watchdog-min-seconds must be a positive number of seconds, got {args.watchdog_min_seconds:g}")
    if args.tensorboard_dir is not None:
        try:
            importlib.import_module("torch.utils.tensorboard")
        except ImportError as exc:
            p.error(f"--tensorboard-dir needs the tensorboard package, which is not installed ({exc}); "
                    f"install it with `pip install tensorboard`, or leave out --tensorboard-dir")

    # Everything megatron_opt checks itself (ranges of betas, eps, clip, hysteresis ...), before any process group.
    try:
        build_configs(args, data_parallel_size)
    except (ValueError, TypeError) as exc:
        p.error(_flag_names_in(str(exc)))


CONFIG_FIELD_FLAGS = {"bucket_size": "--ddp-bucket-size", "grad_reduce_in_fp32": "--accumulate-allreduce-grads-in-fp32",
                      "init_lr": "--lr-warmup-init", "max_lr": "--lr"}


def _flag_names_in(message: str) -> str:
    """megatron_opt's config errors name fields (OptimizerConfig.adam_beta2); name the flags instead."""
    def flag(match: "re.Match") -> str:
        field = match.group(2)
        return CONFIG_FIELD_FLAGS.get(field, "--" + field.replace("_", "-"))
    return re.sub(r"\b(OptimizerConfig|DistributedDataParallelConfig)\.(\w+)", flag, message)


def num_microbatches(global_batch_size: int, micro_batch_size: int, data_parallel_size: int) -> int:
    """Megatron-LM's micro-batch count: global batch / (micro batch x data-parallel size), which must divide."""
    per_step = micro_batch_size * data_parallel_size
    if global_batch_size % per_step:
        raise ValueError(
            f"--global-batch-size {global_batch_size} is not divisible by --micro-batch-size {micro_batch_size} x "
            f"data-parallel size {data_parallel_size} = {per_step}: every step runs global / (micro x data-parallel) "
            f"micro-batches on each rank; pick a global batch size that is a multiple of {per_step}")
    return global_batch_size // per_step


class RunConfig(NamedTuple):
    """What the flags mean for a run at one data-parallel size (see build_configs)."""

    ddp_config: mo.DistributedDataParallelConfig
    optimizer_config: mo.OptimizerConfig
    scheduler_kwargs: dict  # OptimizerParamScheduler's arguments after ``optimizer``, counted in samples
    model_kwargs: dict  # GPT's arguments after ``vocab``
    model_dtype: torch.dtype
    loss_mode: str  # train_step's: "per_token" (--calculate-per-token-loss) or "mean"
    data_parallel_size: int
    micro_batch_size: int
    num_microbatches: int
    global_batch_size: int  # samples per iteration = the scheduler's increment
    train_iters: int
    seq_length: int


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_configs(args: argparse.Namespace, data_parallel_size: int) -> RunConfig:
    """Map the checked flags (parse_args) to megatron_opt's configs as Megatron-LM maps its arguments
    (training.py: get_model, get_megatron_optimizer_config, get_optimizer_param_scheduler)."""
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    grad_reduce_in_fp32 = args.accumulate_allreduce_grads_in_fp32 or (args.bf16 and not args.grad_reduce_in_bf16)
    ddp_config = mo.DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather, use_distributed_optimizer=args.use_distributed_optimizer,
        bucket_size=args.ddp_bucket_size, num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
    )
    optimizer_config = mo.OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr,
        fp16=args.fp16, bf16=args.bf16, params_dtype=dtype,
        # Megatron-LM uses a loss scaler only with fp16/bf16: --loss-scale does nothing in fp32.
        loss_scale=args.loss_scale if (args.fp16 or args.bf16) else None,
        initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum, use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather, clip_grad=args.clip_grad,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
        use_precision_aware_optimizer=args.use_precision_aware_optimizer,
        main_params_dtype=_DTYPES[args.main_params_dtype], exp_avg_dtype=_DTYPES[args.exp_avg_dtype],
        exp_avg_sq_dtype=_DTYPES[args.exp_avg_sq_dtype], store_param_remainders=args.store_param_remainders,
        stochastic_rounding=args.stochastic_rounding,
    )
    gbs = args.global_batch_size
    mbs = num_microbatches(gbs, args.micro_batch_size, data_parallel_size)
    if args.train_samples is not None:  # sample-based: Megatron-LM's clock counts the flags' samples
        train_iters = args.train_samples // gbs
        decay_steps = args.lr_decay_samples if args.lr_decay_samples is not None else args.train_samples
        wd_incr_steps = args.train_samples
        wsd_decay_steps = args.lr_wsd_decay_samples
        warmup_steps = (args.lr_warmup_fraction * decay_steps if args.lr_warmup_fraction is not None
                        else args.lr_warmup_samples or 0)
    else:  # iteration-based: iterations x global batch
        train_iters = args.train_iters
        decay_steps = (args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters) * gbs
        wd_incr_steps = args.train_iters * gbs
        wsd_decay_steps = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters is not None else None
        warmup_steps = (args.lr_warmup_fraction * decay_steps if args.lr_warmup_fraction is not None
                        else (args.lr_warmup_iters or 0) * gbs)
    constant_wd = args.weight_decay_incr_style == "constant"
    scheduler_kwargs = dict(
        init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay if constant_wd else args.start_weight_decay,
        end_wd=args.weight_decay if constant_wd else args.end_weight_decay,
        wd_incr_steps=wd_incr_steps, wd_incr_style=args.weight_decay_incr_style,
        # Neither flag: take the checkpoint's schedule (Megatron-LM would refuse a changed one).
        use_checkpoint_opt_param_scheduler=not args.override_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=wsd_decay_steps, lr_wsd_decay_style=args.lr_wsd_decay_style,
    )
    mo.OptimizerParamScheduler(_NoParamGroups(), **scheduler_kwargs)  # its own checks (ValueError), early
    model_kwargs = dict(
        max_positions=args.max_position_embeddings or args.seq_length, hidden=args.hidden_size,
        layers=args.num_layers, heads=args.num_attention_heads, ffn_hidden=args.ffn_hidden_size,
        init_std=args.init_method_std, tie_embeddings=not args.untie_embeddings_and_output_weights,
    )
    return RunConfig(ddp_config=ddp_config, optimizer_config=optimizer_config, scheduler_kwargs=scheduler_kwargs,
                     model_kwargs=model_kwargs, model_dtype=dtype, loss_mode=args.loss_mode,
                     data_parallel_size=data_parallel_size, micro_batch_size=args.micro_batch_size,
                     num_microbatches=mbs, global_batch_size=gbs, train_iters=train_iters,
                     seq_length=args.seq_length)


class _NoParamGroups:
    param_groups: list = []


def _use_cuda(choice: str) -> bool:
    """One GPU per local rank: NCCL cannot run two ranks on one GPU."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    enough = torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks
    if choice == "cuda" and not enough:
        raise SystemExit(f"pretrain_gpt.py: --device cuda needs one GPU per local rank: {local_ranks} local ranks, "
                         f"{torch.cuda.device_count()} GPUs visible. Lower --nproc_per_node or use --device cpu.")
    return choice == "cuda" or (choice == "auto" and enough)


# ----------------------------------------------------------------------------- logging
def model_flops_per_iteration(run: RunConfig, vocab: int) -> float:
    """Training FLOPs of one iteration: 3 x the forward pass (2 per multiply-add) of every matmul,
    attention scores and values included, over the global batch."""
    kw, s = run.model_kwargs, run.seq_length
    h, layers, ffn = kw["hidden"], kw["layers"], kw["ffn_hidden"] or 4 * kw["hidden"]
    per_token = layers * (4 * h * h + 2 * h * ffn) + h * vocab
    forward = run.global_batch_size * (2 * s * per_token + layers * 4 * s * s * h)
    return 3.0 * forward


class TensorboardLog:
    """Megatron-LM's training_log scalars, written by the last rank (as Megatron-LM does)."""

    def __init__(self, args: argparse.Namespace, run: RunConfig) -> None:
        from torch.utils.tensorboard import SummaryWriter  # checked in parse_args

        self.args, self.run = args, run
        self.writer = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=1000)
        for key, value in sorted(vars(args).items()):
            self.writer.add_text(key, str(value), global_step=0)

    def log(self, iteration: int, consumed: int, result: mo.TrainStepResult, skipped_samples: int,
            iteration_time: float, tflops: float) -> None:
        if iteration % self.args.tensorboard_log_interval:
            return
        w = self.writer
        w.add_scalar("learning-rate", result.lr, iteration)
        w.add_scalar("learning-rate vs samples", result.lr, consumed)
        if skipped_samples > 0:
            w.add_scalar("skipped-train-samples", skipped_samples, iteration)
        w.add_scalar("batch-size", self.run.global_batch_size, iteration)
        w.add_scalar("batch-size vs samples", self.run.global_batch_size, consumed)
        w.add_scalar("lm loss", result.loss, iteration)
        w.add_scalar("lm loss vs samples", result.loss, consumed)
        w.add_scalar("loss-scale", result.loss_scale, iteration)
        w.add_scalar("loss-scale vs samples", result.loss_scale, consumed)
        if result.grad_norm is not None:
            w.add_scalar("grad-norm", result.grad_norm, iteration)
            w.add_scalar("grad-norm vs samples", result.grad_norm, consumed)
        if result.num_zeros is not None:
            w.add_scalar("num-zeros", result.num_zeros, iteration)
            w.add_scalar("num-zeros vs samples", result.num_zeros, consumed)
        if self.args.log_timers_to_tensorboard:
            w.add_scalar("iteration-time", iteration_time, iteration)
            if self.args.log_throughput:
                w.add_scalar("throughput", tflops, iteration)

    def close(self) -> None:
        self.writer.close()


# ----------------------------------------------------------------------------- main
def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    use_cuda = _use_cuda(args.device)
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo",
                            timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    rank, world = dist.get_rank(), dist.get_world_size()
    run = build_configs(args, world)
    watchdog = Watchdog(rank, args.watchdog_multiple, args.watchdog_min_seconds)
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    if rank != 0:  # every rank makes the same skip decision; let rank 0 report it
        logging.getLogger("megatron_opt").setLevel(logging.ERROR)
    if not use_cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    dataset = CharDataset(build_corpus(), args.seq_length, seed=args.seed + rank)  # each rank its own data
    torch.manual_seed(args.seed)
    model = GPT(len(dataset.vocab), **run.model_kwargs).to(device, run.model_dtype)
    ddp = mo.DistributedDataParallel(model, run.ddp_config)
    ddp.broadcast_params()
    optimizer = mo.get_megatron_optimizer(run.optimizer_config, ddp)
    scheduler = mo.OptimizerParamScheduler(optimizer, **run.scheduler_kwargs)
    loss_fn = gpt_loss if run.loss_mode == "per_token" else gpt_mean_loss
    gbs = run.global_batch_size
    start_iteration = consumed_samples = 0
    if args.load is not None and mo.checkpoint.latest_iteration(args.load) is not None:
        state = mo.checkpoint.load(args.load, ddp, optimizer, scheduler, load_optimizer=not args.no_load_optim,
                                   load_rng=not args.no_load_rng)
        start_iteration, consumed_samples = state.iteration, state.consumed_samples
        if state.rank_extra is not None and "data" in state.rank_extra:
            dataset.gen.set_state(state.rank_extra["data"])
        else:  # another DP size: each rank's data stream starts afresh, away from the first run's
            dataset.gen.manual_seed(args.seed + rank + 7919 * (start_iteration + 1))
        if rank == 0:
            print(f"resumed from iteration {state.iteration} (saved at DP={state.saved_data_parallel_size}, "
                  f"now DP={world}) from {state.path}", flush=True)

    def save(iteration: int) -> None:
        mo.checkpoint.save(args.save, ddp, optimizer, scheduler, iteration=iteration,
                           consumed_samples=consumed_samples, rank_extra={"data": dataset.gen.get_state()},
                           keep_latest_k=args.keep_latest_k, async_save=args.async_save)
        if rank == 0:
            print(f"saved iteration {iteration} to {args.save}{' (in the background)' if args.async_save else ''}",
                  flush=True)

    tensorboard = TensorboardLog(args, run) if args.tensorboard_dir is not None and rank == world - 1 else None
    json_log = open(args.log_json, "a") if args.log_json is not None and rank == 0 else None
    flops = model_flops_per_iteration(run, len(dataset.vocab))
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", 1))  # torchrun's launcher (node) count
        print(f"megatron_opt pretrain_gpt: {n_params / 1e6:.2f}M params, DP={world}, "
              f"{nodes} node{'s' if nodes > 1 else ''}, device={device}, "
              f"dtype={run.model_dtype}, ops backend={mo.ops.backend_for(next(model.parameters()))}, "
              f"{'distributed' if args.use_distributed_optimizer else 'non-distributed'} optimizer, "
              f"loss mode={run.loss_mode}, global batch {gbs} = {run.micro_batch_size} x {run.num_microbatches} "
              f"micro-batches x DP {world}, {run.train_iters} iterations", flush=True)
        if args.loss_scale is not None and not (args.fp16 or args.bf16):
            print("note: --loss-scale has no effect without --fp16 or --bf16 (as in Megatron-LM)", flush=True)
    first_loss = last_loss = None
    skipped_samples = 0
    interval_losses: list[float] = []
    interval_time = 0.0
    for step in range(start_iteration + 1, run.train_iters + 1):
        batches = [tuple(t.to(device) for t in dataset.microbatch(run.micro_batch_size))
                   for _ in range(run.num_microbatches)]
        with watchdog.step(step):  # checkpoint saves are not watched (the collective timeout covers them)
            start = time.perf_counter()
            result = mo.train_step(ddp, optimizer, scheduler, batches, loss_fn, loss_mode=run.loss_mode,
                                   samples_per_step=gbs)
            if use_cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
        consumed_samples += gbs
        skipped_samples += 0 if result.success else gbs
        first_loss = result.loss if first_loss is None else first_loss
        last_loss = result.loss if result.success else last_loss
        if result.success:
            interval_losses.append(result.loss)
        interval_time += elapsed
        tflops = flops / elapsed / world / 1e12
        if json_log is not None:
            json_log.write(json.dumps({
                "iteration": step, "consumed_samples": consumed_samples, "lm loss": result.loss,
                "grad_norm": result.grad_norm, "num_zeros": result.num_zeros, "loss_scale": result.loss_scale,
                "learning_rate": result.lr, "success": result.success, "skip_reason": result.skip_reason,
                "skipped_iterations": result.skipped_steps, "num_tokens": result.num_tokens}) + "\n")
            json_log.flush()
        if tensorboard is not None:
            tensorboard.log(step, consumed_samples, result, skipped_samples, elapsed, tflops)
        if rank == 0 and step % args.log_interval == 0:
            # Megatron-LM's interval average of the loss (over the steps that updated); the rest is this step's.
            loss = sum(interval_losses) / len(interval_losses) if interval_losses else result.loss
            per_iteration = interval_time / args.log_interval
            norm = f"{result.grad_norm:.3f}" if result.grad_norm is not None else "skipped"
            tokens = result.num_tokens if run.loss_mode == "per_token" else gbs * args.seq_length
            zeros = f" | num zeros {result.num_zeros}" if result.num_zeros is not None else ""
            throughput = f" | TFLOP/s/rank {flops / per_iteration / world / 1e12:.3f}" if args.log_throughput else ""
            print(f"step {step:4d} | loss {loss:.4f} | grad norm {norm} | loss scale {result.loss_scale:g} "
                  f"| lr {result.lr:.3e} | skipped {result.skipped_steps}{zeros} | tokens/s {tokens / elapsed:,.0f} "
                  f"| ms/iteration {per_iteration * 1000:.1f}{throughput}", flush=True)
        if step % args.log_interval == 0:
            interval_losses, interval_time = [], 0.0
        exiting = args.exit_interval is not None and step % args.exit_interval == 0
        if args.save is not None:
            mo.checkpoint.check_pending_save()  # a failed background save stops every rank here
            if (args.save_interval and step % args.save_interval == 0) or step == run.train_iters or exiting:
                save(step)
        if exiting:
            break
    if args.save is not None:
        mo.checkpoint.wait_for_pending_save()
    if json_log is not None:
        json_log.close()
    if tensorboard is not None:
        tensorboard.close()
    if rank == 0 and first_loss is not None:
        print(f"done: loss {first_loss:.4f} -> {last_loss:.4f}", flush=True)
    dist.barrier()  # leave together: a rank tearing gloo down while a peer still talks to it can abort
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
