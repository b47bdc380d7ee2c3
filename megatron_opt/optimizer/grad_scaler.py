"""Loss scalers with Megatron-LM's semantics, on any device.

``update(found_inf)`` is called exactly once per optimizer step, after the global overflow decision
(rule 2 of docs/contract.md); growth and backoff therefore count optimizer steps.
"""
from __future__ import annotations

from typing import Optional, Union

import torch


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

    def update(self, found_inf: Union[bool, torch.Tensor]) -> None:
        raise NotImplementedError

    def update_on_device(self, overflow: torch.Tensor, applied: torch.Tensor) -> None:
        """The same update as device ops, for a step with no host synchronisation: ``overflow`` (a
        bool tensor) is update(True); ``applied`` is update(False); neither (a step skipped for its
        norm) leaves the scaler as it was."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict) -> None:
        raise NotImplementedError


class ConstantGradScaler(MegatronGradScaler):
    """A fixed scale. Non-finite steps are still skipped (the check runs whenever a scaler exists)."""

    def update(self, found_inf: Union[bool, torch.Tensor]) -> None:
        pass

    def update_on_device(self, overflow: torch.Tensor, applied: torch.Tensor) -> None:
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
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis
        self._trackers: Optional[torch.Tensor] = None  # [growth, hysteresis] on the device, once used there

    # Once a step has run on the device, the device trackers are the truth (a captured CUDA graph
    # holds their address, so they are never replaced); host uses read and write them in place.
    def _pull_trackers(self) -> None:
        if self._trackers is not None:
            self._growth_tracker, self._hysteresis_tracker = (int(x) for x in self._trackers.tolist())

    def _push_trackers(self) -> None:
        if self._trackers is not None:
            self._trackers.copy_(torch.tensor([self._growth_tracker, self._hysteresis_tracker], dtype=torch.int64))

    def update_on_device(self, overflow: torch.Tensor, applied: torch.Tensor) -> None:
        if self._trackers is None:
            self._trackers = torch.tensor([self._growth_tracker, self._hysteresis_tracker], dtype=torch.int64,
                                          device=self._scale.device)
        growth, hyst = self._trackers[0], self._trackers[1]
        growth = torch.where(overflow, 0, torch.where(applied, growth + 1, growth))
        grow = applied & (growth == self.growth_interval)
        growth = torch.where(grow, 0, growth)
        hyst = torch.where(overflow, hyst - 1, torch.where(grow, self.hysteresis, hyst))
        backoff = overflow & (hyst <= 0)
        scale = torch.where(backoff, (self._scale * self.backoff_factor).clamp(min=self.min_scale),
                            torch.where(grow, self._scale * self.growth_factor, self._scale))
        self._scale.copy_(scale)
        self._trackers.copy_(torch.stack([growth, hyst]))

    def update(self, found_inf: Union[bool, torch.Tensor]) -> None:
        self._pull_trackers()
        if bool(found_inf):
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale.mul_(self.backoff_factor).clamp_(min=self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale.mul_(self.growth_factor)
        self._push_trackers()

    def state_dict(self) -> dict:
        self._pull_trackers()
        return {
            "scale": self._scale.detach().cpu().clone(),
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self._scale.copy_(state_dict["scale"].to(self._scale.device).reshape(1))
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
        self._push_trackers()
