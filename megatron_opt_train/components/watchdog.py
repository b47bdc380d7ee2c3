"""A step watchdog for the main job: a rank whose step hangs exits instead of waiting silently.

A rank waiting in a collective for a peer that is stopped, hung or gone would otherwise sit there
until the process group's timeout (--watchdog-multiple, --watchdog-min-seconds).
"""
from __future__ import annotations

import collections
import contextlib
import os
import statistics
import sys
import threading
import time
from typing import Iterator


class StepWatchdog:
    """Ends this process when a training step runs far longer than the steps before it.

    A rank waiting in a collective for a peer that is stopped, hung or gone would otherwise sit there
    until the process group's timeout. Wrap each iteration in ``with watchdog.step(iteration):`` (all of
    it: a peer can stop before any of its collectives) and the parts whose length is not a step's in
    ``with watchdog.unwatched():``. The first ``warmup`` steps are neither timed nor watched; from then
    on a daemon thread checks the running step and, once it has run longer than max(min_seconds,
    multiple x the median of the recent step times), prints the rank, iteration, elapsed time and
    median to stderr and calls ``os._exit(EXIT_CODE)``: no clean-up, since the main thread is the one
    that is stuck.
    """

    EXIT_CODE = 3

    def __init__(self, rank: int, multiple: float, min_seconds: float, warmup: int = 3, window: int = 1000) -> None:
        self.rank, self.multiple, self.min_seconds, self.warmup = rank, multiple, min_seconds, warmup
        self.durations: collections.deque[float] = collections.deque(maxlen=window)
        self.steps_seen = 0
        # (iteration, start time) of the watched step; unwatched() moves the start past its own time
        self.current: tuple[int, float] | None = None
        self.lock = threading.Lock()
        if multiple > 0:
            threading.Thread(target=self._watch, name="step-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def step(self, iteration: int) -> Iterator[None]:
        with self.lock:
            self.current = (iteration, time.monotonic()) if self.steps_seen >= self.warmup else None
        try:
            yield
        finally:
            with self.lock:
                if self.current is not None:  # watched
                    self.durations.append(time.monotonic() - self.current[1])
                self.current = None
            self.steps_seen += 1

    @contextlib.contextmanager
    def unwatched(self) -> Iterator[None]:
        """A part of the step that is neither watched nor timed (evaluation, checkpoint saves): its length
        has nothing to do with the step's, so it must neither trip the watchdog nor move the median."""
        with self.lock:
            paused, self.current = self.current, None
        start = time.monotonic()
        try:
            yield
        finally:
            seconds = time.monotonic() - start
            with self.lock:
                self.current = None if paused is None else (paused[0], paused[1] + seconds)

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
