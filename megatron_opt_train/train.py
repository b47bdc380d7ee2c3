"""The main job's Trainer: one rank's run (process group, runner, checkpoints, evaluation, logs and the
training loop), and main(), what scripts/pretrain_gpt.py and ``python -m megatron_opt_train`` run.
The model, its DDP chunks, optimizer and schedule come from a runner (runners/), the same loop for
both; the rules, formats and helpers from components/."""
from __future__ import annotations

import argparse
import datetime
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

from .components import data, evaluation, metrics, resume
from .components.model import model_flops_per_iteration
from .components.tensorboard import TensorboardLog
from .components.timers import PhaseTimers
from .components.watchdog import StepWatchdog
from .flags import parse_args
from .runners import Place, build_runner

NAN_STOP_EXIT_CODE = 4


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


class Trainer:
    """One rank's run: the runner (model, optimizer, schedule, data), checkpoints, logs and counters."""

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
        library_log.addFilter(metrics.DropSkipWarnings())  # the log line counts skipped steps
        if self.rank != 0:  # every rank makes the same decisions; let rank 0 report them
            library_log.setLevel(logging.ERROR)
        self.threads = intra_op_threads()
        self.timers = PhaseTimers(args.timing_log_level, self.cuda)
        self.runner = build_runner(args, Place(self.rank, self.world, self.device), self.timers)
        self.checkpointer = mo.checkpoint.Checkpointer()  # holds a background save (--async-save) in flight
        self.iteration = self.consumed = self.skipped_samples = 0
        self.consumed_valid = 0
        self.tensorboard: Optional[TensorboardLog] = None
        self.json_log = None
        self.losses = metrics.Losses()

    def say(self, *lines: str, err: bool = False) -> None:
        metrics.print_rank0(self.rank, *lines, err=err)

    # ------------------------------------------------------------------------- checkpoints
    def resume(self) -> None:
        args, runner = self.args, self.runner
        if args.load_iteration is None:
            if args.load is not None:
                self.say(f"pretrain_gpt.py: --load {args.load}: no checkpoint ({args.load_note}); "
                         f"training from scratch")
            return
        has_optimizer = mo.checkpoint.read_info(args.load).has_optimizer
        if not has_optimizer and not args.no_load_optim:
            self.say(f"note: {args.load} has no optimizer state (saved with --no-save-optim): loading the model and "
                     f"schedule, the optimizer starts fresh")
        command_line = resume.schedule_values(runner.scheduler)
        state = self.checkpointer.load(args.load, list(runner.ddps), runner.optimizer, runner.scheduler,
                                       load_optimizer=has_optimizer and not args.no_load_optim,
                                       load_rng=not args.no_load_rng)
        self.iteration, self.consumed = state.iteration, state.consumed_samples
        runner.resume_data(state)
        saved_layout = state.extra.get("layout", f"DP={state.saved_data_parallel_size}")
        self.say(f"resumed from iteration {state.iteration} (saved at {saved_layout}, now {runner.layout()}) "
                 f"from {state.path}",
                 *resume.resume_warnings(args, state.extra, runner.scheduler, command_line))

    def save(self) -> None:
        args, runner = self.args, self.runner
        self.checkpointer.save(
            args.save, list(runner.ddps), None if args.no_save_optim else runner.optimizer, runner.scheduler,
            iteration=self.iteration, consumed_samples=self.consumed, rank_extra=runner.source.rank_state(),
            extra={"global_batch_size": args.global_batch_size, "layout": runner.layout(),
                   "schedule": resume.schedule_values(runner.scheduler), **runner.data_extra()},
            keep_latest_k=args.keep_latest_k, async_save=args.async_save, save_rng=not args.no_save_rng)
        self.say(f"saved iteration {self.iteration} to {args.save}{' (in the background)' if args.async_save else ''}")

    # ------------------------------------------------------------------------- evaluation
    def evaluate(self, split: str, prefix: str, to_tensorboard: bool) -> None:
        args = self.args
        consumed = self.consumed_valid if split == "valid" else 0
        if args.overlap_param_gather:  # the forward pre-hooks gather params only inside a step: sync them now
            for ddp in self.runner.ddps:
                ddp.disable_forward_pre_hook()
        loss = self.runner.evaluation_loss(split, consumed)
        if args.overlap_param_gather:
            for ddp in self.runner.ddps:
                ddp.enable_forward_pre_hook()
        if split == "valid":
            self.consumed_valid += args.eval_iters * args.global_batch_size
            if to_tensorboard and self.tensorboard is not None:
                self.tensorboard.log_validation(loss, self.iteration, self.consumed)
        self.say(*evaluation.result_lines(prefix, loss))

    # ------------------------------------------------------------------------- logs
    def open_logs(self) -> None:
        args = self.args
        if args.tensorboard_dir is not None and self.rank == self.world - 1:
            self.tensorboard = TensorboardLog(args, self.iteration, self.consumed)
        if args.log_json is not None and self.rank == 0:
            self.json_log = open(args.log_json, "a")

    def close_logs(self) -> None:
        for log in (self.json_log, self.tensorboard):
            if log is not None:
                log.close()

    def header(self) -> None:
        args, runner = self.args, self.runner
        threads, threads_from = self.threads
        self.say(f"megatron_opt pretrain_gpt: {runner.describe()}, "
                 f"{'distributed' if args.use_distributed_optimizer else 'non-distributed'} optimizer, "
                 f"loss mode={args.loss_mode}, global batch {args.global_batch_size} = {args.micro_batch_size} x "
                 f"{args.num_microbatches} micro-batches x DP {runner.data_parallel_size}, {args.train_iters} "
                 f"iterations, {threads} intra-op thread{'s' if threads > 1 else ''} per rank ({threads_from})",
                 f"data: {runner.source.description}")
        if args.data_split_defaulted:
            self.say(f"warning: --data-path without --split: using Megatron-LM's legacy default "
                     f"{data.LEGACY_DEFAULT_SPLIT!r}")
        if self.tensorboard is not None and self.tensorboard.dropped:
            print(f"tensorboard: dropped {self.tensorboard.dropped} points past iteration {self.iteration} that a "
                  f"run before this resume had written", flush=True)
        if args.loss_scale is not None and not (args.fp16 or args.bf16):
            self.say("note: --loss-scale has no effect without --fp16 or --bf16 (as in Megatron-LM)")

    def log_interval(self, interval: metrics.Interval, result: mo.TrainStepResult, flops: float,
                     norm: Optional[float]) -> None:
        """Megatron-LM's log line (rank 0), its timers and TensorBoard's interval scalars; every rank."""
        args = self.args
        memory = torch.tensor(metrics.memory_now(self.device)[:2], dtype=torch.float64, device=self.device)
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)
        timers_text, timers_ms = self.timers.report(args.log_interval, args.timing_log_option)
        per_iteration = interval.seconds / max(interval.iterations, 1)
        tflops = flops / per_iteration / self.world / 1e12 if args.log_throughput and per_iteration > 0 else None
        peak = metrics.peak_tflops(self.device, self.runner.dtype)
        mfu = tflops / peak if tflops is not None and peak else None
        line = metrics.log_line(self.iteration, args, interval, self.consumed, self.skipped_samples, result,
                                tflops, mfu, norm, tuple(memory.tolist()), self.cuda)
        self.say(line, *([timers_text] if timers_text else []))
        summary = metrics.skip_summary(self.iteration, interval, result.loss_scale)
        if summary:
            self.say(summary, err=True)
        if self.tensorboard is not None:
            self.tensorboard.log_interval(self.iteration, per_iteration, tflops, timers_ms)

    def stop_on_nan(self, step: int, result: mo.TrainStepResult) -> None:
        """Megatron-LM's --check-for-nan-in-loss-and-grad: stop (no checkpoint of the diverged state)."""
        what = (f"lm loss is {result.loss}" if not math.isfinite(result.loss)
                else f"the gradients are non-finite (lm loss {result.loss:.4f}); the step was skipped")
        if self.rank == 0:
            print(f"pretrain_gpt.py: stopping at iteration {step}: {what} (--check-for-nan-in-loss-and-grad, "
                  f"on by default): the run diverged; lower --lr or raise --lr-warmup-iters "
                  f"(--no-check-for-nan-in-loss-and-grad trains on). Exiting with code {NAN_STOP_EXIT_CODE}.",
                  file=sys.stderr, flush=True)
        self.checkpointer.close()  # a background save of an earlier, finite iteration completes
        self.close_logs()
        dist.barrier()
        dist.destroy_process_group()
        sys.exit(NAN_STOP_EXIT_CODE)

    # ------------------------------------------------------------------------- training
    def train(self) -> bool:
        """The training loop; True when --exit-interval or a signal stopped it early."""
        args = self.args
        watchdog = StepWatchdog(self.rank, args.watchdog_multiple, args.watchdog_min_seconds)
        signals = resume.SignalExit(args.exit_signal_handler, self.device)
        flops = model_flops_per_iteration(args, self.runner.source.vocab_size)
        interval = metrics.Interval()
        do_valid = args.eval_iters > 0 and self.runner.source.has_valid
        for step in range(self.iteration + 1, args.train_iters + 1):
            # The whole iteration is watched, not only the train step: a stopped peer can leave this rank in
            # any of its collectives (the log line's memory all-reduce, the signal check).
            with watchdog.step(step):
                if self.train_iteration(step, watchdog, signals, flops, interval, do_valid):
                    return True
        return False

    def train_iteration(self, step: int, watchdog: StepWatchdog, signals: resume.SignalExit, flops: float,
                        interval: metrics.Interval, do_valid: bool) -> bool:
        """One iteration of train(): step, log, evaluate, save; True when the run should stop after it."""
        args, timers, runner = self.args, self.timers, self.runner
        with timers.time("batch-generator", level=2):
            batches = [tuple(t.to(self.device) for t in batch)
                       for batch in runner.source.train_batches(self.consumed, args.num_microbatches)]
        before = timers.step_totals()
        start = time.perf_counter()
        result = runner.train_step(batches)
        if self.cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        timers.close_step(elapsed, before)
        self.iteration = step
        self.consumed += args.global_batch_size
        self.skipped_samples += 0 if result.success else args.global_batch_size
        self.losses.add(step, result)
        interval.add(result.loss, result.success, not math.isfinite(result.loss), result.skip_reason, elapsed)
        norm = metrics.params_norm(runner.model) if args.log_params_norm else None
        if self.json_log is not None:
            self.json_log.write(metrics.json_record(step, self.consumed, result))
            self.json_log.flush()
        if self.tensorboard is not None:
            memory = metrics.memory_now(self.device) if args.log_memory_to_tensorboard else (0.0,) * 4
            self.tensorboard.log(step, self.consumed, result, self.skipped_samples, norm, memory, self.world)
        if step % args.log_interval == 0:
            self.log_interval(interval, result, flops, norm)
            interval.reset()
        if metrics.diverged(result):
            if args.check_for_nan_in_loss_and_grad:  # every rank has the same loss and skip decision
                self.stop_on_nan(step, result)
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

    # ------------------------------------------------------------------------- the whole run
    def run(self) -> None:
        """Resume, train, the final evaluations, and leave together."""
        args = self.args
        self.resume()
        self.consumed_valid = evaluation.consumed_valid_samples(args, self.iteration)
        self.open_logs()
        self.header()
        stopped = False if args.skip_train else self.train()
        do_eval = args.eval_iters > 0 and not stopped
        if do_eval and self.runner.source.has_valid:
            self.evaluate("valid", f"iteration {self.iteration} on validation set", to_tensorboard=not args.skip_train)
        if do_eval and self.runner.source.has_test:
            self.evaluate("test", f"iteration {self.iteration} on test set", to_tensorboard=False)
        self.checkpointer.close()  # waits for a background save
        self.close_logs()
        if self.losses.first is not None:
            self.say(self.losses.done_line())
        dist.barrier()  # leave together: a rank tearing gloo down while a peer still talks to it can abort
        dist.destroy_process_group()


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The main job: parse the flags (exit code 2 on a problem) and run this rank's Trainer."""
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    Trainer(args).run()


__all__ = ["Trainer", "main", "use_cuda", "intra_op_threads", "NAN_STOP_EXIT_CODE"]
