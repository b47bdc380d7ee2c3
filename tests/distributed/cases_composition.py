"""Worker-side case of the composition fuzzer (test_composition_fuzz.py): one combination of the
features that compose in a step (DP size, partial sharding, param and state precision, overlap,
buckets, loss normalisation, clipping, update rule, dense + expert chain) trained for a few steps
with verify mode raising at every step, against the single-process float64 reference of
cases_parity (MasterWeightReference); and the Muon axis (run_muon_combination) against
tests/support/reference_muon.py."""
from __future__ import annotations

import torch
import torch.distributed as dist

import megatron_opt as mo
from tests.distributed import cases_muon
from tests.distributed.cases_parity import MasterWeightReference
from tests.support import reference_adaptive_muon as ram
from tests.support import reference_muon as rm
from tests.support.common import (TinyLM, assert_identical_across_ranks, flat_params, global_batch, microbatch_contexts,
                    rank_microbatches, rel_l2, token_loss_sum, train_with_reference, whole_from_parts)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BF16, FP16 = torch.bfloat16, torch.float16
STATES = {  # OptimizerConfig fields of each optimizer-state option (precision-aware: AdamW only)
    "fp32": {},
    "bf16_moments": dict(use_precision_aware_optimizer=True, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16,
                         store_param_remainders=False),
    "bf16_moments_remainders": dict(use_precision_aware_optimizer=True, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16),
    "fp16_moments_fp16_master": dict(use_precision_aware_optimizer=True, exp_avg_dtype=FP16, exp_avg_sq_dtype=FP16,
                                     main_params_dtype=FP16),
    "bf16_stochastic": dict(use_precision_aware_optimizer=True, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16,
                            stochastic_rounding=True),
}


def _build(model: torch.nn.Module, c: dict):
    ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(
        use_distributed_optimizer=c["sharded"], grad_reduce_in_fp32=c["grad_fp32"], overlap_grad_reduce=c["overlap"],
        overlap_param_gather=c["overlap"] and c["sharded"], bucket_size=c["bucket_size"],
        num_distributed_optimizer_instances=c["instances"]))
    precision = {"fp32": {}, "bf16": dict(bf16=True), "fp16": dict(fp16=True, initial_loss_scale=2.0**10)}
    opt = mo.get_megatron_optimizer(mo.OptimizerConfig(
        optimizer=c["optimizer"], lr=c["lr"], weight_decay=0.1, clip_grad=c["clip_grad"],
        use_distributed_optimizer=c["sharded"], verify_interval=1, verify_action="raise",
        **precision[c["precision"]], **STATES[c["state"]]), ddp)
    return ddp, opt


def _per_token_reference_step(ref: MasterWeightReference, batches: list, clip_grad: float, tokens: int) -> float:
    """MasterWeightReference.step for a per-token loss: the sum of every token's loss over the global
    batch, divided once by the global token count (16-bit models backpropagate the sum in their dtype,
    as the ranks do)."""
    ref.opt.zero_grad()
    for p in ref.compute.parameters():
        p.grad = None
    for x, y in batches:
        loss_sum, _ = token_loss_sum(ref.compute(x), y)
        if ref.compute is ref.masters:
            (loss_sum / tokens).backward()
            continue
        loss_sum.backward()
        for m, c in zip(ref.masters.parameters(), ref.compute.parameters()):
            g = c.grad.double() / tokens
            m.grad = g if m.grad is None else m.grad + g
            c.grad = None
    norm = torch.nn.utils.clip_grad_norm_(ref.masters.parameters(), clip_grad if clip_grad > 0 else float("inf"))
    ref.opt.step()
    if ref.compute is not ref.masters:
        with torch.no_grad():
            for m, c in zip(ref.masters.parameters(), ref.compute.parameters()):
                c.copy_(m)
    return float(norm)


def _train_per_token(ddp, opt, ref: MasterWeightReference, c: dict) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(c["steps"]):
        batches = global_batch(world * c["ga"], seed=200 + step, ragged=True)
        tokens = int(sum(int((y != -100).sum()) for _, y in batches))
        ddp.zero_grad_buffer()
        opt.zero_grad()
        for ctx, (x, y) in zip(microbatch_contexts(ddp, c["ga"]), rank_microbatches(batches, rank, world)):
            with ctx:
                opt.scale_loss(token_loss_sum(ddp(x), y)[0]).backward()
        ddp.set_loss_divisor(tokens)
        success, _, _ = opt.step()
        assert success, f"step {step} skipped unexpectedly"
        _per_token_reference_step(ref, batches, c["clip_grad"], tokens)


def run_combination(c: dict) -> dict:
    """Train combination ``c`` with verify mode; returns the update error per param against the
    float64 reference, the verify report, and the error (type: message) if one was raised."""
    world = dist.get_world_size()
    model = TinyLM(DTYPES[c["precision"]], seed=c["seed"])
    if c["chained"]:  # 'expert' params over the data-parallel group: dense + expert children, same maths
        model.keep_a.allreduce = False
        model.keep_d.allreduce = False
    ref = MasterWeightReference(model, c["lr"], 0.1, c["optimizer"])
    init = {n: p.detach().double().clone() for n, p in ref.masters.named_parameters()}
    try:
        ddp, opt = _build(model, c)
        if c["loss"] == "mean":
            train_with_reference(ddp, opt, c["ga"], c["steps"],
                                 lambda batches: ref.step(batches, c["clip_grad"], world))
        else:
            _train_per_token(ddp, opt, ref, c)
        if ddp.ddp_config.overlap_param_gather:
            ddp.finish_param_sync()
        assert_identical_across_ranks(flat_params(model))
        masters = opt.gather_main_params()
    except (AssertionError, mo.MegatronOptError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    report = opt.verify_report
    errors = {name: rel_l2(masters[name].double() - init[name], p.detach() - init[name])
              for name, p in ref.masters.named_parameters()}
    return {"error": None, "errors": errors, "verified": report.verified_steps, "kind": type(opt).__name__}




# ----------------------------------------------------------------------------- the Muon axis
def _muon_loss(model: torch.nn.Module, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x).reshape(-1, cases_muon.VOCAB).float(), t.reshape(-1))


def _whole_state(opt, state: str, shapes: dict) -> dict[str, torch.Tensor]:
    """Whole tensors of ``state`` ('master', 'momentum_buffer') from every rank's state_dict part (its
    owned ranges), as saved."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, opt.state_dict()["state"].get(state, {}))
    return whole_from_parts(parts, shapes)


def run_muon_combination(c: dict) -> dict:
    """Train Muon combination ``c`` (cases_muon.MuonNet: a split QKV matrix and matrices straddling the
    shards) with verify mode raising at every step, against tests/support/reference_muon.py in float64 on
    the same global batch; per step the worst param error (relative to the reference's change since the
    start; the fp32 masters), the whole model's (update: rel L2 over all params), the worst momentum error
    (relative) and the grad-norm error, or the error (type: message) if one was raised. ``c["moment2"]``
    'adamuon' / 'normuon' (absent or None: Muon): AdaptiveMuon with that second moment, against
    tests/support/reference_adaptive_muon.py."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(c["seed"])
    model = cases_muon.MuonNet()
    if c["precision"] == "bf16":
        model = model.bfloat16()
        model.emb.weight.is_embedding_or_output_parameter = True
        model.attn.linear_qkv.weight.qkv_split_shapes = cases_muon.SPLIT
    ref = cases_muon.MuonNet()
    ref.load_state_dict(model.state_dict())  # from the (rounded) weights the ranks start from
    ref = ref.double()
    opt_kw = dict(momentum=c["momentum"], nesterov=c["nesterov"], num_ns_steps=c["ns_steps"],
                  scale_mode=c["scale_mode"], extra_scale_factor=c["extra_scale"], split_qkv=c["split_qkv"])
    moment2 = c.get("moment2")
    if moment2 is None:
        reference = rm.reference_muon(ref, c["lr"], c["wd"], split_shapes=cases_muon.SPLIT, **opt_kw)
    else:
        reference = ram.reference_adaptive_muon(ref, c["lr"], c["wd"], split_shapes=cases_muon.SPLIT,
                                                moment2_method=moment2, **opt_kw)
    ref_params = dict(ref.named_parameters())
    initial = {n: p.detach().clone() for n, p in ref_params.items()}
    muon_names = sorted(n for n, p in model.named_parameters() if rm.uses_muon(p))
    out = dict(error=None, param=[], update=[], momentum=[], norm=[], verified=None)
    try:
        ddp = mo.DistributedDataParallel(model, mo.DistributedDataParallelConfig(
            use_distributed_optimizer=c["sharded"], grad_reduce_in_fp32=c["grad_fp32"],
            overlap_grad_reduce=c["overlap"], overlap_param_gather=c["overlap"] and c["sharded"],
            bucket_size=c["bucket_size"]))
        opt = mo.get_megatron_optimizer(mo.OptimizerConfig(
            optimizer="muon" if moment2 is None else "adaptive_muon", lr=c["lr"], weight_decay=c["wd"],
            clip_grad=c["clip_grad"], bf16=c["precision"] == "bf16",
            use_distributed_optimizer=c["sharded"], muon_momentum=c["momentum"], muon_nesterov=c["nesterov"],
            muon_num_ns_steps=c["ns_steps"], muon_scale_mode=c["scale_mode"], muon_extra_scale_factor=c["extra_scale"],
            muon_split_qkv=c["split_qkv"], muon_fp32_matmul_prec=c["matmul_prec"], verify_interval=1,
            verify_action="raise", adaptive_muon_moment2_method=moment2 or "adamuon"), ddp)
        for step in range(c["steps"]):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            for i, ctx in enumerate(microbatch_contexts(ddp, c["ga"])):
                with ctx:
                    (_muon_loss(ddp, *cases_muon.batch(c["seed"] + 100 * step + i, rank)) / c["ga"]).backward()
            success, norm, _ = opt.step()
            assert success, f"step {step} skipped unexpectedly"
            reference.zero_grad()
            for r in range(world):
                for i in range(c["ga"]):
                    (_muon_loss(ref, *cases_muon.batch(c["seed"] + 100 * step + i, r)) / (world * c["ga"])).backward()
            clip = c["clip_grad"] if c["clip_grad"] > 0 else float("inf")
            ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip))
            reference.step()
            if ddp.ddp_config.overlap_param_gather:
                ddp.finish_param_sync()
            out["norm"].append(abs(norm - ref_norm) / ref_norm)
            # The fp32 masters: bf16 params would add their rounding (2^-9 |W|) to a small change.
            masters = _whole_state(opt, "master", {n: tuple(p.shape) for n, p in ref_params.items()})
            diff = {n: (masters[n].double() - ref_params[n].detach(), ref_params[n].detach() - initial[n])
                    for n in ref_params}
            out["param"].append(max(float(d.norm() / change.norm().clamp_min(1e-30)) for d, change in diff.values()))
            out["update"].append(float(sum(d.norm() ** 2 for d, _ in diff.values()).sqrt() /
                                       sum(change.norm() ** 2 for _, change in diff.values()).sqrt()))
            momentum = _whole_state(opt, "momentum_buffer", {n: tuple(ref_params[n].shape) for n in muon_names})
            out["momentum"].append(max(float((momentum[n] - reference.state[ref_params[n]]["momentum_buffer"]).norm() /
                                             reference.state[ref_params[n]]["momentum_buffer"].norm())
                                       for n in muon_names))
        assert_identical_across_ranks(flat_params(model))
        out["verified"] = opt.verify_report.verified_steps
    except (AssertionError, mo.MegatronOptError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


__all__ = ["run_combination", "run_muon_combination", "STATES"]
