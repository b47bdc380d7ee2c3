"""The exception types megatron_opt raises on purpose, so callers can tell misuse from bugs."""
from __future__ import annotations


class MegatronOptError(Exception):
    """The base of every error megatron_opt raises on purpose (each also derives from the builtin
    type callers caught before it existed: ValueError or RuntimeError)."""


class ConfigError(MegatronOptError, ValueError):
    """A configuration value megatron_opt cannot run with (the message names the field and the fix)."""


class InvalidConfigError(ConfigError):
    """A value outside its valid range, or settings that contradict each other."""


class UnsupportedConfigError(ConfigError):
    """A valid Megatron-LM setting that megatron_opt does not implement (nothing is silently ignored)."""


class StepOrderError(MegatronOptError, RuntimeError):
    """An optimizer or DDP method called out of order (e.g. prepare_grads() twice in one step)."""


class LateGradientError(MegatronOptError, RuntimeError):
    """A gradient arrived for a param whose bucket was already launched for reduction, so it would be
    lost (rule 7 of docs/contract.md); the message names the param and the bucket."""


class RankError(MegatronOptError, RuntimeError):
    """One rank failed where every rank must go on together (e.g. a micro-batch's forward in
    train_step); raised on every rank, naming the failing rank and its error."""


class CheckpointError(MegatronOptError, RuntimeError):
    """A checkpoint cannot be saved or loaded; raised on every rank together, naming the file and the
    problem. A failed load leaves the model and the optimizer untouched."""


class VerificationError(MegatronOptError, RuntimeError):
    """Verify mode (OptimizerConfig.verify_interval) found a replica, an update or a param/master cast
    that is wrong; raised on every rank together, never wrapped in RankError. The message names the
    check ('replica', 'update' or 'cast'), the param, the rank at fault and the size of the difference."""


__all__ = ["MegatronOptError", "ConfigError", "InvalidConfigError", "UnsupportedConfigError", "StepOrderError",
           "LateGradientError", "RankError", "CheckpointError", "VerificationError"]
