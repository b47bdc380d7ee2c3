"""OptimizerConfig.timers (set by Megatron-LM's training loop to its Timers): the step's phases are
timed at log level 1 under Megatron-LM's names, each start paired with a stop, with the config's
barrier_with_L1_time; a skipped step times only pass 1; the device-decided step times its replay."""
from __future__ import annotations

import pytest

from tests.distributed import cases_phase_timers as cpt
from megatron_opt.optimizer.step import phase_timers as pt

INF = float("inf")


def names(events: list) -> list[str]:
    """The timed phases in order; checks every start is followed by its stop at level 1."""
    out = []
    for start, stop in zip(events[::2], events[1::2]):
        assert start[0] == "start" and stop[0] == "stop" and start[1] == stop[1], events
        assert start[2] == pt.LOG_LEVEL, events
        out.append(start[1])
    assert len(events) % 2 == 0, events
    return out


@pytest.mark.parametrize("distributed", [True, False])
def test_host_step_phases(pools, distributed):
    for steps in pools(2).run(cpt.timed_steps, [1.0, INF, 1.0], distributed=distributed):
        applied = [pt.PASS1, pt.PASS2] + ([pt.PARAM_SYNC] if distributed else [])
        assert names(steps[0]) == applied and names(steps[2]) == applied, steps
        assert names(steps[1]) == [pt.PASS1], steps[1]  # an overflow: the update is skipped, not timed
        assert all(event[3] is False for step in steps for event in step)


def test_barrier_verify_and_device_step_phases(pools):
    for steps in pools(2).run(cpt.timed_steps, [1.0], barrier_with_L1_time=True, verify_interval=1):
        assert names(steps[0]) == [pt.VERIFY, pt.PASS1, pt.PASS2, pt.PARAM_SYNC, pt.VERIFY], steps[0]
        assert all(event[3] is True for event in steps[0] if event[0] == "start")
    for steps in pools(2).run(cpt.timed_steps, [1.0, INF], optimizer_cuda_graph=True):
        # No host read: the whole decided step is one timed replay (eager on CPU; the param all-gather is
        # inside it unless overlapped with the next forward).
        assert names(steps[0]) == names(steps[1]) == [pt.PASS2], steps
