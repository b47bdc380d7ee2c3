"""The main job's TensorBoard scalars, as Megatron-LM's training_log and evaluation write them
(--tensorboard-dir, --tensorboard-log-interval and the --log-*-to-tensorboard flags), by the last rank.
A resumed run first drops the points a killed run wrote past its checkpoint."""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any, Optional

def drop_events_after(log_dir: str, iteration: int, consumed_samples: int) -> int:
    """Rewrite the event files of ``log_dir`` without the scalars a killed run wrote past the checkpoint
    it is resumed from (steps > ``iteration``; "... vs samples" tags: > ``consumed_samples``), so a
    resumed run's points are never there twice. TensorBoard's purge_step cannot do this: it purges
    every tag at one step value, and the "vs samples" tags count samples. Returns the points dropped."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    dropped = 0
    for path in sorted(Path(log_dir).glob("events.out.tfevents.*")):
        kept, changed = [], False
        for raw in RawEventFileLoader(str(path)).Load():
            event = event_pb2.Event.FromString(raw)
            if event.HasField("summary") and event.summary.value:
                values = [v for v in event.summary.value
                          if event.step <= (consumed_samples if v.tag.endswith(" vs samples") else iteration)]
                if len(values) != len(event.summary.value):
                    dropped += len(event.summary.value) - len(values)
                    changed = True
                    if not values:
                        continue
                    del event.summary.value[:]
                    event.summary.value.extend(values)
                    raw = event.SerializeToString()
            kept.append(raw)
        if changed:
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "wb") as f:
                writer = RecordWriter(f)
                for raw in kept:
                    writer.write(raw)
                writer.flush()
            os.replace(tmp, path)
    return dropped


class TensorboardLog:
    """Megatron-LM's training_log and evaluation scalars, written by the last rank (as Megatron-LM)."""

    def __init__(self, args: argparse.Namespace, start_iteration: int, consumed_samples: int) -> None:
        from torch.utils.tensorboard import SummaryWriter  # checked by parse_args

        self.args = args
        resumed = start_iteration > 0 and os.path.isdir(args.tensorboard_dir)  # a fresh run deletes nothing
        self.dropped = drop_events_after(args.tensorboard_dir, start_iteration, consumed_samples) if resumed else 0
        self.writer = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=1000)
        if start_iteration == 0:
            for key, value in sorted(vars(args).items()):
                self.writer.add_text(key, str(value), global_step=0)

    def _both(self, tag: str, value: float, iteration: int, consumed: int) -> None:
        self.writer.add_scalar(tag, value, iteration)
        self.writer.add_scalar(f"{tag} vs samples", value, consumed)

    def log(self, iteration: int, consumed: int, result: Any, skipped_samples: int, norm: Optional[float],
            memory: tuple[float, float, float, float], world: int) -> None:
        if iteration % self.args.tensorboard_log_interval:
            return
        self._both("learning-rate", result.lr, iteration, consumed)
        if skipped_samples > 0:
            self.writer.add_scalar("skipped-train-samples", skipped_samples, iteration)
        self._both("batch-size", self.args.global_batch_size, iteration, consumed)
        self._both("lm loss", result.loss, iteration, consumed)
        if self.args.log_loss_scale_to_tensorboard:
            self._both("loss-scale", result.loss_scale, iteration, consumed)
        if self.args.log_world_size_to_tensorboard:
            self._both("world-size", world, iteration, consumed)
        if result.grad_norm is not None:
            self._both("grad-norm", result.grad_norm, iteration, consumed)
        if result.num_zeros is not None:
            self._both("num-zeros", result.num_zeros, iteration, consumed)
        if norm is not None:
            self._both("params-norm", norm, iteration, consumed)
        if self.args.log_memory_to_tensorboard:
            for tag, value in zip(("mem-allocated-bytes", "mem-max-allocated-bytes", "mem-reserved-bytes",
                                   "mem-allocated-count"), memory):
                self.writer.add_scalar(tag, value, iteration)

    def log_interval(self, iteration: int, per_iteration_s: float, tflops: Optional[float],
                     timers_ms: dict[str, float]) -> None:
        """At --log-interval, with --log-timers-to-tensorboard: iteration time, throughput, timers."""
        if not self.args.log_timers_to_tensorboard:
            return
        self.writer.add_scalar("iteration-time", per_iteration_s, iteration)
        if tflops is not None:
            self.writer.add_scalar("throughput", tflops, iteration)
        for name, ms in timers_ms.items():
            self.writer.add_scalar(f"{name}-time", ms, iteration)

    def log_validation(self, loss: float, iteration: int, consumed: int) -> None:
        self._both("lm loss validation", loss, iteration, consumed)
        if self.args.log_validation_ppl_to_tensorboard:
            self._both("lm loss validation ppl", math.exp(min(20.0, loss)), iteration, consumed)

    def close(self) -> None:
        self.writer.close()


__all__ = ["TensorboardLog", "drop_events_after"]
