"""Worker-side cases for SOAP (optimizer='soap') through the distributed optimizer.

SOAP's first steps read rounding noise: a gradient rotated into the eigenbases of its own factors is nearly
diagonal, and Adam's normalisation (M / (sqrt(V) + eps)) lifts the off-diagonal noise (~1e-7 of the gradient in
fp32) to +-1 wherever it exceeds eps. Two fp32 runs whose gradients differ in the last bit then differ by O(1)
of an update, and fp32 against float64 too (docs/muon.md, "SOAP": a one-ulp change of an 8 x 8 gradient moves
emerging-optimizers' own first update by 86%). So the comparison here feeds SOAP exact gradients: the loss is
linear in the matrices, sum(W * C) with small integer C per rank and step, so the reduced gradient (an exact sum
times fp32(1 / DP), as the optimizer applies it) is the same bits on every layout, and the reference is
emerging-optimizers' SOAP (megatron-core's configuration, fp32) fed those bits.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import megatron_opt as mo
import megatron_opt.checkpoint as ckpt

SHAPES = {"a": (10, 10), "b": (12, 10), "c": (7, 13)}  # 100 + 120 + 91 elements: straddling the shards at DP 2-4
MATRICES = sorted(f"{n}.weight" for n in SHAPES)
LR, WEIGHT_DECAY, BETAS = 0.02, 0.1, (0.9, 0.95)


class SoapNet(torch.nn.Module):
    """Three matrices (SOAP's: 2-D, not marked as embedding or output) and a loss linear in them."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(11)
        for name, shape in SHAPES.items():
            layer = torch.nn.Linear(shape[1], shape[0], bias=False)
            with torch.no_grad():
                layer.weight.copy_(torch.randn(shape, generator=g) * 0.4)
            self.add_module(name, layer)

    def forward(self, coefficients: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((getattr(self, n).weight * c).sum() for n, c in coefficients.items())


def coefficients(step: int, rank: int) -> dict[str, torch.Tensor]:
    """Integers in [-8, 8]: every sum over ranks is exact in fp32."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {n: torch.randint(-8, 9, shape, generator=g).float() for n, shape in SHAPES.items()}


def exact_gradient(step: int, world: int) -> dict[str, torch.Tensor]:
    """The global gradient as the optimizer applies it: the exact sum over ranks times fp32(1 / world)."""
    scale = torch.tensor(1.0 / world, dtype=torch.float32)
    return {f"{n}.weight": sum(coefficients(step, r)[n] for r in range(world)) * scale for n in SHAPES}


# ``blocks``: a TP1 run that keeps the blocks of a TP2 split (matrix_state_tp_size 2): 'a' split over TP by rows, 'b'
# by columns (megatron-core's tensor_model_parallel / partition_dim attributes, which it sets at TP1 too), 'c' not
# split (whole). The reference then runs emerging-optimizers' SOAP on each block as its own param. The halves are
# far from square ('a''s 5 x 10: R is rank 5 of 10), so the rotated gradient has whole null-space columns of
# rounding noise, which eps 1e-8 lifts to +-1 (the module docstring) wherever two GEMMs round apart (the fuzzer
# found 0.49 of a change at DP 3 with plain Shampoo); SOAP's eps 1.0 (BLOCKS_EPS, both sides) keeps it continuous.
BLOCKS_EPS = 1.0
TP_SPLIT = {"a.weight": 0, "b.weight": 1}
HOMED_BLOCKS = ["a.weight@0,0", "a.weight@5,0", "b.weight@0,0", "b.weight@0,5", "c.weight"]  # their state_dict keys


def blocks_of(name: str, t: torch.Tensor, blocks: bool) -> list[torch.Tensor]:
    """The blocks of ``t`` (param ``name``) whose state SOAP keeps apart: its TP2 halves with ``blocks``, else it."""
    return list(t.chunk(2, dim=TP_SPLIT[name])) if blocks and name in TP_SPLIT else [t]


def build(use_kl_shampoo: bool = True, shampoo_beta: float = 0.95, instances: int = 1, overlap: bool = True,
          bucket_size=None, sharded: bool = True, weight_decay: float = WEIGHT_DECAY, blocks: bool = False,
          **options):
    """``instances``: partial sharding (num_distributed_optimizer_instances): each instance homes every matrix;
    ``sharded`` False: no distributed optimizer (every rank homes every matrix); ``blocks``: see TP_SPLIT."""
    model = SoapNet()
    if blocks:
        for name, dim in TP_SPLIT.items():
            param = model.get_parameter(name)
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, 1
        options["rule_constants"] = {"matrix_state_tp_size": 2, "soap_eps": BLOCKS_EPS}
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(
        use_distributed_optimizer=sharded, overlap_grad_reduce=overlap, overlap_param_gather=overlap and sharded,
        grad_reduce_in_fp32=True, num_distributed_optimizer_instances=instances, bucket_size=bucket_size))
    cfg = mo.OptimizerConfig(optimizer="soap", lr=LR, weight_decay=weight_decay, clip_grad=0.0,
                             adam_beta1=BETAS[0], adam_beta2=BETAS[1], use_distributed_optimizer=sharded,
                             soap_use_kl_shampoo=use_kl_shampoo, soap_shampoo_beta=shampoo_beta, **options)
    return model, ddp, mo.get_megatron_optimizer(cfg, ddp)


def _step(ddp, opt, step: int, same_on_every_rank: bool = False):
    """One step; ``same_on_every_rank``: every rank's coefficients are rank 0's, so the reduced gradient (an exact
    multiple, times fp32(1 / DP)) is the same bits at every DP size (1, 2, 3 and 4)."""
    ddp.zero_grad_buffer()
    ddp(coefficients(step, 0 if same_on_every_rank else dist.get_rank())).backward()
    out = opt.step()
    ddp.finish_param_sync()
    return out


def train(steps: int, use_kl_shampoo: bool = True, shampoo_beta: float = 0.95, instances: int = 1,
          blocks: bool = False, **layout) -> dict:
    """``steps`` steps of megatron_opt's SOAP and of emerging-optimizers' fed the same exact gradient (``blocks``: on
    each kept block as its own param, TP_SPLIT): per step the params' error relative to the change since the start,
    the grad norm's, and this rank's homed L and R against the reference's; the homed matrices' (blocks')
    state_dict keys; the steps verified (``verify_interval`` in ``layout``: verify mode, raising)."""
    from emerging_optimizers.soap.soap import SOAP as EmergingSOAP

    world = dist.get_world_size()
    model, ddp, opt = build(use_kl_shampoo, shampoo_beta, instances, blocks=blocks, **layout)
    initial = {n: p.detach().clone() for n, p in SoapNet().named_parameters()}
    ref = {(n, b): torch.nn.Parameter(block.clone())
           for n, t in initial.items() for b, block in enumerate(blocks_of(n, t, blocks))}
    reference = EmergingSOAP(list(ref.values()), lr=LR, betas=BETAS, shampoo_beta=shampoo_beta,
                             eps=BLOCKS_EPS if blocks else 1e-8,
                             weight_decay=layout.get("weight_decay", WEIGHT_DECAY), use_kl_shampoo=use_kl_shampoo)
    out = dict(success=[], param_err=[], norm_err=[], factor_err=[], homed=[])
    for step in range(steps):
        success, norm, _ = _step(ddp, opt, step)
        grads = exact_gradient(step, world)
        for (n, b), p in ref.items():
            p.grad = blocks_of(n, grads[n], blocks)[b].clone()
        reference.step()
        out["success"].append(bool(success))
        ref_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))
        out["norm_err"].append(abs(norm - ref_norm) / ref_norm)
        whole = {n: torch.cat([ref[(n, b)].detach() for b in range(len(blocks_of(n, t, blocks)))],
                              dim=TP_SPLIT.get(n, 0)) for n, t in initial.items()}
        out["param_err"].append({n: float((p.detach() - whole[n]).norm() / (whole[n] - initial[n]).norm())
                                 for n, p in model.named_parameters()})
        homed = opt.state_dict().get("matrix_state", {})
        out["homed"] = sorted(homed.get("L", {}))
        out["state_dtypes"] = sorted({(name, str(t.dtype)) for name, per in homed.items() for t in per.values()})
        errs = {}
        for f in ("L", "R"):
            for key, t in homed.get(f, {}).items():
                name, _, offset = key.partition("@")  # a kept block's key: '<name>@<offset>'
                theirs = reference.state[ref[(name, int(any(int(o) for o in offset.split(","))) if offset else 0)]][f]
                errs[f"{key}:{f}"] = float((t - theirs).norm() / theirs.norm())
        out["factor_err"].append(errs)
    out["verified"] = opt.verify_report.verified_steps if opt.verify_report is not None else 0
    return out


def blocks_refused(change: str) -> str:
    """matrix_state_tp_size 2 at TP1 over a layout it cannot cut (``change``: 'size' asks for 3 blocks of 'a''s 10
    rows; 'stride' marks 'a' split with stride 2, as SwiGLU's fc1): the message raised, or 'built'."""
    model = SoapNet()
    for name, dim in TP_SPLIT.items():
        param = model.get_parameter(name)
        param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, 1
    if change == "stride":
        model.a.weight.partition_stride = 2
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(use_distributed_optimizer=True))
    size = 3 if change == "size" else 2
    try:
        mo.get_megatron_optimizer(mo.OptimizerConfig(optimizer="soap", lr=LR, use_distributed_optimizer=True,
                                                     rule_constants={"matrix_state_tp_size": size}), ddp)
    except mo.UnsupportedConfigError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "built"


def resume(path: str, phase: str, steps: int, resave_path: str = "") -> dict:
    """'straight': ``steps`` steps. 'first': half, then megatron_opt.checkpoint.save. 'second': load (at this pool's
    DP size), save again as ``resave_path``, then the other half. Returns the params and this rank's per-matrix
    state."""
    model, ddp, opt = build()
    half = steps // 2
    if phase == "straight":
        for step in range(steps):
            _step(ddp, opt, step, same_on_every_rank=True)
    elif phase == "first":
        for step in range(half):
            _step(ddp, opt, step, same_on_every_rank=True)
        ckpt.save(path, ddp, opt, iteration=half)
    else:
        ckpt.load(path, ddp, opt)
        ckpt.save(resave_path, ddp, opt, iteration=half)
        for step in range(half, steps):
            _step(ddp, opt, step, same_on_every_rank=True)
    return dict(params={n: p.detach().clone() for n, p in model.named_parameters()},
                matrix_state=opt.state_dict().get("matrix_state", {}))


def state_dict_round_trip(steps: int) -> dict:
    """The in-memory state_dict at the same DP size: save after ``steps``, train one more, load it into a fresh
    optimizer, train the same step: both must agree bitwise."""
    model, ddp, opt = build()
    for step in range(steps):
        _step(ddp, opt, step)
    saved = opt.state_dict()
    _step(ddp, opt, steps)
    straight = {n: p.detach().clone() for n, p in model.named_parameters()}
    model2, ddp2, opt2 = build()
    opt2.load_state_dict(saved)
    _step(ddp2, opt2, steps)
    again = {n: p.detach().clone() for n, p in model2.named_parameters()}
    return dict(equal={n: bool(torch.equal(straight[n], again[n])) for n in straight},
                homed=sorted(saved.get("matrix_state", {}).get("L", {})))


def skipped_step_changes_nothing() -> dict:
    """Contract: a step whose gradient is not finite (one rank's) is skipped on every rank and changes nothing: the
    params and the per-matrix state stay bitwise, and the next step runs as if it had not happened."""
    model, ddp, opt = build()
    _step(ddp, opt, 0)
    before = ({n: p.detach().clone() for n, p in model.named_parameters()}, opt.state_dict()["matrix_state"])
    ddp.zero_grad_buffer()
    coefficients_ = coefficients(1, dist.get_rank())
    if dist.get_rank() == 0:
        coefficients_["a"][0, 0] = float("inf")
    ddp(coefficients_).backward()
    success, _, _ = opt.step()
    ddp.finish_param_sync()
    after = ({n: p.detach().clone() for n, p in model.named_parameters()}, opt.state_dict()["matrix_state"])
    same_params = all(torch.equal(before[0][n], after[0][n]) for n in before[0])
    same_state = all(torch.equal(t, after[1][s][k]) for s, per in before[1].items() for k, t in per.items())
    return dict(success=bool(success), same_params=same_params, same_state=same_state,
                next_success=bool(_step(ddp, opt, 1)[0]))


def state_dict_without_matrix_state() -> str:
    """A state_dict whose per-matrix state was dropped must be refused, naming it, on every rank."""
    _, ddp, opt = build()
    _step(ddp, opt, 0)
    saved = opt.state_dict()
    saved.pop("matrix_state", None)
    try:
        opt.load_state_dict(saved)
    except ValueError as exc:
        return str(exc)
    return "loaded"


# ---------------------------------------------------------------------------------------------- verify mode
def _faulty(op_name: str, fault_step: int, calls: list, step_of: list):
    """torch.linalg.qr / torch.tensordot wrapped: on step ``fault_step`` (0-based) the first call's result gets 1e-3
    (relative to its largest element) added to one element: a compute fault inside SOAP's step at a home."""
    module, attr = (torch.linalg, "qr") if op_name == "qr" else (torch, "tensordot")
    real = getattr(module, attr)

    def faulty(*args, **kwargs):
        out = real(*args, **kwargs)
        if step_of[0] == fault_step and not calls:
            calls.append(1)
            target = out.Q if op_name == "qr" else out
            with torch.no_grad():
                target[0, 0] += 1e-3 * float(target.abs().max())
        return out

    return module, attr, real, faulty


def verified(steps: int, fault: str = "none", use_kl_shampoo: bool = True, weight_decay: float = WEIGHT_DECAY,
             fault_step: int = 2, gaussian: bool = False, **options) -> dict:
    """``steps`` steps with verify mode on every step (verify_action 'raise'), exact gradients (``gaussian``: real
    ones, Gaussian coefficients of varied scale per rank and step); ``fault``: 'qr' or
    'tensordot' (see _faulty) on every rank at step ``fault_step``, 'skip' (one rank's gradient not finite at that
    step). Returns this rank's outcome: the steps' successes, the steps verified and the error message if any."""
    _, ddp, opt = build(use_kl_shampoo, weight_decay=weight_decay, verify_interval=1, verify_action="raise",
                        **options)
    out = dict(success=[], verified=0, error=None)
    calls: list = []
    step_of = [-1]
    patched = None
    if fault in ("qr", "tensordot"):
        module, attr, real, faulty = _faulty(fault, fault_step, calls, step_of)
        setattr(module, attr, faulty)
        patched = (module, attr, real)
    try:
        for step in range(steps):
            step_of[0] = step
            if fault == "skip" and step == fault_step:
                ddp.zero_grad_buffer()
                c = coefficients(step, dist.get_rank())
                if dist.get_rank() == 0:
                    c["b"][1, 1] = float("nan")
                ddp(c).backward()
                success = opt.step()[0]
                ddp.finish_param_sync()
            elif gaussian:
                ddp.zero_grad_buffer()
                g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
                scale = 10.0 ** float(torch.randint(-4, 2, (), generator=g))
                ddp({n: torch.randn(shape, generator=g) * scale for n, shape in SHAPES.items()}).backward()
                success = opt.step()[0]
                ddp.finish_param_sync()
            else:
                success = _step(ddp, opt, step)[0]
            out["success"].append(bool(success))
    except Exception as exc:  # noqa: BLE001  (the test reads the message on every rank)
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if patched is not None:
            setattr(*patched)
    out["verified"] = opt.verify_report.verified_steps
    out["faulted"] = bool(calls)
    return out


__all__ = ["SoapNet", "MATRICES", "HOMED_BLOCKS", "train", "blocks_refused", "verified", "resume",
           "state_dict_round_trip", "state_dict_without_matrix_state"]
