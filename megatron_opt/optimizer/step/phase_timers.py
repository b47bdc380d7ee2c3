"""The step's phases as profiler ranges and, when ``OptimizerConfig.timers`` holds Megatron-LM's
``Timers`` (Megatron-LM's training loop sets it), as its level-1 timers, so ``--timing-log-level 1``
shows where the optimizer's time goes. The names are Megatron-LM's where the phase does what
megatron-core's phase of that name does:

    optimizer-unscale-and-check-inf   pass 1 (unscale, finiteness, norm and zero count in one read of
                                      the grads), the one all-reduce per stats group and the decision
                                      read to the host
    optimizer-inner-step              pass 2 (clip, update, cast to the model params, in one pass) and
                                      the ranks' agreement that it succeeded; with optimizer_cuda_graph,
                                      the whole step's replay
    params-all-gather                 the param all-gather (when it is not overlapped with the next forward)
    optimizer-verify                  verify mode's checks (megatron_opt only)

megatron-core's optimizer-copy-to-main-grad, -clip-main-grad, -count-zeros and
-copy-main-to-model-params have no phase of their own here (they are parts of the two passes).
No timer is touched inside a CUDA graph capture (a timer synchronises the device).

megatron_opt.train_step, the library's counterpart of Megatron-LM's train_step, times what that one
times around the step, with the same config's timers:

    all-grads-sync                    waiting for the gradient reduction before the step (what
                                      megatron-core's finalize_model_grads times by this name)
    optimizer                         optimizer.step()

So a loop built on train_step gets Megatron-LM's level-1 timers by giving its Timers as
``OptimizerConfig(timers=...)``, with nothing wrapped (docs/usage.md, "Timers").
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from torch.profiler import record_function

PASS1 = "optimizer-unscale-and-check-inf"
PASS2 = "optimizer-inner-step"
PARAM_SYNC = "params-all-gather"
VERIFY = "optimizer-verify"
GRAD_SYNC = "all-grads-sync"  # train_step's
OPTIMIZER = "optimizer"  # train_step's
LOG_LEVEL = 1  # Megatron-LM's level for the optimizer's timers


@contextlib.contextmanager
def phase(config: Any, label: str, timer: Optional[str] = None, capturing: bool = False) -> Iterator[None]:
    """Profiler range ``label``; and timer ``timer`` of ``config.timers`` (when set, outside a capture)."""
    timers = getattr(config, "timers", None) if timer is not None and not capturing else None
    with record_function(label):
        if timers is None:
            yield
            return
        clock = timers(timer, log_level=LOG_LEVEL)
        clock.start(barrier=bool(getattr(config, "barrier_with_L1_time", False)))
        try:
            yield
        finally:
            clock.stop()


__all__ = ["PASS1", "PASS2", "PARAM_SYNC", "VERIFY", "GRAD_SYNC", "OPTIMIZER", "LOG_LEVEL", "phase"]
