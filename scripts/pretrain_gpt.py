"""Pretrain a small GPT with megatron_opt under torchrun: CPU/gloo without a GPU, CUDA/NCCL with one.

    torchrun --standalone --nproc_per_node=2 scripts/pretrain_gpt.py
    torchrun --standalone --nproc_per_node=2 scripts/pretrain_gpt.py --train-iters 30 --save ckpt --save-interval 10
    torchrun --standalone --nproc_per_node=3 scripts/pretrain_gpt.py --train-iters 40 --load ckpt --save ckpt  # DP 2 -> 3
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT scripts/pretrain_gpt.py ...

Flags: Megatron-LM's, with Megatron-LM's meaning (megatron_opt.megatron.arguments, docs/usage.md), so
the optimizer, schedule, precision, batch, logging and checkpoint block of a Megatron-LM launch script
runs with only the entry point changed. Model parallelism (--tensor-model-parallel-size, --sequence-parallel,
--pipeline-model-parallel-size, --num-layers-per-virtual-pipeline-stage, --expert-model-parallel-size with
--num-experts) trains megatron-core's GPTModel through its schedule (scripts/pretrain_model_parallel.py).
Megatron-LM's data, tokenizer and evaluation blocks run through megatron-core's data code
(scripts/pretrain_data.py, pretrain_eval.py; docs/pretrain.md). Flags for what megatron_opt or this
script does not have (fp8, other model architectures, ...: "not supported yet: <reason>") and unknown flags ("unknown flag --x; did you mean --y?") are all
named in one error (exit code 2; torchrun itself then exits 1), printed by rank 0 without the usage
text, before any process group exists; no-op values (--attention-dropout 0, ...) are accepted.

Defaults are Megatron-LM's, except where it has none or a run with no flags should stay a short demo
(DEMO_DEFAULTS): --lr 3e-3, --train-iters 30, --micro-batch-size 4, --seq-length 64, --hidden-size 128,
--num-layers 2, --num-attention-heads 4, --lr-warmup-iters a sixth of --train-iters (5 at 30, 0 at 5;
Megatron-LM: 0), --log-interval 1 (Megatron-LM: 100), --eval-iters 10 (Megatron-LM: 100).
This script's older flags are aliases (LEGACY_ALIASES): --steps, --seq-len, --hidden, --layers, --heads,
--warmup-steps, --bucket-size; with megatron_opt's --num-microbatches N and --loss-mode per_token|mean.

The model is Megatron-LM's default GPT without dropout: learned absolute positions, pre-LayerNorm
blocks with multi-head causal attention and a GELU MLP, biases, and an output layer tied to the input
embedding (scripts/pretrain_model.py). Without a data flag the data is character-level text from the
docstrings of Python's standard library (nothing is downloaded), cut into documents of random length
and padded with ignored labels, so micro-batches carry different numbers of supervised tokens and the
per-token loss normalisation matters. Every --log-interval iterations rank 0 prints Megatron-LM's log
line (scripts/pretrain_logging.py), and validation lines at --eval-interval and after training;
--log-json FILE appends the exact values of every iteration.

Checkpoints (megatron_opt.checkpoint): --save DIR every --save-interval iterations and at the end;
--load DIR resumes model, optimizer, schedule, loss scale, iteration, RNG and data position (at any
data-parallel size, and with model parallelism at any TP/PP layout; RNG, and the built-in corpus'
position, only at the same size); --exit-interval N saves and exits. --load and --save never lose a
run (scripts/pretrain_resume.py): a missing --load is said, a --save over newer iterations is refused,
a changed schedule or batch is warned about.

Divergence: as Megatron-LM (--check-for-nan-in-loss-and-grad, on by default), a non-finite loss, or
non-finite gradients outside the fp16 dynamic scaler's backoff, stops every rank (exit code 4, a
message on stderr, no checkpoint of that state); --no-check-for-nan-in-loss-and-grad trains on, and
the final "done" line then counts the non-finite iterations. Threads: one intra-op thread per rank
unless OMP_NUM_THREADS is set (the header line says which).

Hangs: every collective gives up after --distributed-timeout-minutes (default 10), and a watchdog ends
a rank whose iteration (all of it but evaluation and saves) runs longer than max(--watchdog-min-seconds,
--watchdog-multiple x the median iteration time) (exit code 3, with a message on stderr;
--watchdog-multiple 0 turns it off).
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import sys
import time
import warnings
from typing import Optional, Sequence

import torch
import torch.distributed as dist

import megatron_opt as mo
import megatron_opt.checkpoint  # noqa: F401  (mo.checkpoint)
from megatron_opt.megatron import arguments as megatron_args
# this script's modules, next to it in scripts/
import pretrain_data
import pretrain_eval
import pretrain_logging
import pretrain_model_parallel
import pretrain_resume
from pretrain_model import GPT, gpt_loss, gpt_mean_loss, model_flops_per_iteration
from step_watchdog import StepWatchdog

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
DEMO_EVAL_ITERS = 10  # Megatron-LM: 100 (a validation after training stays short in the demo)
LEGACY_ALIASES = {"train_iters": "--steps", "seq_length": "--seq-len", "hidden_size": "--hidden",
                  "num_layers": "--layers", "num_attention_heads": "--heads", "lr_warmup_iters": "--warmup-steps",
                  "ddp_bucket_size": "--bucket-size"}
NOOP_VALUES = {"--attention-dropout": "0", "--hidden-dropout": "0",  # the model has no dropout
               "--attention-backend": "auto"}  # torch's scaled_dot_product_attention picks its kernel
UNSUPPORTED_REASONS = {  # megatron_opt.megatron.arguments.UNSUPPORTED_FLAGS' features, as this script lacks them
    "data": "this data or tokenizer option is not implemented (supported: --data-path --split --mock-data "
            "--data-cache-path --no-mmap-bin-files --eod-mask-loss --num-dataset-builder-threads --num-workers "
            "--tokenizer-type GPT2BPETokenizer|HuggingFaceTokenizer|NullTokenizer --vocab-file --merge-file "
            "--tokenizer-model --vocab-size --make-vocab-size-divisible-by)",
    "model": "the model is this script's own GPT (learned positions, LayerNorm, GELU MLP, multi-head attention, "
             "no dropout)",
    "evaluation": "this evaluation option is not implemented (supported: --eval-interval --eval-iters --skip-train)",
    "logging": "this logging option is not implemented (supported: --log-interval, --log-throughput, "
               "--log-num-zeros-in-grad, --log-params-norm, --log-memory-to-tensorboard, "
               "--log-world-size-to-tensorboard, --log-validation-ppl-to-tensorboard, --log-timers-to-tensorboard, "
               "--timing-log-level, --timing-log-option, --no-log-loss-scale-to-tensorboard, --log-json, "
               "--tensorboard-dir, --tensorboard-log-interval)",
    "overlap_param_gather_with_optimizer_step":
        "it overlaps the first model chunk's all-gather with the other chunks' update, and this script builds one "
        "model chunk (Megatron-LM also requires virtual pipeline chunks); megatron_opt's API supports it "
        "(OptimizerConfig.overlap_param_gather_with_optimizer_step, docs/usage.md)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    megatron_args.add_megatron_args(parser, defaults=DEMO_DEFAULTS, aliases=LEGACY_ALIASES)
    pretrain_data.add_data_args(parser)
    pretrain_eval.add_eval_args(parser, DEMO_EVAL_ITERS)
    pretrain_logging.add_logging_args(parser)
    pretrain_resume.add_checkpoint_args(parser)
    pretrain_model_parallel.add_args(parser)
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
    for check in (pretrain_data.check_data_args, pretrain_eval.check_eval_args, pretrain_resume.find_load,
                  pretrain_resume.check_save, pretrain_model_parallel.check_args):
        problem = check(args)
        if problem:
            parser.error(problem)
    if args.skip_train and args.load_iteration is None:
        parser.error("--skip-train evaluates a loaded model: give --load with a checkpoint")
    return args


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



# ----------------------------------------------------------------------------- the run
class Job:
    """One rank's run: the model, optimizer, schedule, data, checkpoints, logs and counters."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cuda = use_cuda(args.device)
        if self.cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if self.cuda else "gloo",
                                timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda") if self.cuda else torch.device("cpu")
        library_log = logging.getLogger("megatron_opt")
        library_log.addFilter(pretrain_logging.DropSkipWarnings())  # the log line counts skipped steps
        if self.rank != 0:  # every rank makes the same decisions; let rank 0 report them
            library_log.setLevel(logging.ERROR)
        self.threads = intra_op_threads()
        self.build()
        self.timers = pretrain_logging.PhaseTimers(args.timing_log_level, self.cuda)
        self.timers.instrument(self.ddp, self.optimizer)
        self.loss_fn = self.timers.wrap(gpt_loss if args.loss_mode == "per_token" else gpt_mean_loss,
                                        "forward-compute", level=2)
        self.checkpointer = mo.checkpoint.Checkpointer()  # holds a background save (--async-save) in flight
        self.iteration = self.consumed = self.skipped_samples = 0
        self.consumed_valid = 0
        self.tensorboard: Optional[pretrain_logging.TensorboardLog] = None
        self.json_log = None
        self.losses = Losses()

    def build(self) -> None:
        """The data, model, DDP, optimizer and schedule (pretrain_model_parallel's Job builds megatron-core's)."""
        args = self.args
        self.source = pretrain_data.build_source(args, self.rank, self.world)
        torch.manual_seed(args.seed)
        self.dtype = megatron_args.params_dtype_from_args(args)
        self.model = GPT(self.source.vocab_size, args).to(self.device, self.dtype)
        self.ddp = mo.DistributedDataParallel(self.model, megatron_args.ddp_config_from_args(args))
        self.ddp.broadcast_params()
        self.optimizer = mo.get_megatron_optimizer(megatron_args.optimizer_config_from_args(args), self.ddp)
        self.scheduler = megatron_args.scheduler_from_args(self.optimizer, args)

    def train_step(self, batches: list) -> mo.TrainStepResult:
        return mo.train_step(self.ddp, self.optimizer, self.scheduler, batches, self.loss_fn,
                             loss_mode=self.args.loss_mode, samples_per_step=self.args.global_batch_size)

    def say(self, *lines: str, err: bool = False) -> None:
        pretrain_logging.print_rank0(self.rank, *lines, err=err)

    # ------------------------------------------------------------------------- checkpoints
    def model_chunks(self) -> list:
        """The DDP-wrapped model chunks as the optimizer sees them (what megatron_opt.checkpoint saves)."""
        return [self.ddp]

    def layout(self) -> str:
        """The parallel layout, as a resume names the saved and the current one."""
        return f"DP={self.world}"

    def data_extra(self) -> dict:
        """Run-wide checkpoint extras for the data position (none here: each rank's own position is its
        rank_extra, which comes back at the same world size, i.e. the same data-parallel size)."""
        return {}

    def resume_data(self, state: mo.checkpoint.LoadResult) -> None:
        self.source.resume(state.rank_extra, state.iteration)

    def resume(self) -> None:
        args = self.args
        if args.load_iteration is None:
            if args.load is not None:
                self.say(f"pretrain_gpt.py: --load {args.load}: no checkpoint ({args.load_note}); training from scratch")
            return
        has_optimizer = mo.checkpoint.read_info(args.load).has_optimizer
        if not has_optimizer and not args.no_load_optim:
            self.say(f"note: {args.load} has no optimizer state (saved with --no-save-optim): loading the model and "
                     f"schedule, the optimizer starts fresh")
        command_line = pretrain_resume.schedule_values(self.scheduler)
        state = self.checkpointer.load(args.load, self.model_chunks(), self.optimizer, self.scheduler,
                                       load_optimizer=has_optimizer and not args.no_load_optim,
                                       load_rng=not args.no_load_rng)
        self.iteration, self.consumed = state.iteration, state.consumed_samples
        self.resume_data(state)
        saved_layout = state.extra.get("layout", f"DP={state.saved_data_parallel_size}")
        self.say(f"resumed from iteration {state.iteration} (saved at {saved_layout}, now {self.layout()}) "
                 f"from {state.path}",
                 *pretrain_resume.resume_warnings(args, state.extra, self.scheduler, command_line))

    def save(self) -> None:
        args = self.args
        self.checkpointer.save(
            args.save, self.model_chunks(), None if args.no_save_optim else self.optimizer, self.scheduler,
            iteration=self.iteration, consumed_samples=self.consumed, rank_extra=self.source.rank_state(),
            extra={"global_batch_size": args.global_batch_size, "layout": self.layout(),
                   "schedule": pretrain_resume.schedule_values(self.scheduler), **self.data_extra()},
            keep_latest_k=args.keep_latest_k, async_save=args.async_save, save_rng=not args.no_save_rng)
        self.say(f"saved iteration {self.iteration} to {args.save}{' (in the background)' if args.async_save else ''}")

    # ------------------------------------------------------------------------- evaluation
    def evaluate(self, split: str, prefix: str, to_tensorboard: bool) -> None:
        args = self.args
        consumed = self.consumed_valid if split == "valid" else 0
        if args.overlap_param_gather:  # the forward pre-hooks gather params only inside a step: sync them now
            self.ddp.disable_forward_pre_hook()
        loss = pretrain_eval.evaluate(self.ddp, self.source, split, consumed, args, gpt_loss, self.device)
        if args.overlap_param_gather:
            self.ddp.enable_forward_pre_hook()
        if split == "valid":
            self.consumed_valid += args.eval_iters * args.global_batch_size
            if to_tensorboard and self.tensorboard is not None:
                self.tensorboard.log_validation(loss, self.iteration, self.consumed)
        self.say(*pretrain_eval.result_lines(prefix, loss))

    # ------------------------------------------------------------------------- logs
    def open_logs(self) -> None:
        args = self.args
        if args.tensorboard_dir is not None and self.rank == self.world - 1:
            self.tensorboard = pretrain_logging.TensorboardLog(args, self.iteration, self.consumed)
        if args.log_json is not None and self.rank == 0:
            self.json_log = open(args.log_json, "a")

    def close_logs(self) -> None:
        for log in (self.json_log, self.tensorboard):
            if log is not None:
                log.close()

    def header(self) -> None:
        args = self.args
        n_params = sum(p.numel() for p in self.model.parameters())
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", 1))  # torchrun's launcher (node) count
        threads, threads_from = self.threads
        self.say(f"megatron_opt pretrain_gpt: {n_params / 1e6:.2f}M params, DP={self.world}, "
                 f"{nodes} node{'s' if nodes > 1 else ''}, device={self.device}, dtype={self.dtype}, "
                 f"ops backend={mo.ops.backend_for(next(self.model.parameters()))}, "
                 f"{'distributed' if args.use_distributed_optimizer else 'non-distributed'} optimizer, "
                 f"loss mode={args.loss_mode}, global batch {args.global_batch_size} = {args.micro_batch_size} x "
                 f"{args.num_microbatches} micro-batches x DP {self.world}, {args.train_iters} iterations, "
                 f"{threads} intra-op thread{'s' if threads > 1 else ''} per rank ({threads_from})",
                 f"data: {self.source.description}")
        if args.data_split_defaulted:
            self.say(f"warning: --data-path without --split: using Megatron-LM's legacy default "
                     f"{pretrain_data.LEGACY_DEFAULT_SPLIT!r}")
        if self.tensorboard is not None and self.tensorboard.dropped:
            print(f"tensorboard: dropped {self.tensorboard.dropped} points past iteration {self.iteration} that a "
                  f"run before this resume had written", flush=True)
        if args.loss_scale is not None and not (args.fp16 or args.bf16):
            self.say("note: --loss-scale has no effect without --fp16 or --bf16 (as in Megatron-LM)")

    def log_interval(self, interval: pretrain_logging.Interval, result: mo.TrainStepResult, flops: float,
                     norm: Optional[float]) -> None:
        """Megatron-LM's log line (rank 0), its timers and TensorBoard's interval scalars; every rank."""
        args = self.args
        memory = torch.tensor(pretrain_logging.memory_now(self.device)[:2], dtype=torch.float64, device=self.device)
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)
        timers_text, timers_ms = self.timers.report(args.log_interval, args.timing_log_option)
        per_iteration = interval.seconds / max(interval.iterations, 1)
        tflops = flops / per_iteration / self.world / 1e12 if args.log_throughput and per_iteration > 0 else None
        peak = pretrain_logging.peak_tflops(self.device, self.dtype)
        mfu = tflops / peak if tflops is not None and peak else None
        line = pretrain_logging.log_line(self.iteration, args, interval, self.consumed, self.skipped_samples, result,
                                         tflops, mfu, norm, tuple(memory.tolist()), self.cuda)
        self.say(line, *([timers_text] if timers_text else []))
        summary = pretrain_logging.skip_summary(self.iteration, interval, result.loss_scale)
        if summary:
            self.say(summary, err=True)
        if self.tensorboard is not None:
            self.tensorboard.log_interval(self.iteration, per_iteration, tflops, timers_ms)

    # ------------------------------------------------------------------------- training
    def train(self) -> bool:
        """The training loop; True when --exit-interval or a signal stopped it early."""
        args = self.args
        watchdog = StepWatchdog(self.rank, args.watchdog_multiple, args.watchdog_min_seconds)
        signals = pretrain_resume.SignalExit(args.exit_signal_handler, self.device)
        flops = model_flops_per_iteration(args, self.source.vocab_size)
        interval = pretrain_logging.Interval()
        do_valid = args.eval_iters > 0 and self.source.has_valid
        for step in range(self.iteration + 1, args.train_iters + 1):
            # The whole iteration is watched, not only train_step: a stopped peer can leave this rank in any
            # of its collectives (the log line's memory all-reduce, the signal check).
            with watchdog.step(step):
                if self.train_iteration(step, watchdog, signals, flops, interval, do_valid):
                    return True
        return False

    def train_iteration(self, step: int, watchdog: StepWatchdog, signals: pretrain_resume.SignalExit, flops: float,
                        interval: pretrain_logging.Interval, do_valid: bool) -> bool:
        """One iteration of train(): step, log, evaluate, save; True when the run should stop after it."""
        args, timers = self.args, self.timers
        with timers.time("batch-generator", level=2):
            batches = [tuple(t.to(self.device) for t in batch)
                       for batch in self.source.train_batches(self.consumed, args.num_microbatches)]
        sync_before = timers.totals["all-grads-sync"]
        start = time.perf_counter()
        result = self.train_step(batches)
        if self.cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        timers.close_step(elapsed, sync_before)
        self.iteration = step
        self.consumed += args.global_batch_size
        self.skipped_samples += 0 if result.success else args.global_batch_size
        self.losses.add(step, result)
        interval.add(result.loss, result.success, not math.isfinite(result.loss), result.skip_reason, elapsed)
        norm = pretrain_logging.params_norm(self.model) if args.log_params_norm else None
        if self.json_log is not None:
            self.json_log.write(json_record(step, self.consumed, result))
            self.json_log.flush()
        if self.tensorboard is not None:
            memory = pretrain_logging.memory_now(self.device) if args.log_memory_to_tensorboard else (0.0,) * 4
            self.tensorboard.log(step, self.consumed, result, self.skipped_samples, norm, memory, self.world)
        if step % args.log_interval == 0:
            self.log_interval(interval, result, flops, norm)
            interval.reset()
        if diverged(result):
            if args.check_for_nan_in_loss_and_grad:  # every rank has the same loss and skip decision
                stop_on_nan(self.rank, step, result, self.checkpointer, self.json_log, self.tensorboard)
        if do_valid and step % args.eval_interval == 0:
            # Evaluation and saves take their own time, unrelated to a step's; the collective timeout covers them.
            with watchdog.unwatched():
                self.evaluate("valid", f"iteration {step}", to_tensorboard=True)
        exiting = args.exit_interval is not None and step % args.exit_interval == 0
        signalled = signals.agreed()
        if args.save is not None:
            self.checkpointer.check_pending_save()  # a failed background save stops every rank here
            if (args.save_interval and step % args.save_interval == 0) or step == args.train_iters or exiting \
                    or signalled:
                with watchdog.unwatched():
                    self.save()
        if signalled:
            self.say(f"exiting after iteration {step}: received SIGTERM (--exit-signal-handler)")
            return True
        if exiting:
            return True
        return False


def json_record(step: int, consumed_samples: int, result: mo.TrainStepResult) -> str:
    return json.dumps({
        "iteration": step, "consumed_samples": consumed_samples, "lm loss": result.loss,
        "grad_norm": result.grad_norm, "num_zeros": result.num_zeros, "loss_scale": result.loss_scale,
        "learning_rate": result.lr, "success": result.success, "skip_reason": result.skip_reason,
        "skipped_iterations": result.skipped_steps, "num_tokens": result.num_tokens}) + "\n"


class Losses:
    """For the last line: the first loss, the last one that updated, the last one, and the iterations
    whose loss or gradients were non-finite (trained on with --no-check-for-nan-in-loss-and-grad)."""

    def __init__(self) -> None:
        self.first: Optional[float] = None
        self.last_updated: Optional[float] = None
        self.last = math.nan
        self.non_finite: list[int] = []

    def add(self, step: int, result: mo.TrainStepResult) -> None:
        self.first = result.loss if self.first is None else self.first
        self.last_updated = result.loss if result.success else self.last_updated
        self.last = result.loss
        if diverged(result):
            self.non_finite.append(step)

    def done_line(self) -> str:
        """So a diverged run never ends looking fine."""
        bad = self.non_finite
        note = (f"; {len(bad)} iteration{'s' if len(bad) > 1 else ''} had a non-finite loss or gradients "
                f"(first {bad[0]}, last {bad[-1]}), the last loss {self.last:.4f}" if bad else "")
        last = f"{self.last_updated:.4f}" if self.last_updated is not None else "none"
        return f"done: loss {self.first:.4f} -> {last}{note}"


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    # model parallelism (or --num-experts, --use-mcore-models): megatron-core's GPTModel and schedule
    job = (pretrain_model_parallel.job_class(Job) if pretrain_model_parallel.wanted(args) else Job)(args)
    job.resume()
    job.consumed_valid = pretrain_eval.consumed_valid_samples(args, job.iteration)
    job.open_logs()
    job.header()
    stopped = False if args.skip_train else job.train()
    do_eval = args.eval_iters > 0 and not stopped
    if do_eval and job.source.has_valid:
        job.evaluate("valid", f"iteration {job.iteration} on validation set", to_tensorboard=not args.skip_train)
    if do_eval and job.source.has_test:
        job.evaluate("test", f"iteration {job.iteration} on test set", to_tensorboard=False)
    job.checkpointer.close()  # waits for a background save
    job.close_logs()
    if job.losses.first is not None:
        job.say(job.losses.done_line())
    dist.barrier()  # leave together: a rank tearing gloo down while a peer still talks to it can abort
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
