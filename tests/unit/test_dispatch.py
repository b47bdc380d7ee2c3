"""Dispatch in one direction (issue 38, item 4): rule -> op record -> backend. The rule builds its op record
(which reads the rule's constants, never copies them) and hands it to the front, ``ops.update``; the backend
reads the record (its math, its ``KernelCall``) and calls nothing back up. Host values travel in a named
object (``ops.LrWdTable``), never as attributes of tensors. The CUDA backend is run here on the CPU with a
stand-in for the compiled module that records each launch (no GPU or built extension needed)."""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

import megatron_opt as mo
import megatron_opt.ops as ops
from megatron_opt.ops.piece_table import full_table
from megatron_opt.optimizer.rules import AdamWStep, LionStep, SGDStep
from megatron_opt.optimizer.rules.registry import RULES

PACKAGE = Path(mo.__file__).resolve().parent
BF16, F32 = torch.bfloat16, torch.float32


@pytest.fixture
def cuda_backend(monkeypatch):
    """megatron_opt.ops.cuda over a stand-in ``_C`` that records ``pass2`` calls, taking CPU tensors. The stand-in
    replaces the package attribute too: where the extension is built (CI), ``from .. import _C`` finds the real
    module there first."""
    launches = []
    fake = types.ModuleType("megatron_opt._C")
    fake.pass2 = lambda *args: launches.append(args)
    monkeypatch.setitem(sys.modules, "megatron_opt._C", fake)
    monkeypatch.setattr(mo, "_C", fake, raising=False)
    monkeypatch.delitem(sys.modules, "megatron_opt.ops.cuda", raising=False)
    monkeypatch.setattr(ops, "cuda", getattr(ops, "cuda", None), raising=False)  # restored (or removed) after
    cuda = importlib.import_module("megatron_opt.ops.cuda")
    assert cuda.kernels is fake
    monkeypatch.setattr(cuda, "cuda_device", lambda op, grad: grad.device)
    yield cuda, launches


def _plan(states: tuple[torch.dtype, ...], n: int = 40) -> ops.StepPlan:
    g = torch.linspace(-1, 1, n)
    shard = ops.ShardOperands(full_table(n), g, torch.linspace(0.5, -0.5, n),
                              tuple(torch.full((n,), 0.01).to(d) for d in states), torch.zeros(n, dtype=BF16))
    return ops.StepPlan((shard,))


def _staged(lr: float = 1e-2, wd: float = 0.1) -> ops.LrWdTable:
    return ops.DeviceHyperparams(1, torch.device("cpu")).update([lr], [wd])


@pytest.mark.parametrize("rule, states, constants, reads_step", [
    (mo.AdamW(beta1=0.8, beta2=0.99, eps=1e-6, stochastic_rounding=False), (F32, F32), [0.8, 0.99, 1e-6], True),
    (mo.SGD(momentum=0.7, nesterov=True), (F32,), [0.7, 1.0], False),
    (mo.Lion(beta1=0.9, beta2=0.95), (F32,), [0.9, 0.95], False),
])
def test_the_cuda_backend_launches_the_rules_kernel_with_its_declared_constants(cuda_backend, rule, states, constants,
                                                                                reads_step):
    cuda, launches = cuda_backend
    plan, staged, step = _plan(states), _staged(), torch.ones(1, dtype=torch.int64)
    record = rule.op_record(rule=rule, grad_scale=torch.ones(1), **({"step": step} if reads_step else {}))
    cuda.update(plan, staged, record)
    (args,) = launches
    assert args[0] == rule.op_record.op and args[8] is staged.table  # the device table, not a copy
    assert args[-1] == constants and (args[11] is step if reads_step else args[11] is None)


def test_without_a_kernel_for_the_plan_the_cuda_backend_runs_the_reference_with_the_staged_host_values(
        cuda_backend, monkeypatch):
    cuda, launches = cuda_backend
    rule = mo.AdamW(exp_avg_dtype=F32, exp_avg_sq_dtype=BF16)  # no kernel for this moment pair
    plan, reference = _plan((F32, BF16)), _plan((F32, BF16))
    staged = _staged()
    monkeypatch.setattr(ops.LrWd, "from_table", classmethod(lambda cls, t: pytest.fail("read the table back")))
    step = torch.ones(1, dtype=torch.int64)
    cuda.update(plan, staged, AdamWStep(rule=rule, grad_scale=torch.ones(1), step=step))
    assert not launches
    AdamWStep(rule=rule, grad_scale=torch.ones(1), step=step).reference(reference.shards[0], staged.host)
    assert torch.equal(plan.shards[0].master, reference.shards[0].master)


def test_an_op_record_reads_the_rules_constants():
    for record in {rule.op_record for rule in RULES if rule.op_record}:
        fields = {f.name for f in dataclasses.fields(record)}
        assert fields <= {"rule", "grad_scale", "found_inf", "step"}, (record.__name__, fields)
    assert {rule.op_record for rule in RULES if rule.op_record} >= {AdamWStep, SGDStep, LionStep}


def _calls_into_the_front(cls: type) -> list[str]:
    """Where a class's methods use the ops front (``ops.<name>``): an op record must not."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return [f"{cls.__name__} uses ops.{n.attr}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "ops"]


def test_no_call_back_up():
    """An op record never calls the front; the ops backends never import optimizer/ (test_layering.py) nor
    call a rule's ``apply``; the front has no per-rule launch helper for a record to call back."""
    records = [rule.op_record for rule in RULES if rule.op_record is not None]
    offenders = [o for r in records for o in _calls_into_the_front(r)]
    assert not offenders, offenders
    assert not hasattr(ops, "cuda_launch")
    for path in sorted((PACKAGE / "ops").glob("*.py")):
        calls = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute) and n.attr == "apply"]
        assert not calls, f"{path.name} calls a rule's apply"


def test_no_host_values_hidden_on_tensors():
    """Nothing in ops/ sets an attribute on a tensor: no ``setattr`` and no ``<tensor>._megatron_opt...``."""
    offenders = []
    for path in sorted((PACKAGE / "ops").glob("*.py")):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setattr":
                offenders.append(f"{path.name}:{n.lineno} setattr")
            if isinstance(n, ast.Attribute) and n.attr.startswith("_megatron_opt"):
                offenders.append(f"{path.name}:{n.lineno} .{n.attr}")
    assert not offenders, offenders
    staged = ops.lr_wd_table([1e-3], [0.0], torch.device("cpu"))
    assert isinstance(staged, ops.LrWdTable) and list(staged.host.lr) == [1e-3]
