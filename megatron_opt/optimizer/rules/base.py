"""UpdateRule: the base of every update rule, built in (one file each in this folder: adamw.py, sgd.py,
lion.py, muon.py) or the user's own; and ``constant``, how a rule declares its constants.

A rule is declared once, in its own file. Its dataclass fields are its constants; ``constant(...)`` gives a
constant its OptimizerConfig field (megatron-core's name such as ``adam_beta1``, or a name of the rule's own,
carried in ``OptimizerConfig.rule_constants``), its valid values and its command-line flag's default. The
registry (registry.py) finds every rule in this folder, and the rest reads the declaration: the config's
validation (``from_config``, where rules are built), the main job's flags (megatron/arguments), the
checkpoint's param-group fields (``torch_group_fields``) and the kernel op set (the op record's
``kernel_constants``); tests/unit/test_rule_declarations.py checks OptimizerConfig's fields and Megatron-LM's
flags against it.

A rule declares its state tensors and their dtypes, what it needs to see of the params (``needs``:
elementwise, or whole tensors, which the whole-tensor leaf runs: optimizer/whole_tensor/), and runs pass 2
over a step plan by handing its op record to ``ops.update``; everything that walks optimizer state (skips,
state dicts, checkpoints) reads ``state_dtypes`` and needs no change for a new rule. docs/design.md ("Update
rules") says how to add one.
"""
from __future__ import annotations

import abc
import dataclasses
import enum
import math
from dataclasses import asdict, is_dataclass
from typing import Any, Callable, ClassVar, Optional

import torch

from ... import ops
from ...config import check_range
from ...errors import InvalidConfigError
from ...ops.step_plan import StepPlan
from ..verify.float64_update import Float64Inputs, Float64Update

CONFIG_OWNER = "OptimizerConfig"  # messages name the config field a value came from (the main job: its flag)
_CONSTANT = "megatron_opt.constant"  # the key of a declaration in a dataclass field's metadata


class _SameAsConfig:
    def __repr__(self) -> str:
        return "SAME_AS_CONFIG"


SAME_AS_CONFIG = _SameAsConfig()  # Constant.flag_default: the flag's default is the config's


@dataclasses.dataclass(frozen=True)
class Constant:
    """What a rule declares of one constant besides its name and default (the dataclass field's).

    ``config_field``: the OptimizerConfig field it is read from (None: set only by constructing the rule).
    ``low`` / ``high`` (``*_open`` excludes an end; NaN is never in range), ``integer`` and ``choices``: its
    valid values. ``flag_default``: the main job's flag default where Megatron-LM's differs from the config's
    (``--muon-momentum`` 0.9, the config 0.95); ``flag``: its name where it is not ``--`` and the config field
    with dashes (a switch to False: ``--muon-no-split-qkv``). ``hint``: added to an out-of-range message;
    ``help``: the flag's help."""

    config_field: Optional[str] = None
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = True
    integer: bool = False
    choices: tuple = ()
    flag_default: Any = SAME_AS_CONFIG
    flag: Optional[str] = None
    hint: str = ""
    help: str = ""

    def check(self, owner: str, name: str, value: Any) -> None:
        """InvalidConfigError naming ``owner.name`` and the valid values unless ``value`` is one of them."""
        if self.choices:
            if value not in self.choices:
                raise InvalidConfigError(f"{owner}.{name}={value!r} is not one of "
                                         f"{', '.join(repr(c) for c in self.choices)}.")
        elif self.integer or math.isfinite(self.low) or math.isfinite(self.high):
            check_range(owner, name, value, self.low, self.high, low_open=self.low_open, high_open=self.high_open,
                        integer=self.integer, hint=self.hint)


def constant(default: Any, config_field: Optional[str] = None, **declared: Any) -> Any:
    """A rule's dataclass field that is a declared constant: ``beta1: float = constant(0.9, "adam_beta1",
    low=0, high=1)``. ``declared``: the other fields of ``Constant``."""
    return dataclasses.field(default=default, metadata={_CONSTANT: Constant(config_field, **declared)})


class Needs(enum.Enum):
    """What of the params a rule's update reads at once.

    ELEMENTWISE: each element on its own (AdamW, SGD, Lion): any owned range of a flat shard can be
    updated alone, so a rank updates exactly the element ranges it owns.
    WHOLE_TENSORS: each param as a whole tensor (a matrix rule such as Muon's Newton-Schulz): the step
    hands the rule full matrices through the whole-tensor leaf (optimizer/whole_tensor/: each matrix to
    its home rank and the slices back; docs/design.md, "Rules that need whole tensors").
    get_megatron_optimizer builds Muon that way; DistributedOptimizer refuses such a rule unless it is
    given ``selects``.
    """

    ELEMENTWISE = "elementwise"
    WHOLE_TENSORS = "whole tensors"


def is_matrix_param(param: torch.Tensor) -> bool:
    """megatron-core's split for its emerging optimizers (Muon, SOAP, its Lion): a 2-D param not marked
    ``is_embedding_or_output_parameter``; AdamW takes the rest."""
    return param.dim() == 2 and not getattr(param, "is_embedding_or_output_parameter", False)


class UpdateRule(abc.ABC):
    """One optimizer's update on a flat fp32 master shard."""

    name: ClassVar[str]  # OptimizerConfig.optimizer value (registry.py lists the built-in ones)
    aliases: ClassVar[tuple[str, ...]] = ()  # other OptimizerConfig.optimizer values for the same rule
    needs: ClassVar[Needs] = Needs.ELEMENTWISE
    precision_aware: ClassVar[bool] = False  # takes Megatron-LM's use_precision_aware_optimizer
    op_record: ClassVar[Optional[type]] = None  # its pass-2 op record (an ops.UpdateArgs subclass), if it has one

    def __post_init__(self) -> None:
        """A rule built directly (``AdamW(beta1=...)``) checks its declared constants too."""
        for name, declared in type(self).constants().items():
            declared.check(type(self).__name__, name, getattr(self, name))

    # ----------------------------------------------------------------- the declaration
    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every OptimizerConfig.optimizer value that selects this rule: the one list of its synonyms."""
        return (cls.name, *cls.aliases)

    @classmethod
    def constants(cls) -> dict[str, Constant]:
        """The declared constants, by field name, in field order."""
        if not is_dataclass(cls):
            return {}
        return {f.name: f.metadata[_CONSTANT] for f in dataclasses.fields(cls) if _CONSTANT in f.metadata}

    @classmethod
    def constant_defaults(cls) -> dict[str, Any]:
        return {f.name: f.default for f in dataclasses.fields(cls) if f.name in cls.constants()}

    @classmethod
    def constants_from(cls, config: Any) -> dict[str, Any]:
        """The configured constants, by field name, each checked against its declaration (InvalidConfigError
        naming the config field): megatron-core's fields as attributes of ``config``, the rule's own names
        from ``config.rule_constants`` (the declared default when absent)."""
        own = getattr(config, "rule_constants", None) or {}
        defaults = cls.constant_defaults()
        values = {}
        for name, declared in cls.constants().items():
            if declared.config_field is None:
                continue
            field = declared.config_field
            value = getattr(config, field) if hasattr(config, field) else own.get(field, defaults[name])
            declared.check(CONFIG_OWNER, field, value)
            values[name] = value
        return values

    @classmethod
    def check_config(cls, config: Any) -> None:
        """The rule's checks of the rest of an OptimizerConfig (its other settings), before its constants
        are read; none by default (registry.update_rule_from_config checks the optimizer name and
        ``precision_aware`` for every rule)."""

    @classmethod
    def from_config(cls, config: Any) -> "UpdateRule":
        """The rule an OptimizerConfig asks for: the config checked (``check_config``) and the declared
        constants read from it (default: those alone)."""
        cls.check_config(config)
        return cls(**cls.constants_from(config))

    def param_split(self) -> Optional[Callable[[torch.Tensor], bool]]:
        """Which params this rule updates when it takes only some (the rest: an AdamW companion with the adam_*
        settings, build/factory.py); None (the default): every param."""
        return None

    def torch_group_fields(self) -> dict[str, Any]:
        """What megatron-core's inner optimizer (torch's, for the built-in rules) keeps in each param group
        for this rule, written into torch_dist checkpoints (optimizer/state/torch_dist.py): default, the
        rule's constants."""
        return dict(self.hyperparameters())

    # ----------------------------------------------------------------- the update
    @abc.abstractmethod
    def state_dtypes(self) -> dict[str, torch.dtype]:
        """The state tensors this rule keeps per owned element, by name, with their dtypes."""

    def init_state(self, master: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zero-initialised state for one shard (what torch.optim's lazy init produces)."""
        return {n: torch.zeros(master.shape, dtype=d, device=master.device) for n, d in self.state_dtypes().items()}

    @abc.abstractmethod
    def apply(self, plan: StepPlan, *, lr_wd: ops.LrWdTable, grad_scale: torch.Tensor, step: torch.Tensor,
              backend: ops.Backend, found_inf: Optional[torch.Tensor] = None) -> None:
        """Pass 2 over every shard of ``plan`` (whose shard state is ``state_dtypes()``'s tensors, in
        that order). ``lr_wd``: this step's (lr, weight decay) per param group, an ``ops.LrWdTable`` (the
        [groups, 2] device table the kernels read, with its host values, which the torch backends read);
        the grads are multiplied by ``grad_scale``, the one fp32 device multiplier that already holds the
        unscale factor, 1/loss scale and the clip coefficient; ``step`` is the 1-based index of this
        update; a nonzero device flag ``found_inf`` means: write nothing (a step decided on the device).
        An elementwise rule builds its op record, ``Step(rule=self, grad_scale=..., found_inf=...)`` (the
        record reads the rule's constants and never copies them), and calls ``ops.update(plan, record,
        lr_wd=lr_wd, backend=backend)``: dispatch goes one way, rule -> op record -> backend."""

    def hyperparameters(self) -> dict[str, Any]:
        """The rule's constants, recorded in state dicts for inspection (a load keeps the running
        rule's own constants, as torch.optim keeps the constructor's defaults for new groups)."""
        if not is_dataclass(self):
            return {}
        return {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in asdict(self).items()}

    def float64_update(self, inputs: Float64Inputs) -> Optional[Float64Update]:
        """This rule's update of ``inputs`` recomputed in float64, with a per-element bound on the
        error of fp32 arithmetic (optimizer/verify/float64_update.py): what verify mode's ``update`` check
        compares pass 2 with. None: the rule has none, and verify mode refuses to run with it."""
        return None


__all__ = ["UpdateRule", "Needs", "Constant", "constant", "SAME_AS_CONFIG", "CONFIG_OWNER", "is_matrix_param"]
