"""scripts/pretrain_gpt.py for the main-job tests: its path, the environment and launcher its runs use,
and Megatron-LM's log-line formats. The application itself is imported as a package (megatron_opt_train)."""
from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "pretrain_gpt.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def write_fake_manifest(folder, iteration: int) -> None:
    """An iter_* folder that a launch-time check takes for a complete checkpoint saved at data
    parallelism: a manifest with what megatron_opt.checkpoint.read_info reads, and no data files."""
    from megatron_opt.checkpoint import directory  # the on-disk names

    os.makedirs(folder, exist_ok=True)
    manifest = {"iteration": iteration, "fingerprint": {"params": [], "optimizer": {}}, "scheduler": True,
                "data_parallel_size": 2, "world_size": 2, "param_keys": "local", "model_parallel_sizes": None}
    directory.write_manifest(folder, manifest)


# Megatron-LM's training_log line (megatron/training/training.py), field for field with its widths and
# number formats; what follows the last field (this script's memory figures) is not matched.
MEGATRON_LOG_LINE = re.compile(
    r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\]"
    r" iteration (?P<iteration>[ \d]{8})/(?P<train_iters>[ \d]{8}) \|"
    r" consumed samples: (?P<consumed>[ \d]{12}) \|"
    r"(?: skipped samples: (?P<skipped_samples>[ \d]{12}) \|)?"
    r" elapsed time per iteration \(ms\): (?P<ms>\d+\.\d) \|"
    r"(?: throughput per GPU \(TFLOP/s/GPU\): (?P<tflops>\d+\.\d+) \|)?"
    r"(?: MFU: (?P<mfu>\d+\.\d)% \|)?"
    r" learning rate: (?P<lr>\d\.\d{6}E[+-]\d\d) \|"
    r" global batch size: (?P<gbs>[ \d]{5}) \|"
    r" lm loss: (?P<loss>\d\.\d{6}E[+-]\d\d) \|"
    r" loss scale: (?P<loss_scale>\d+\.\d) \|"
    r"(?: grad norm: (?P<grad_norm>\d+\.\d{3}) \|)?"
    r"(?: num zeros: (?P<num_zeros>\d+) \|)?"
    r"(?: params norm: (?P<params_norm>\d+\.\d{3}) \|)?"
    r" number of skipped iterations: (?P<skipped>[ \d]{3}) \|"
    r" number of nan iterations: (?P<nan>[ \d]{3}) \|")
# Megatron-LM's evaluate_and_print_results line.
MEGATRON_VALIDATION_LINE = re.compile(
    r" validation loss at (?P<prefix>iteration \d+(?: on (?:validation|test) set)?) \|"
    r" lm loss value: (?P<loss>\d\.\d{6}E[+-]\d\d) \| lm loss PPL: (?P<ppl>\d\.\d{6}E[+-]\d\d) \| $")


def log_lines(stdout: str) -> list[re.Match]:
    """The Megatron-LM log lines of a run's stdout, parsed."""
    return [m for m in map(MEGATRON_LOG_LINE.match, stdout.splitlines()) if m]
