"""The update-rule registry is the one list of optimizer names; a rule declares what it needs; the
gradient multiplier and the lr table's host values (issue 29, item 1)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import megatron_opt as mo
import megatron_opt.ops as ops
from megatron_opt.megatron import arguments as megatron_args
from megatron_opt.optimizer.step.grad_multiplier import GradMultiplier
from megatron_opt.optimizer.rules import UPDATE_RULES, Needs, resolve_update_rule, update_rule_from_config


def _optimizer_choices() -> tuple:
    parser = argparse.ArgumentParser()
    megatron_args.add_megatron_args(parser)
    action = next(a for a in parser._actions if "--optimizer" in a.option_strings)
    return tuple(action.choices)


def test_config_flags_and_lookup_read_the_registry(monkeypatch):
    assert _optimizer_choices() == tuple(UPDATE_RULES)
    for name, cls in UPDATE_RULES.items():
        assert type(update_rule_from_config(mo.OptimizerConfig(lr=1e-3, optimizer=name))) is cls
    config = mo.OptimizerConfig(lr=1e-3, optimizer="scion")  # the config knows no rule: issue 38
    with pytest.raises(mo.UnsupportedConfigError,
                       match="'adam', 'adaptive_muon', 'lion', 'muon', 'dist_muon', 'sgd' or 'soap'"):
        update_rule_from_config(config)


def test_the_rules_take_their_constants_from_the_config():
    cfg = mo.OptimizerConfig(lr=1e-3, optimizer="lion", lion_beta1=0.5, lion_beta2=0.25, sgd_momentum=0.5,
                             adam_beta1=0.8, adam_eps=1e-6)
    assert update_rule_from_config(cfg) == mo.Lion(beta1=0.5, beta2=0.25)
    assert mo.SGD.from_config(cfg) == mo.SGD(momentum=0.5)
    assert mo.AdamW.from_config(cfg) == mo.AdamW(beta1=0.8, eps=1e-6)


@dataclass(frozen=True)
class _MatrixRule(mo.UpdateRule):
    name: ClassVar[str] = "matrix"
    needs: ClassVar[Needs] = Needs.WHOLE_TENSORS

    def state_dtypes(self):
        return {}

    def apply(self, plan, **kwargs):
        raise AssertionError("never run")


def test_a_rule_that_needs_whole_tensors_is_refused():
    cfg = mo.OptimizerConfig(lr=1e-3)
    assert resolve_update_rule(cfg) == mo.AdamW()
    assert mo.AdamW.needs is Needs.ELEMENTWISE
    with pytest.raises(mo.UnsupportedConfigError, match="whole tensors"):
        resolve_update_rule(cfg, _MatrixRule())


def test_the_torch_backends_read_lr_and_wd_on_the_host(monkeypatch):
    """The values DeviceHyperparams staged come back without a read of the device table: they travel in a
    named object beside it (ops.LrWdTable), never as an attribute of the tensor (issue 38, item 4)."""
    hyper = ops.DeviceHyperparams(2, torch.device("cpu"))
    staged = hyper.update([1e-3, 0.1], [0.01, 0.0])
    assert isinstance(staged, ops.LrWdTable)

    def no_read(cls, lr_wd):
        raise AssertionError("read the table back")

    monkeypatch.setattr(ops.LrWd, "from_table", classmethod(no_read))
    host = ops.host_lr_wd(staged)
    assert list(host.lr) == [1e-3, 0.1] and list(host.weight_decay) == [0.01, 0.0]
    assert staged.table.tolist() == [[1e-3, 0.01], [0.1, 0.0]]
    assert not [k for k in vars(staged.table) if "megatron_opt" in k]  # nothing hidden on the tensor
    changed = hyper.update([2e-3, 0.1], [0.01, 0.0])  # a changed value: the host copy follows
    assert list(ops.host_lr_wd(changed).lr) == [2e-3, 0.1] and changed.table is staged.table


def test_the_multiplier_is_staged_once_and_folds_the_clip():
    factor = torch.tensor([1 / 3], dtype=torch.float32)
    m = GradMultiplier(factor)
    with pytest.raises(RuntimeError, match="stage"):
        m.fold_clip(None)
    loss_scale = torch.tensor([1024.0])
    inv = m.stage(loss_scale)
    assert torch.equal(inv, factor / loss_scale)
    clip = torch.tensor([0.7], dtype=torch.float32)
    assert torch.equal(m.fold_clip(clip), factor / loss_scale * clip)
    assert m.fold_clip(None) is m.inv_scale


@pytest.mark.parametrize("name", ["scion", "polargrad", "mop", "spel", "sinkhorn_muon", "muon_hyperball",
                                  "laprop", "rekls"])
def test_megatron_cores_other_optimizers_are_refused_by_name_with_what_runs(name):
    """Issue 39, item 7: every other name megatron-core's registry reaches is refused by name, listing what runs."""
    with pytest.raises(mo.UnsupportedConfigError) as ei:
        update_rule_from_config(mo.OptimizerConfig(lr=1e-3, optimizer=name))
    message = str(ei.value)
    assert f"optimizer={name!r} is megatron-core's, but not supported by megatron_opt" in message
    assert "runs 'adam', 'adaptive_muon', 'lion', 'muon', 'dist_muon', 'sgd' or 'soap'" in message
