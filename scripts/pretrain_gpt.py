"""Pretrain a small GPT with megatron_opt under torchrun: CPU/gloo without a GPU, CUDA/NCCL with one.

    torchrun --standalone --nproc_per_node=2 scripts/pretrain_gpt.py
    torchrun --standalone --nproc_per_node=2 scripts/pretrain_gpt.py --train-iters 30 --save ckpt --save-interval 10
    torchrun --standalone --nproc_per_node=3 scripts/pretrain_gpt.py --train-iters 40 --load ckpt --save ckpt  # DP 2 -> 3
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT scripts/pretrain_gpt.py ...

Flags: Megatron-LM's, with Megatron-LM's meaning (megatron_opt.megatron.arguments, docs/usage.md), so
the optimizer, schedule, precision, batch, logging and checkpoint block of a Megatron-LM launch script
runs with only the entry point changed. Flags for what megatron_opt or this script does not have
(fp8, tensor/pipeline parallelism, data and tokenizer paths, other model architectures, evaluation,
...: "not supported yet: <reason>") and unknown flags ("unknown flag --x; did you mean --y?") are all
named in one error (exit code 2; torchrun itself then exits 1), printed by rank 0 without the usage
text, before any process group exists; no-op values (--tensor-model-parallel-size 1,
--attention-dropout 0, ...) are accepted.

Defaults are Megatron-LM's, except where it has none or a run with no flags should stay a short demo
(DEMO_DEFAULTS): --lr 3e-3, --train-iters 30, --micro-batch-size 4, --seq-length 64, --hidden-size 128,
--num-layers 2, --num-attention-heads 4, --lr-warmup-iters a sixth of --train-iters (5 at 30, 0 at 5;
Megatron-LM: 0), --log-interval 1 (Megatron-LM: 100); on --load the checkpoint's schedule is kept unless --override-opt-param-scheduler.
This script's older flags are aliases (LEGACY_ALIASES): --steps, --seq-len, --hidden, --layers, --heads,
--warmup-steps, --bucket-size; with megatron_opt's --num-microbatches N and --loss-mode per_token|mean.

The model is Megatron-LM's default GPT without dropout: learned absolute positions, pre-LayerNorm
blocks with multi-head causal attention and a GELU MLP, biases, and an output layer tied to the input
embedding. The data is character-level text from the docstrings of Python's standard library (nothing
is downloaded), cut into documents of random length and padded with ignored labels, so micro-batches
carry different numbers of supervised tokens and the per-token loss normalisation matters. Every
--log-interval iterations rank 0 logs loss (the interval's mean), grad norm, loss scale, lr, skipped
iterations, tokens/s and time per iteration; --log-json FILE appends the exact values of every iteration.

Checkpoints (megatron_opt.checkpoint): --save DIR every --save-interval iterations and at the end;
--load DIR resumes model, optimizer, schedule, loss scale, iteration, RNG and data position (at any
data-parallel size; RNG and data position only at the same size); --exit-interval N saves and exits.

Divergence: as Megatron-LM (--check-for-nan-in-loss-and-grad, on by default), a non-finite loss, or
non-finite gradients outside the fp16 dynamic scaler's backoff, stops every rank (exit code 4, a
message on stderr, no checkpoint of that state); --no-check-for-nan-in-loss-and-grad trains on, and
the final "done" line then counts the non-finite iterations. Threads: one intra-op thread per rank
unless OMP_NUM_THREADS is set (the header line says which).

Hangs: every collective gives up after --distributed-timeout-minutes (default 10), and a watchdog ends
a rank whose step runs longer than max(--watchdog-min-seconds, --watchdog-multiple x the median step
time) (exit code 3, with a message on stderr; --watchdog-multiple 0 turns it off).
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import pydoc
import sys
import time
import warnings
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

import megatron_opt as mo
import megatron_opt.checkpoint  # noqa: F401  (mo.checkpoint)
from megatron_opt.megatron import arguments as megatron_args
from step_watchdog import StepWatchdog  # scripts/step_watchdog.py

# ----------------------------------------------------------------------------- flags


class DemoWarmupIters:
    """The demo's --lr-warmup-iters: a sixth of --train-iters (5 at the default 30), so a short run
    (--train-iters 5) works without a warmup flag."""

    def __call__(self, args: argparse.Namespace) -> Optional[int]:
        return None if args.train_iters is None else args.train_iters // 6

    def __repr__(self) -> str:
        return "train-iters // 6"


DEMO_DEFAULTS = {"lr": 3e-3, "train_iters": 30, "micro_batch_size": 4, "seq_length": 64, "hidden_size": 128,
                 "num_layers": 2, "num_attention_heads": 4, "lr_warmup_iters": DemoWarmupIters(),
                 "log_interval": 1}
LEGACY_ALIASES = {"train_iters": "--steps", "seq_length": "--seq-len", "hidden_size": "--hidden",
                  "num_layers": "--layers", "num_attention_heads": "--heads", "lr_warmup_iters": "--warmup-steps",
                  "ddp_bucket_size": "--bucket-size"}
NOOP_VALUES = {"--attention-dropout": "0", "--hidden-dropout": "0",  # the model has no dropout
               "--attention-backend": "auto",  # torch's scaled_dot_product_attention picks its kernel
               "--eval-iters": "0"}
UNSUPPORTED_REASONS = {  # megatron_opt.megatron.arguments.UNSUPPORTED_FLAGS' features, as this script lacks them
    "data": "the script trains on its built-in character-level dataset; there is no data or tokenizer to configure",
    "model": "the model is this script's own GPT (learned positions, LayerNorm, GELU MLP, multi-head attention, "
             "no dropout)",
    "logging": "this logging option is not implemented (supported: --log-interval, --log-throughput, "
               "--log-num-zeros-in-grad, --log-timers-to-tensorboard, --log-json, --tensorboard-dir, "
               "--tensorboard-log-interval)",
    "overlap_param_gather_with_optimizer_step":
        "it overlaps the first model chunk's all-gather with the other chunks' update, and this script builds one "
        "model chunk (Megatron-LM also requires virtual pipeline chunks); megatron_opt's API supports it "
        "(OptimizerConfig.overlap_param_gather_with_optimizer_step, docs/usage.md)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    megatron_args.add_megatron_args(parser, defaults=DEMO_DEFAULTS, aliases=LEGACY_ALIASES)
    own = parser.add_argument_group("this script's own")
    own.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                     help="auto: one GPU per local rank when there are enough GPUs (NCCL), else CPU (gloo)")
    own.add_argument("--log-json", default=None, metavar="FILE",
                     help="append one JSON line per iteration (rank 0): the exact values")
    own.add_argument("--watchdog-multiple", type=float, default=20.0,
                     help="exit (code 3) when a step runs longer than this many median step times and "
                          "--watchdog-min-seconds; 0 disables the watchdog (default 20)")
    own.add_argument("--watchdog-min-seconds", type=float, default=60.0,
                     help="never fire before a step has run this long (default 60)")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Every error exits with code 2 before any process group exists (WORLD_SIZE: torchrun's)."""
    parser = build_parser()
    args = megatron_args.parse_megatron_args(argv, parser=parser, unsupported_reasons=UNSUPPORTED_REASONS,
                                             noop_values=NOOP_VALUES)
    if not (math.isfinite(args.watchdog_multiple) and args.watchdog_multiple >= 0):
        parser.error(f"--watchdog-multiple must be a finite number >= 0 (0 disables the watchdog), "
                     f"got {args.watchdog_multiple:g}")
    if not (math.isfinite(args.watchdog_min_seconds) and args.watchdog_min_seconds > 0):
        parser.error(f"--watchdog-min-seconds must be a positive number of seconds, got {args.watchdog_min_seconds:g}")
    return args


# ----------------------------------------------------------------------------- data
STDLIB_MODULES = ("collections", "functools", "itertools", "json", "os", "pathlib", "re", "string",
                  "textwrap", "typing", "argparse", "logging", "dataclasses", "statistics", "heapq")


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

    def __init__(self, hidden: int, heads: int, ffn_hidden: int) -> None:
        super().__init__()
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
    """Megatron-LM's GPT from its network-size flags (no dropout): learned absolute positions, blocks,
    a final LayerNorm and the output layer, tied to the input embedding unless
    --untie-embeddings-and-output-weights. Weights ~ N(0, --init-method-std), each block's output
    projections N(0, std / sqrt(2 layers)), biases zero, as Megatron-LM initialises them."""

    def __init__(self, vocab: int, args: argparse.Namespace) -> None:
        super().__init__()
        hidden, layers = args.hidden_size, args.num_layers
        self.tok = torch.nn.Embedding(vocab, hidden)
        self.pos = torch.nn.Embedding(args.max_position_embeddings or args.seq_length, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden, args.num_attention_heads, ffn_hidden_size(args))
                                          for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(hidden)
        tied = not args.untie_embeddings_and_output_weights
        self.head = None if tied else torch.nn.Linear(hidden, vocab, bias=False)
        # What --decoupled-lr applies to (megatron-core marks the same params).
        self.tok.weight.is_embedding_or_output_parameter = True
        if self.head is not None:
            self.head.weight.is_embedding_or_output_parameter = True
        for name, p in self.named_parameters():
            if p.ndim > 1:
                scaled = name.endswith(("proj.weight", "fc2.weight"))
                torch.nn.init.normal_(p, std=args.init_method_std / (math.sqrt(2 * layers) if scaled else 1))
            elif name.endswith(".bias"):
                torch.nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return F.linear(x, self.tok.weight) if self.head is None else self.head(x)


def ffn_hidden_size(args: argparse.Namespace) -> int:
    return args.ffn_hidden_size or 4 * args.hidden_size


def gpt_loss(model: torch.nn.Module, batch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token cross-entropies, supervised token count): Megatron's per-token loss form."""
    tokens, labels = batch
    logits = model(tokens)
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return loss, (labels != -100).sum()


def gpt_mean_loss(model: torch.nn.Module, batch: tuple) -> tuple[torch.Tensor]:
    loss_sum, count = gpt_loss(model, batch)
    return (loss_sum / count.clamp(min=1),)


def model_flops_per_iteration(args: argparse.Namespace, vocab: int) -> float:
    """Training FLOPs of one iteration: 3 x the forward pass (2 per multiply-add) of every matmul,
    attention scores and values included, over the global batch."""
    h, layers, s = args.hidden_size, args.num_layers, args.seq_length
    per_token = layers * (4 * h * h + 2 * h * ffn_hidden_size(args)) + h * vocab
    forward = args.global_batch_size * (2 * s * per_token + layers * 4 * s * s * h)
    return 3.0 * forward


# ----------------------------------------------------------------------------- logging
class TensorboardLog:
    """Megatron-LM's training_log scalars, written by the last rank (as Megatron-LM does)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from torch.utils.tensorboard import SummaryWriter  # checked by parse_args

        self.args = args
        self.writer = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=1000)
        for key, value in sorted(vars(args).items()):
            self.writer.add_text(key, str(value), global_step=0)

    def log(self, iteration: int, consumed: int, result: mo.TrainStepResult, skipped_samples: int,
            iteration_time: float, tflops: float) -> None:
        if iteration % self.args.tensorboard_log_interval:
            return
        scalars = {"learning-rate": result.lr, "batch-size": self.args.global_batch_size, "lm loss": result.loss,
                   "loss-scale": result.loss_scale, "grad-norm": result.grad_norm, "num-zeros": result.num_zeros}
        if skipped_samples > 0:
            self.writer.add_scalar("skipped-train-samples", skipped_samples, iteration)
        for tag, value in scalars.items():
            if value is not None:
                self.writer.add_scalar(tag, value, iteration)
                self.writer.add_scalar(f"{tag} vs samples", value, consumed)
        if self.args.log_timers_to_tensorboard:
            self.writer.add_scalar("iteration-time", iteration_time, iteration)
            if self.args.log_throughput:
                self.writer.add_scalar("throughput", tflops, iteration)

    def close(self) -> None:
        self.writer.close()


def log_line(step: int, args: argparse.Namespace, result: mo.TrainStepResult, interval_losses: list[float],
             interval_time: float, elapsed: float, flops: float, world: int) -> str:
    """Rank 0's text log: Megatron-LM's interval average of the loss (over the steps that updated);
    the rest is this step's."""
    loss = sum(interval_losses) / len(interval_losses) if interval_losses else result.loss
    per_iteration = interval_time / args.log_interval
    norm = f"{result.grad_norm:.3f}" if result.grad_norm is not None else "skipped"
    tokens = result.num_tokens if args.loss_mode == "per_token" else args.global_batch_size * args.seq_length
    zeros = f" | num zeros {result.num_zeros}" if result.num_zeros is not None else ""
    throughput = f" | TFLOP/s/rank {flops / per_iteration / world / 1e12:.3f}" if args.log_throughput else ""
    return (f"step {step:4d} | loss {loss:.4f} | grad norm {norm} | loss scale {result.loss_scale:g} "
            f"| lr {result.lr:.3e} | skipped {result.skipped_steps}{zeros} | tokens/s {tokens / elapsed:,.0f} "
            f"| ms/iteration {per_iteration * 1000:.1f}{throughput}")


def json_record(step: int, consumed_samples: int, result: mo.TrainStepResult) -> str:
    return json.dumps({
        "iteration": step, "consumed_samples": consumed_samples, "lm loss": result.loss,
        "grad_norm": result.grad_norm, "num_zeros": result.num_zeros, "loss_scale": result.loss_scale,
        "learning_rate": result.lr, "success": result.success, "skip_reason": result.skip_reason,
        "skipped_iterations": result.skipped_steps, "num_tokens": result.num_tokens}) + "\n"


def use_cuda(choice: str) -> bool:
    """One GPU per local rank: NCCL cannot run two ranks on one GPU."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    enough = torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks
    if choice == "cuda" and not enough:
        raise SystemExit(f"pretrain_gpt.py: --device cuda needs one GPU per local rank: {local_ranks} local ranks, "
                         f"{torch.cuda.device_count()} GPUs visible. Lower --nproc_per_node or use --device cpu.")
    return choice == "cuda" or (choice == "auto" and enough)


def intra_op_threads() -> tuple[int, str]:
    """One intra-op thread per rank unless OMP_NUM_THREADS says otherwise (torch already took the
    user's setting from it): (threads, where the number came from). More threads per rank than cores
    per rank oversubscribes the machine, and on a busy one that is many times slower."""
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return torch.get_num_threads(), "OMP_NUM_THREADS"
    torch.set_num_threads(1)
    return torch.get_num_threads(), "default"


NAN_STOP_EXIT_CODE = 4


def diverged(result: mo.TrainStepResult) -> bool:
    """A non-finite loss, or non-finite gradients that no loss scaler will back off from (bf16, fp32,
    a constant fp16 scale). An fp16 step the dynamic scaler skipped ("overflow") with a finite loss
    is the scaler's normal backoff, not divergence."""
    return not math.isfinite(result.loss) or result.skip_reason == "non-finite"


def stop_on_nan(rank: int, step: int, result: mo.TrainStepResult, checkpointer, json_log, tensorboard) -> None:
    """Megatron-LM's --check-for-nan-in-loss-and-grad: stop (no checkpoint of the diverged state)."""
    what = (f"lm loss is {result.loss}" if not math.isfinite(result.loss)
            else f"the gradients are non-finite (lm loss {result.loss:.4f}); the step was skipped")
    if rank == 0:
        print(f"pretrain_gpt.py: stopping at iteration {step}: {what} (--check-for-nan-in-loss-and-grad, "
              f"on by default): the run diverged; lower --lr or raise --lr-warmup-iters "
              f"(--no-check-for-nan-in-loss-and-grad trains on). Exiting with code {NAN_STOP_EXIT_CODE}.",
              file=sys.stderr, flush=True)
    checkpointer.close()  # a background save of an earlier, finite iteration completes
    for log in (json_log, tensorboard):
        if log is not None:
            log.close()
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(NAN_STOP_EXIT_CODE)


# ----------------------------------------------------------------------------- main
def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    cuda = use_cuda(args.device)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo",
                            timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    rank, world = dist.get_rank(), dist.get_world_size()
    watchdog = StepWatchdog(rank, args.watchdog_multiple, args.watchdog_min_seconds)
    device = torch.device("cuda") if cuda else torch.device("cpu")
    if rank != 0:  # every rank makes the same skip decision; let rank 0 report it
        logging.getLogger("megatron_opt").setLevel(logging.ERROR)
    threads, threads_from = intra_op_threads()

    dataset = CharDataset(build_corpus(), args.seq_length, seed=args.seed + rank)  # each rank its own data
    torch.manual_seed(args.seed)
    dtype = megatron_args.params_dtype_from_args(args)
    model = GPT(len(dataset.vocab), args).to(device, dtype)
    ddp = mo.DistributedDataParallel(model, megatron_args.ddp_config_from_args(args))
    ddp.broadcast_params()
    optimizer = mo.get_megatron_optimizer(megatron_args.optimizer_config_from_args(args), ddp)
    scheduler = megatron_args.scheduler_from_args(optimizer, args)
    loss_fn = gpt_loss if args.loss_mode == "per_token" else gpt_mean_loss
    gbs = args.global_batch_size
    start_iteration = consumed_samples = 0
    checkpointer = mo.checkpoint.Checkpointer()  # holds a background save (--async-save) in flight
    if args.load is not None and mo.checkpoint.latest_iteration(args.load) is not None:
        state = checkpointer.load(args.load, ddp, optimizer, scheduler, load_optimizer=not args.no_load_optim,
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
        checkpointer.save(args.save, ddp, optimizer, scheduler, iteration=iteration, consumed_samples=consumed_samples,
                          rank_extra={"data": dataset.gen.get_state()}, keep_latest_k=args.keep_latest_k,
                          async_save=args.async_save)
        if rank == 0:
            print(f"saved iteration {iteration} to {args.save}{' (in the background)' if args.async_save else ''}",
                  flush=True)

    tensorboard = TensorboardLog(args) if args.tensorboard_dir is not None and rank == world - 1 else None
    json_log = open(args.log_json, "a") if args.log_json is not None and rank == 0 else None
    flops = model_flops_per_iteration(args, len(dataset.vocab))
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", 1))  # torchrun's launcher (node) count
        print(f"megatron_opt pretrain_gpt: {n_params / 1e6:.2f}M params, DP={world}, "
              f"{nodes} node{'s' if nodes > 1 else ''}, device={device}, dtype={dtype}, "
              f"ops backend={mo.ops.backend_for(next(model.parameters()))}, "
              f"{'distributed' if args.use_distributed_optimizer else 'non-distributed'} optimizer, "
              f"loss mode={args.loss_mode}, global batch {gbs} = {args.micro_batch_size} x {args.num_microbatches} "
              f"micro-batches x DP {world}, {args.train_iters} iterations, "
              f"{threads} intra-op thread{'s' if threads > 1 else ''} per rank ({threads_from})", flush=True)
        if args.loss_scale is not None and not (args.fp16 or args.bf16):
            print("note: --loss-scale has no effect without --fp16 or --bf16 (as in Megatron-LM)", flush=True)
    first_loss = last_loss = None
    non_finite: list[int] = []  # iterations whose loss or gradients were non-finite (not fp16 backoffs)
    skipped_samples = 0
    interval_losses: list[float] = []
    interval_time = 0.0
    for step in range(start_iteration + 1, args.train_iters + 1):
        batches = [tuple(t.to(device) for t in dataset.microbatch(args.micro_batch_size))
                   for _ in range(args.num_microbatches)]
        with watchdog.step(step):  # checkpoint saves are not watched (the collective timeout covers them)
            start = time.perf_counter()
            result = mo.train_step(ddp, optimizer, scheduler, batches, loss_fn, loss_mode=args.loss_mode,
                                   samples_per_step=gbs)
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
        consumed_samples += gbs
        skipped_samples += 0 if result.success else gbs
        first_loss = result.loss if first_loss is None else first_loss
        last_loss = result.loss if result.success else last_loss
        if result.success:
            interval_losses.append(result.loss)
        interval_time += elapsed
        if json_log is not None:
            json_log.write(json_record(step, consumed_samples, result))
            json_log.flush()
        if tensorboard is not None:
            tensorboard.log(step, consumed_samples, result, skipped_samples, elapsed, flops / elapsed / world / 1e12)
        if rank == 0 and step % args.log_interval == 0:
            print(log_line(step, args, result, interval_losses, interval_time, elapsed, flops, world), flush=True)
        if step % args.log_interval == 0:
            interval_losses, interval_time = [], 0.0
        if diverged(result):
            non_finite.append(step)
            if args.check_for_nan_in_loss_and_grad:  # every rank has the same loss and skip decision
                stop_on_nan(rank, step, result, checkpointer, json_log, tensorboard)
        exiting = args.exit_interval is not None and step % args.exit_interval == 0
        if args.save is not None:
            checkpointer.check_pending_save()  # a failed background save stops every rank here
            if (args.save_interval and step % args.save_interval == 0) or step == args.train_iters or exiting:
                save(step)
        if exiting:
            break
    checkpointer.close()  # waits for a background save
    if json_log is not None:
        json_log.close()
    if tensorboard is not None:
        tensorboard.close()
    if rank == 0 and first_loss is not None:
        # a run that went non-finite (--no-check-for-nan-in-loss-and-grad) says so on its last line
        diverged_note = (f"; {len(non_finite)} iteration{'s' if len(non_finite) > 1 else ''} had a non-finite loss "
                         f"or gradients (first {non_finite[0]}, last {non_finite[-1]}), the last loss "
                         f"{result.loss:.4f}" if non_finite else "")
        print(f"done: loss {first_loss:.4f} -> {f'{last_loss:.4f}' if last_loss is not None else 'none'}"
              f"{diverged_note}", flush=True)
    dist.barrier()  # leave together: a rank tearing gloo down while a peer still talks to it can abort
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
