"""Pretrain a small GPT with megatron_opt under torchrun: CPU/gloo without a GPU, CUDA/NCCL with one.

    torchrun --standalone --nproc_per_node=2 scripts/pretrain_gpt.py --steps 30
    torchrun --standalone --nproc_per_node=2 scripts/pretrain_gpt.py --steps 30 --save ckpt --save-interval 10
    torchrun --standalone --nproc_per_node=3 scripts/pretrain_gpt.py --steps 40 --load ckpt --save ckpt   # resume, DP 2 -> 3

The built-in dataset is character-level text taken from the docstrings of Python's standard library
(present on every machine, nothing is downloaded), cut into documents of random length and padded
with ignored labels, so micro-batches carry different numbers of supervised tokens and the
per-token loss normalisation matters. Every step logs loss, grad norm, loss scale, lr, skipped
steps and tokens/s.

Checkpoints (megatron_opt.checkpoint, Megatron-LM's flag names): ``--save DIR`` saves every
``--save-interval`` iterations and at the end; ``--load DIR`` resumes the model, optimizer, schedule,
loss scale, iteration, RNG and data position (at any data-parallel size; the RNG and data position
only at the same size), ``--no-load-optim`` / ``--no-load-rng`` skip those parts.

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
import logging
import math
import os
import pydoc
import statistics
import sys
import threading
import time
import warnings
from typing import Iterator

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
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.ln2 = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, 4 * hidden)
        self.fc2 = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, h // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, vocab: int, seq_len: int, hidden: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, hidden)
        self.pos = torch.nn.Embedding(seq_len, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.ndim > 1:
                torch.nn.init.normal_(p, std=0.02 / (math.sqrt(2 * layers) if name.endswith(("proj.weight", "fc2.weight")) else 1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


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


# ----------------------------------------------------------------------------- main
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--num-microbatches", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip-grad", type=float, default=1.0)
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true")
    precision.add_argument("--fp16", action="store_true")
    p.add_argument("--initial-loss-scale", type=float, default=2.0**16)
    p.add_argument("--bucket-size", type=int, default=None, help="elements per gradient bucket")
    p.add_argument("--overlap-grad-reduce", action="store_true")
    p.add_argument("--overlap-param-gather", action="store_true")
    p.add_argument("--loss-mode", choices=mo.training.LOSS_MODES, default="per_token")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: one GPU per local rank when there are enough GPUs (NCCL), else CPU (gloo)")
    ck = p.add_argument_group("checkpoints")
    ck.add_argument("--save", default=None, help="checkpoint folder to save into")
    ck.add_argument("--save-interval", type=int, default=None, help="save every N iterations (and at the end)")
    ck.add_argument("--load", default=None, help="checkpoint folder to resume from (its latest iteration)")
    ck.add_argument("--no-load-optim", action="store_true", help="load the model only")
    ck.add_argument("--no-load-rng", action="store_true", help="do not restore the RNG states")
    ck.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    ck.add_argument("--keep-latest-k", type=int, default=None, help="delete older checkpoints")
    ck.add_argument("--exit-interval", type=int, default=None, help="save (with --save) and exit after this iteration")
    hang = p.add_argument_group("hangs")
    hang.add_argument("--distributed-timeout-minutes", type=int, default=10,
                      help="timeout of every collective (default 10; gloo's own default is 30)")
    hang.add_argument("--watchdog-multiple", type=float, default=20.0,
                      help="exit (code 3) when a step runs longer than this many median step times "
                           "and --watchdog-min-seconds; 0 disables the watchdog (default 20)")
    hang.add_argument("--watchdog-min-seconds", type=float, default=60.0,
                      help="never fire before a step has run this long (default 60)")
    args = p.parse_args()
    check_args(p, args)
    return args


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject invalid flag values with parser.error (exit code 2), before any process group exists."""
    for flag in ("steps", "micro_batch_size", "num_microbatches", "seq_len", "hidden", "layers", "heads",
                 "distributed_timeout_minutes"):
        if getattr(args, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}")
    for flag in ("save_interval", "exit_interval", "keep_latest_k", "bucket_size"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}: each head gets hidden/heads "
                f"channels; pick --heads that divides --hidden (or a --hidden that is a multiple of --heads)")
    if not 0 <= args.warmup_steps < args.steps:
        p.error(f"--warmup-steps {args.warmup_steps} must be >= 0 and less than --steps {args.steps} (the LR warms "
                f"up over --warmup-steps iterations, then decays until --steps); lower --warmup-steps or raise --steps")
    if not (math.isfinite(args.lr) and math.isfinite(args.min_lr) and 0 <= args.min_lr <= args.lr):
        p.error(f"need 0 <= --min-lr <= --lr (both finite), got --lr {args.lr:g} and --min-lr {args.min_lr:g}")
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        p.error(f"--weight-decay must be a finite number >= 0, got {args.weight_decay:g}")
    if not (math.isfinite(args.initial_loss_scale) and args.initial_loss_scale >= 1):
        p.error(f"--initial-loss-scale must be a finite number >= 1 (the minimum loss scale), got "
                f"{args.initial_loss_scale:g}; fp16 training usually starts at a power of two such as 65536")
    if not (math.isfinite(args.watchdog_multiple) and args.watchdog_multiple >= 0):
        p.error(f"--watchdog-multiple must be a finite number >= 0 (0 disables the watchdog), "
                f"got {args.watchdog_multiple:g}")
    if not (math.isfinite(args.watchdog_min_seconds) and args.watchdog_min_seconds > 0):
        p.error(f"--watchdog-min-seconds must be a positive number of seconds, got {args.watchdog_min_seconds:g}")


def _use_cuda(choice: str) -> bool:
    """One GPU per local rank: NCCL cannot run two ranks on one GPU."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    enough = torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks
    if choice == "cuda" and not enough:
        raise SystemExit(f"pretrain_gpt.py: --device cuda needs one GPU per local rank: {local_ranks} local ranks, "
                         f"{torch.cuda.device_count()} GPUs visible. Lower --nproc_per_node or use --device cpu.")
    return choice == "cuda" or (choice == "auto" and enough)


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    use_cuda = _use_cuda(args.device)
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo",
                            timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    rank, world = dist.get_rank(), dist.get_world_size()
    watchdog = Watchdog(rank, args.watchdog_multiple, args.watchdog_min_seconds)
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    if rank != 0:  # every rank makes the same skip decision; let rank 0 report it
        logging.getLogger("megatron_opt").setLevel(logging.ERROR)
    if not use_cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    dataset = CharDataset(build_corpus(), args.seq_len, seed=args.seed + rank)  # each rank its own data
    torch.manual_seed(args.seed)
    model = GPT(len(dataset.vocab), args.seq_len, args.hidden, args.layers, args.heads)
    model = model.to(device, torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32)
    ddp_config = mo.DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True, bucket_size=args.bucket_size,
        overlap_grad_reduce=args.overlap_grad_reduce, overlap_param_gather=args.overlap_param_gather,
    )
    ddp = mo.DistributedDataParallel(model, ddp_config)
    ddp.broadcast_params()
    opt_config = mo.OptimizerConfig(
        lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, clip_grad=args.clip_grad, bf16=args.bf16,
        fp16=args.fp16, initial_loss_scale=args.initial_loss_scale, use_distributed_optimizer=True,
    )
    optimizer = mo.get_megatron_optimizer(opt_config, ddp)
    samples_per_step = args.micro_batch_size * args.num_microbatches * world
    scheduler = mo.OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.warmup_steps * samples_per_step, lr_decay_steps=args.steps * samples_per_step,
        lr_decay_style="cosine", start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.steps * samples_per_step, wd_incr_style="constant",
    )
    loss_fn = gpt_loss if args.loss_mode == "per_token" else gpt_mean_loss
    start_iteration = 0
    if args.load is not None and mo.checkpoint.latest_iteration(args.load) is not None:
        state = mo.checkpoint.load(args.load, ddp, optimizer, scheduler, load_optimizer=not args.no_load_optim,
                                   load_rng=not args.no_load_rng)
        start_iteration = state.iteration
        if state.rank_extra is not None and "data" in state.rank_extra:
            dataset.gen.set_state(state.rank_extra["data"])
        else:  # another DP size: each rank's data stream starts afresh, away from the first run's
            dataset.gen.manual_seed(args.seed + rank + 7919 * (start_iteration + 1))
        if rank == 0:
            print(f"resumed from iteration {state.iteration} (saved at DP={state.saved_data_parallel_size}, "
                  f"now DP={world}) from {state.path}", flush=True)

    def save(iteration: int) -> None:
        mo.checkpoint.save(args.save, ddp, optimizer, scheduler, iteration=iteration,
                           consumed_samples=iteration * samples_per_step, rank_extra={"data": dataset.gen.get_state()},
                           keep_latest_k=args.keep_latest_k, async_save=args.async_save)
        if rank == 0:
            print(f"saved iteration {iteration} to {args.save}{' (in the background)' if args.async_save else ''}",
                  flush=True)

    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"megatron_opt pretrain_gpt: {n_params / 1e6:.2f}M params, DP={world}, device={device}, "
              f"dtype={next(model.parameters()).dtype}, ops backend={mo.ops.backend_for(next(model.parameters()))}, "
              f"loss mode={args.loss_mode}", flush=True)
    first_loss = last_loss = None
    for step in range(start_iteration + 1, args.steps + 1):
        batches = [tuple(t.to(device) for t in dataset.microbatch(args.micro_batch_size))
                   for _ in range(args.num_microbatches)]
        with watchdog.step(step):  # checkpoint saves are not watched (the collective timeout covers them)
            start = time.perf_counter()
            result = mo.train_step(ddp, optimizer, scheduler, batches, loss_fn, loss_mode=args.loss_mode,
                                   samples_per_step=samples_per_step)
            if use_cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
        first_loss = result.loss if first_loss is None else first_loss
        last_loss = result.loss if result.success else last_loss
        if rank == 0:
            norm = f"{result.grad_norm:.3f}" if result.grad_norm is not None else "skipped"
            tokens = result.num_tokens if args.loss_mode == "per_token" else samples_per_step * args.seq_len
            print(f"step {step:4d} | loss {result.loss:.4f} | grad norm {norm} | loss scale {result.loss_scale:g} "
                  f"| lr {result.lr:.3e} | skipped {result.skipped_steps} | tokens/s {tokens / elapsed:,.0f}", flush=True)
        if args.save is not None:
            mo.checkpoint.check_pending_save()  # a failed background save stops every rank here
            if (args.save_interval and step % args.save_interval == 0) or step == args.steps or step == args.exit_interval:
                save(step)
        if args.exit_interval is not None and step >= args.exit_interval:
            break
    if args.save is not None:
        mo.checkpoint.wait_for_pending_save()
    if rank == 0 and first_loss is not None:
        print(f"done: loss {first_loss:.4f} -> {last_loss:.4f}", flush=True)
    dist.barrier()  # leave together: a rank tearing gloo down while a peer still talks to it can abort
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
