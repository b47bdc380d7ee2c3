"""Loss scalers with Megatron-LM's semantics, on any device.

``update(found_inf)`` is called exactly once per optimizer step, after the global overflow decision
(rule 2 of docs/contract.md); growth and backoff therefore count optimizer steps. It has one
implementation, in device ops, so a step decided on the device (optimizer_cuda_graph) updates the
scaler with no host synchronisation: ``found_inf`` and ``applied`` may be host bools or device flags.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

Flag = Union[bool, torch.Tensor]  # a host bool, or a device tensor read as "nonzero"


class MegatronGradScaler:
    def __init__(self, initial_scale: float, device: Union[str, torch.device] = "cpu") -> None:
        if initial_scale <= 0:
            raise ValueError(f"loss scale must be positive, got {initial_scale}")
        self._scale = torch.tensor([float(initial_scale)], dtype=torch.float32, device=device)

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.double().reciprocal().float()

    def update(self, found_inf: Flag, applied: Optional[Flag] = None) -> None:
        """One step's update: ``found_inf`` (an overflow) backs off; ``applied`` (default: not
        found_inf), a clean step whose update was applied, counts towards growth; neither (a step
        skipped for its norm) leaves the scaler as it was."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict) -> None:
        raise NotImplementedError


class ConstantGradScaler(MegatronGradScaler):
    """A fixed scale. Non-finite steps are still skipped (the check runs whenever a scaler exists)."""

    def update(self, found_inf: Flag, applied: Optional[Flag] = None) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class DynamicGradScaler(MegatronGradScaler):
    """Back off after ``hysteresis`` overflow steps since the last growth; grow after
    ``growth_interval`` consecutive clean steps (which also restores the hysteresis budget)."""

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
        device: Union[str, torch.device] = "cpu",
    ) -> None:
        super().__init__(initial_scale, device)
        if not (min_scale > 0 and min_scale <= initial_scale):
            raise ValueError(f"min_scale must be in (0, initial_scale], got {min_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval <= 0 or hysteresis <= 0:
            raise ValueError("growth_interval and hysteresis must be positive")
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        # [growth tracker, hysteresis tracker] on the scale's device, updated in place (a captured CUDA
        # graph holds its address); host reads happen only for state_dict().
        self._trackers = torch.tensor([0, self.hysteresis], dtype=torch.int64, device=self._scale.device)
        self._flags = torch.tensor([False, True], device=self._scale.device)  # host bools as device flags

    def _as_flag(self, flag: Flag) -> torch.Tensor:
        if isinstance(flag, torch.Tensor):
            return (flag.to(self._scale.device) != 0).reshape(())
        return self._flags[int(bool(flag))]  # a view: no host-to-device copy, no synchronisation

    def update(self, found_inf: Flag, applied: Optional[Flag] = None) -> None:
        overflow = self._as_flag(found_inf)
        applied_t = ~overflow if applied is None else self._as_flag(applied)
        growth, hyst = self._trackers[0], self._trackers[1]
        growth = torch.where(overflow, 0, torch.where(applied_t, growth + 1, growth))
        grow = applied_t & (growth == self.growth_interval)
        growth = torch.where(grow, 0, growth)
        hyst = torch.where(overflow, hyst - 1, torch.where(grow, self.hysteresis, hyst))
        backoff = overflow & (hyst <= 0)
        scale = torch.where(backoff, (self._scale * self.backoff_factor).clamp(min=self.min_scale),
                            torch.where(grow, self._scale * self.growth_factor, self._scale))
        self._scale.copy_(scale)
        self._trackers.copy_(torch.stack([growth, hyst]))

    def state_dict(self) -> dict:
        growth, hyst = self._trackers.tolist()
        return {
            "scale": self._scale.detach().cpu().clone(),
            "growth_tracker": int(growth),
            "hysteresis_tracker": int(hyst),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self._scale.copy_(state_dict["scale"].to(self._scale.device).reshape(1))
        self._trackers.copy_(torch.tensor([int(state_dict["growth_tracker"]), int(state_dict["hysteresis_tracker"])],
                                          dtype=torch.int64))
