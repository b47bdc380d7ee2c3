"""Loss scalers with Megatron-LM's semantics, on any device.

``update(found_inf)`` is called exactly once per optimizer step, after the global overflow decision
(rule 2 of docs/contract.md); growth and backoff therefore count optimizer steps.
"""
from __future__ import annotations

from typing import Union

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

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict) -> None:
        raise NotImplementedError


class ConstantGradScaler(MegatronGradScaler):
    """A fixed scale. Non-finite steps are still skipped (the check runs whenever a scaler exists)."""

    def update(self, found_inf: Union[bool, torch.Tensor]) -> None:
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

    def update(self, found_inf: Union[bool, torch.Tensor]) -> None:
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

    def state_dict(self) -> dict:
        return {
            "scale": self._scale.detach().cpu().clone(),
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self._scale.copy_(state_dict["scale"].to(self._scale.device).reshape(1))
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
