"""The main job's checkpoint rules, so that it never loses a run:

* ``--load DIR`` resumes from the tracker's iteration, or, without a tracker, from the newest complete
  ``iter_*`` folder (as megatron_opt.checkpoint.load does). A missing or empty DIR says so in one line
  and trains from scratch (as Megatron-LM; ``--exit-on-missing-checkpoint`` makes it an error).
* ``--save DIR`` refuses (exit code 2, before anything runs) when DIR already holds an iteration newer
  than the one this run starts from: its saves would move DIR's tracker back and the next resume
  would lose the newer iterations. ``--overwrite-newer-checkpoints`` allows it.
* On a resume, the checkpoint's LR/weight-decay schedule is kept unless
  ``--override-opt_param-scheduler`` (Megatron-LM's flags); either way a warning names every value of
  the schedule, and the global batch size, that differs between the checkpoint and the command line.
* ``--exit-signal-handler``: on SIGTERM, every rank finishes its iteration, saves (with --save) and exits 0.
"""
from __future__ import annotations

import argparse
import signal
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

import megatron_opt as mo
import megatron_opt.checkpoint  # noqa: F401  (mo.checkpoint)

# The scheduler's values that define the schedule (what Megatron-LM's _check_and_set compares).
SCHEDULE_FIELDS = ("max_lr", "min_lr", "init_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style",
                   "start_wd", "end_wd", "wd_incr_steps", "wd_incr_style", "wsd_decay_steps", "lr_wsd_decay_style")


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing (Megatron-LM's, this script's)")
    g.add_argument("--no-save-optim", action="store_true", help="save the model and schedule without the optimizer")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM: finish the iteration, save (with --save) and exit 0 on every rank")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="with --load: exit (code 2) when there is no checkpoint instead of training from scratch")
    g.add_argument("--overwrite-newer-checkpoints", action="store_true",
                   help="this script's own: let --save write into a folder that holds a newer iteration than the "
                        "run starts from (its tracker then moves back to this run's iterations)")


def newest_iteration(root: str) -> Optional[int]:
    """The newest iteration a checkpoint folder holds: the tracker's, or its newest complete iter_* folder."""
    path = Path(root)
    if not path.is_dir():
        return None
    known = mo.checkpoint.complete_iterations(path)
    try:
        tracker = mo.checkpoint.latest_iteration(path)
    except ValueError:
        tracker = None
    candidates = known + ([tracker] if tracker is not None else [])
    return max(candidates) if candidates else None


def find_load(args: argparse.Namespace) -> Optional[str]:
    """Resolve --load before anything runs: sets ``args.load_iteration`` (None: nothing to load) and
    ``args.load_note`` (why nothing), or returns the problem (a message for parser.error)."""
    args.load_iteration, args.load_note = None, None
    if args.load is None:
        return None
    root = Path(args.load)
    try:
        folder = mo.checkpoint.resolve(root)
    except FileNotFoundError as exc:
        tracker_named = (root / mo.checkpoint.TRACKER).exists()
        if tracker_named:  # the tracker names an iteration whose folder is gone or incomplete
            return f"--load {args.load}: {exc}; the tracker points at a checkpoint that is not there"
        args.load_note = ("the folder does not exist" if not root.exists() else
                          "the folder is empty" if not any(root.iterdir()) else
                          f"it holds no {mo.checkpoint.TRACKER} and no complete iter_* folder")
        if args.exit_on_missing_checkpoint:
            return f"--load {args.load}: no checkpoint ({args.load_note}); --exit-on-missing-checkpoint is set"
        return None
    except ValueError as exc:  # a tracker that is not a number
        return f"--load {args.load}: {exc}"
    try:
        args.load_iteration = mo.checkpoint.read_info(folder).iteration
    except mo.CheckpointError as exc:
        return f"--load {args.load}: {exc}"
    return None


def check_save(args: argparse.Namespace) -> Optional[str]:
    """--save must not move a folder's tracker back over newer iterations (unless asked)."""
    if args.save is None or args.overwrite_newer_checkpoints:
        return None
    newest = newest_iteration(args.save)
    start = args.load_iteration or 0
    if newest is None or newest <= start:
        return None
    if args.load is None:
        source = "it trains from scratch (no --load)"
    elif args.load_iteration is None:
        source = f"it trains from scratch (--load {args.load}: {args.load_note})"
    else:
        source = f"it resumes from iteration {start} of --load {args.load}"
    return (f"--save {args.save} already holds iteration {newest}, newer than this run's start ({source}): its saves "
            f"would move {args.save}'s tracker back to them and a later resume would lose iterations up to {newest}. "
            f"Resume it (--load {args.save}), save somewhere else, or pass --overwrite-newer-checkpoints to "
            f"overwrite it anyway")


def schedule_values(scheduler: Any) -> dict[str, Any]:
    return {name: getattr(scheduler, name) for name in SCHEDULE_FIELDS}


def resume_warnings(args: argparse.Namespace, extra: dict, scheduler: Any, command_line: dict[str, Any]) -> list[str]:
    """What differs between the checkpoint's run and this command line: the global batch and the
    schedule (lengths counted in samples), and which of the two the run now follows."""
    out = []
    saved_gbs = extra.get("global_batch_size")
    if saved_gbs is not None and saved_gbs != args.global_batch_size:
        out.append(f"warning: the checkpoint was trained at global batch size {saved_gbs}, this run uses "
                   f"{args.global_batch_size} (--global-batch-size; default --micro-batch-size x data-parallel size): "
                   f"the consumed samples and the schedule (counted in samples) continue, at the new batch size")
    saved = extra.get("schedule") or (None if args.override_opt_param_scheduler else schedule_values(scheduler))
    if saved is None:
        return out
    diffs = [f"{name} {saved[name]!r} -> {command_line[name]!r}" for name in SCHEDULE_FIELDS
             if name in saved and saved[name] != command_line[name]]
    if diffs:
        if args.override_opt_param_scheduler:
            what = "this run follows the command line's (--override-opt_param-scheduler)"
        else:
            what = ("this run keeps the checkpoint's (--use-checkpoint-opt_param-scheduler, the default here; "
                    "Megatron-LM refuses such a resume without one of the two flags); "
                    "--override-opt_param-scheduler takes the command line's")
        out.append(f"warning: the checkpoint's LR/weight-decay schedule differs from the command line's "
                   f"(checkpoint -> command line, lengths in samples: {'; '.join(diffs)}): {what}")
    return out


class SignalExit:
    """Megatron-LM's --exit-signal-handler: SIGTERM sets a flag; every rank checks it after each
    iteration (one small all-reduce), so all ranks save and exit at the same iteration."""

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled, self.device, self.received = enabled, device, False
        if enabled:
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True

    def agreed(self) -> bool:
        if not self.enabled:
            return False
        flag = torch.tensor([1.0 if self.received else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() > 0
