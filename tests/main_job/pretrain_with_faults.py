"""The main job (scripts/pretrain_gpt.py) with a fault put where a test wants it, run like the script (under torchrun,
same flags). The faults, from the environment:

- FAULT_STOP_RANK=<rank> and FAULT_STOP_ITERATION=<n>: that rank SIGSTOPs itself after its train step
  of iteration n, before the log line's memory all-reduce, so its peers wait there for it;
- FAULT_SLOW_SAVE_SECONDS=<s>: each checkpoint save first sleeps s seconds.
"""
from __future__ import annotations

import os
import signal
import time

from megatron_opt_train.train import Trainer, main

stop_rank = int(os.environ.get("FAULT_STOP_RANK", "-1"))
stop_iteration = int(os.environ.get("FAULT_STOP_ITERATION", "0"))
slow_save_seconds = float(os.environ.get("FAULT_SLOW_SAVE_SECONDS", "0"))
log_interval, save = Trainer.log_interval, Trainer.save


def log_interval_after_a_stop(self, *args, **kwargs):
    if self.rank == stop_rank and self.iteration == stop_iteration:
        os.kill(os.getpid(), signal.SIGSTOP)
    return log_interval(self, *args, **kwargs)


def slow_save(self):
    time.sleep(slow_save_seconds)
    return save(self)


Trainer.log_interval, Trainer.save = log_interval_after_a_stop, slow_save

if __name__ == "__main__":
    main()
