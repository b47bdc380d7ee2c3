"""The boundary between distributed/ and optimizer/, the single step driver, update rules as classes."""
from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest
import torch

import megatron_opt as mo
import megatron_opt.ops as ops
from megatron_opt.optimizer.rules import SGDStep
from tests.support.common import TinyLM, build

from tests.distributed import cases_boundary

PACKAGE = pathlib.Path(mo.__file__).parent


def _dense_expert_model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    for p in model[1].parameters():
        p.allreduce = False  # expert-parallel: its own buffer and its own child optimizer
    return model


def _backward(ddp: mo.DistributedDataParallel, seed: int = 0) -> None:
    ddp.zero_grad_buffer()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    ddp(x).square().sum().backward()


# ----------------------------------------------------------------------------- module boundary
def test_optimizer_imports_only_the_shard_view_from_distributed():
    allowed = {"shard_view"}
    offenders = []
    for path in sorted((PACKAGE / "optimizer").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and "distributed" in node.module.split("."):
                module = node.module.split(".")[-1]
                names = {a.name for a in node.names}
                if module != "shard_view" and not (module == "distributed" and names <= allowed):
                    offenders.append(f"{path.name}: from {'.' * node.level}{node.module} import {sorted(names)}")
    assert not offenders, offenders


GRAD_SOURCE = {"param_gather", "step_id", "grads_received", "local_shards", "finish_grad_sync", "start_param_sync",
               "finish_param_sync"}


def _attribute_reads(folder: str) -> list[tuple[str, int, str]]:
    """(file, line, attribute name) of every attribute read in the package folder's modules."""
    return [(path.name, node.lineno, node.attr) for path in sorted((PACKAGE / folder).rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)]


def test_the_optimizer_knows_a_chunk_only_through_the_grad_source_protocol():
    """The protocol is the declared calls plus typed facts (ParamGather), never the chunk's whole DDP config;
    verify mode reads a leaf through its declared views, never its store; which groups sum the statistics
    is left to the shard view's functions (no optimizer module reads a stats role's groups)."""
    assert {n for n in vars(mo.GradSource) if not n.startswith("_")} == GRAD_SOURCE
    reads = _attribute_reads("optimizer")
    offenders = [f"{f}:{line} reads .{attr}" for f, line, attr in reads
                 if attr in ("ddp_config", "spans_model_parallel") or (f == "step_verifier.py" and attr == "store")]
    assert not offenders, offenders
    ddp, _ = build(TinyLM())
    assert isinstance(ddp.param_gather, mo.ParamGather) and ddp.param_gather.use_distributed_optimizer


def test_local_shards_are_frozen_views_of_the_buffers():
    ddp, _ = build(TinyLM(torch.bfloat16))
    shards = ddp.local_shards()
    assert shards and ddp.local_shards() == shards  # built once
    shard = shards[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        shard.grad = torch.zeros(1)  # type: ignore[misc]
    with pytest.raises(TypeError):
        shard.params[0] = None  # type: ignore[index]
    names = {s.names[pc.param_index] for s in shards for pc in s.pieces}
    assert names == {n for n, p in ddp.module.named_parameters()}
    # The grad view is the buffer's memory: writing it is visible in the param's main_grad.
    pc = shard.pieces[0]
    param = shard.params[pc.param_index]
    shard.grad[pc.shard_range.start] = 7.0
    assert float(param.main_grad.reshape(-1)[pc.param_range.start]) == 7.0


# ----------------------------------------------------------------------------- one driver, one clock
def test_step_state_is_idle_again_after_zero_grad_buffer():
    model = TinyLM()
    ddp, opt = build(model)
    assert opt.step_state is mo.StepState.IDLE
    ddp.zero_grad_buffer()
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    assert opt.step()[0]
    assert opt.step_state is mo.StepState.STEPPED
    ddp.zero_grad_buffer()
    assert opt.step_state is mo.StepState.IDLE


def test_stepping_a_child_of_a_chained_optimizer_raises():
    ddp = mo.DistributedDataParallel(_dense_expert_model(), mo.DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True))
    opt = mo.get_megatron_optimizer(mo.OptimizerConfig(lr=1e-2, use_distributed_optimizer=True), ddp)
    assert isinstance(opt, mo.ChainedOptimizer) and len(opt.chained_optimizers) == 2
    dense, expert = opt.chained_optimizers
    _backward(ddp)
    for child in (dense, expert):
        for call in (child.step, child.prepare_grads, child.step_with_ready_grads, child.zero_grad,
                     lambda c=child: c.clip_grad_norm(1.0)):
            with pytest.raises(mo.StepOrderError, match="ChainedOptimizer"):
                call()
    before = {k: v.clone() for k, v in opt.local_state_tensors().items()}
    assert opt.step()[0]  # the refused calls changed nothing, so the chain's step is its first
    assert any(not torch.equal(before[k], v) for k, v in opt.local_state_tensors().items())
    # The children read the chain's clock, not a stale one of their own.
    assert dense.step_state is expert.step_state is opt.step_state is mo.StepState.STEPPED
    assert dense.grad_scaler is opt.grad_scaler and dense.skipped_steps == opt.skipped_steps == 0
    with pytest.raises(ValueError, match="one ChainedOptimizer"):
        mo.ChainedOptimizer([dense, expert])


# ----------------------------------------------------------------------------- update rules
class _HalfStepSGD(mo.UpdateRule):
    """SGD without momentum that moves half as far: proves a rule is one class the optimizer calls."""

    name = "half-sgd"

    def state_dtypes(self):
        return {"calls": torch.float64}

    def apply(self, plan, *, lr_wd, grad_scale, step, backend, found_inf=None):
        half = ops.lr_wd_table([lr / 2 for lr in lr_wd.host.lr], lr_wd.host.weight_decay, lr_wd.table.device)
        for s in plan.shards:  # shard state: state_dtypes()'s tensors in order
            s.state[0].add_(1)
            ops.update(ops.StepPlan((ops.ShardOperands(s.table, s.grad, s.master, (), s.param_out),)),
                       SGDStep(rule=mo.SGD(momentum=0.0), grad_scale=grad_scale), lr_wd=half, backend=backend)


def test_a_custom_update_rule_is_one_class():
    torch.manual_seed(0)
    model_a, model_b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    model_b.load_state_dict(model_a.state_dict())
    cfg_kw = dict(lr=0.5, optimizer="sgd", sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0)
    ddp_a = mo.DistributedDataParallel(model_a, mo.DistributedDataParallelConfig(use_distributed_optimizer=True))
    ddp_b = mo.DistributedDataParallel(model_b, mo.DistributedDataParallelConfig(use_distributed_optimizer=True))
    opt_a = mo.DistributedOptimizer(mo.OptimizerConfig(use_distributed_optimizer=True, **{**cfg_kw, "lr": 0.25}),
                                    [ddp_a])
    opt_b = mo.DistributedOptimizer(mo.OptimizerConfig(use_distributed_optimizer=True, **cfg_kw), [ddp_b],
                                    update_rule=_HalfStepSGD())
    assert opt_b.update_rule.name == "half-sgd"
    state = opt_b.local_state_tensors()
    assert [t.dtype for k, t in state.items() if k.endswith(".calls")] == [torch.float64]
    for ddp, opt in ((ddp_a, opt_a), (ddp_b, opt_b)):
        _backward(ddp, seed=3)
        assert opt.step()[0]
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb)
    assert all(float(t.reshape(-1)[0]) == 1.0 for k, t in opt_b.local_state_tensors().items() if k.endswith(".calls"))


@pytest.mark.parametrize("name, cls, state", [("adam", mo.AdamW, {"exp_avg", "exp_avg_sq"}),
                                              ("sgd", mo.SGD, {"momentum_buffer"}), ("lion", mo.Lion, {"exp_avg"})])
def test_config_selects_the_rule_and_its_state(name, cls, state):
    _, opt = build(TinyLM(), optimizer=name)
    assert type(opt.update_rule) is cls
    names = {k.split(".", 1)[1] for k in opt.local_state_tensors() if "." in k}
    assert names == state | {"master"}
    entry = next(iter(opt.state.values()))
    assert set(entry) == state | {"step"}


# ----------------------------------------------------------------------------- ops backend argument
def test_ops_backend_is_an_argument_and_the_environment_overrides_it(monkeypatch):
    grad = torch.randn(256)
    table = ops.full_table(256)
    results = {}
    for backend in ("cpu", "reference"):
        stats = torch.zeros(3, dtype=torch.float64)
        ops.grad_stats(ops.StepPlan((ops.ShardOperands(table, grad),), update=False), torch.ones(1), stats, True,
                       backend=backend)
        results[backend] = stats
    # the CPU pass sums fp32 blocks, the reference float64 elements (tests/kernels/test_ops_cpu.py bounds it)
    assert torch.allclose(results["cpu"], results["reference"], rtol=1e-6)
    assert ops.resolve_backend(grad) == "cpu"
    assert ops.resolve_backend(grad, "reference") == "reference"
    monkeypatch.setenv("MEGATRON_OPT_OPS", "reference")
    assert ops.resolve_backend(grad, "cpu") == "reference"
    monkeypatch.setenv("MEGATRON_OPT_OPS", "fast")
    with pytest.raises(ValueError, match="MEGATRON_OPT_OPS='fast'"):
        ops.resolve_backend(grad)
    monkeypatch.delenv("MEGATRON_OPT_OPS")
    with pytest.raises(ValueError, match="backend='gpu'"):
        ops.grad_stats(ops.StepPlan((ops.ShardOperands(table, grad),), update=False), torch.ones(1),
                       torch.zeros(3, dtype=torch.float64), backend="gpu")


# ----------------------------------------------------------------------------- profiler ranges
def test_step_is_profiled_by_phase():
    model = TinyLM()
    ddp, opt = build(model)
    ddp.zero_grad_buffer()
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert opt.step()[0]
    names = {e.key for e in prof.key_averages()}
    for phase in ("finish_grad_sync", "pass1", "stats_allreduce", "pass2", "param_sync"):
        assert f"megatron_opt.{phase}" in names


# ----------------------------------------------------------------------------- gather_main_params
@pytest.mark.parametrize("world", [1, 3])
def test_gather_main_params_reassembles_every_param(pools, world):
    for res in pools(world).run(cases_boundary.gather_main_params_case):
        assert res["names_match"]
        assert res["fp32_equal"], "fp32 masters alias the params: the gathered masters must equal them bitwise"
        assert res["bf16_rounds_to_params"], "bf16 params are the rounded masters"
        assert res["identical_across_ranks"]
