"""Worker-side harness: megatron_opt's sharded Muon on megatron-core's MoE GPTModel under expert
parallelism (megatron-core's token dispatcher, schedule and finalize_model_grads; megatron_opt switched in
by install()), against tests/support/reference_muon.py in float64 on the whole model (all experts) and the
same global batches.

tests/mcore/cases_muon_model_parallel.py's run_muon does the same for dense layouts; this runner adds
what expert parallelism needs: expert params are counted once per expert data-parallel group (not per
dense DP group), their momentum is assembled from the expert DP group's state_dict parts (the ranks of the
dense DP group hold other experts under the same local names), and the optimizer's chain is checked to
hold [dense Muon, dense AdamW, expert Muon, expert AdamW].
"""
from __future__ import annotations


import torch
import torch.distributed as dist

from tests.mcore import cases_model_parallel as cmp
from tests.mcore import cases_muon_model_parallel as cmm
from tests.mcore import mcore_cpu
from tests.mcore.mcore_cpu import cpu_megatron_core

from megatron.core import parallel_state  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

import megatron_opt.megatron
from tests.mcore.cases_megatron import forward_step, global_batches

# 4 ranks each. Expert TP 2 runs with the all-gather dispatcher only (gloo cannot all-gather unequal token
# counts over expert TP with the all-to-all one; cases_model_parallel.LAYOUTS says the same).
LAYOUTS = {
    "ep2": cmp.Layout(ep=2, experts=4),  # dense DP 4, expert DP 2
    "ep2_etp2": cmp.Layout(ep=2, etp=2, experts=4, dispatcher="allgather"),  # expert DP 1, expert TP 2
}


def _is_expert(param: torch.Tensor) -> bool:
    return getattr(param, "allreduce", True) is False


def _counted(chunks: list, whole: dict) -> list:
    """(reference name, param) of the elements this rank counts (once in the world): dense params on DP
    rank 0, expert params on expert-DP rank 0 (each expert-parallel rank holds other experts)."""
    dp0 = parallel_state.get_data_parallel_rank() == 0
    edp0 = parallel_state.get_expert_data_parallel_rank() == 0
    return [(ref, p) for chunk in chunks for ref, p, counted in cmp.chunk_params(chunk, whole)
            if counted and (edp0 if _is_expert(p) else dp0)]


def _momentum_by_param(opt, ddps: list) -> dict:
    """Each local Muon param's whole (TP-local) momentum buffer: dense ones from the DP group's state_dict
    parts, expert ones from the expert DP group's."""
    part = opt.state_dict()["state"].get("momentum_buffer", {})
    gathered = {}
    for expert, group in ((False, parallel_state.get_data_parallel_group()),
                          (True, parallel_state.get_expert_data_parallel_group())):
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, part, group=group)
        gathered[expert] = parts
    return cmm.whole_by_param(ddps, lambda p: gathered[_is_expert(p)])


def assert_every_rank_ran(results: list, steps: int, chain: list) -> None:
    """Test side: every step succeeded on every rank, the chain's children are ``chain`` and megatron_opt's, and the
    replicas that must be bitwise equal are."""
    for r in results:
        assert r["success"] == [True] * steps, r["success"]
        assert r["children"] == chain, r["children"]
        assert r["optimizer_module"].startswith("megatron_opt."), r["optimizer_module"]
        failed = [k for k in ("dp_replicas_equal", "expert_dp_replicas_equal", "tp_copies_equal") if r.get(k) is False]
        assert not failed, f"replicas that must be bitwise equal differ: {failed}"


def train_step(ddps: list, opt, sched, mine: list, ga: int, mb: int, global_batch: int) -> tuple[bool, float]:
    """Megatron-LM's train_step on this rank's ``ga`` micro-batches ``mine``, the overlapped all-gather waited
    for: (success, grad norm)."""
    for ddp in ddps:
        ddp.zero_grad_buffer()
    opt.zero_grad()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(mine), model=ddps,
                                num_microbatches=ga, seq_length=mcore_cpu.SEQ, micro_batch_size=mb,
                                decoder_seq_length=None, forward_only=False)
    success, norm, _ = opt.step()
    sched.step(increment=global_batch)
    for ddp in ddps:
        ddp.finish_param_sync()
    return bool(success), norm


def run_muon_ep(layout_name: str, steps: int = 3, tp_mode: str = "duplicated", ga: int = 2, mb: int = 2,
                bucket_size: int = 4000, matmul_prec: str = "highest", optimizer: str = "muon",
                moment2_method: str = "adamuon") -> dict:
    """Train ``steps`` steps in the named EP layout (LAYOUTS) and the float64 reference; this rank's
    per-step figures (dense and expert apart), replica checks and the chain's children.

    ``tp_mode``: muon_tp_mode. The reference is the whole model at TP 1, which every mode matches at dense
    TP 1; at expert TP 2 only 'duplicated' and 'distributed' (the full matrix, TP-invariant) do. ``optimizer``
    'adaptive_muon' with ``moment2_method``: AdaptiveMuon, against its reference."""
    layout = LAYOUTS[layout_name]
    options = dict(tp_mode=tp_mode, overlap=True, nesterov=False, matmul_prec=matmul_prec, verify=False,
                   bucket_size=bucket_size, nonfinite_at=None, optimizer=optimizer, moment2_method=moment2_method)
    mcore_cpu.init_parallel_state()
    dp = dist.get_world_size() // (layout.tp * layout.pp)
    step_batches = global_batches(steps, dp, ga, mb)
    global_batch = dp * ga * mb
    with cpu_megatron_core():  # megatron-core 0.16.1's MoE router backward needs it (as cases_model_parallel's)
        reference = cmm._reference(layout, step_batches, dp, global_batch, options)
    init = reference["init"]
    out = {"param": [], "expert_param": [], "momentum": [], "expert_momentum": [], "norm": [], "success": []}
    with mcore_cpu.model_parallel_state(**layout.sizes()), cpu_megatron_core():
        megatron_opt.megatron.install()
        try:
            config = cmm.transformer_config(layout)
            chunks = cmp.build_chunks(layout, config, init)
            for chunk in chunks:
                cmm._tag_qkv(chunk)
            ddps, opt, sched = cmm._setup(chunks, config, global_batch, options)
            counted = _counted(chunks, init)
            dp_rank = parallel_state.get_data_parallel_rank()
            for k, batches in enumerate(step_batches):
                success, norm = train_step(ddps, opt, sched, batches[dp_rank * ga:(dp_rank + 1) * ga], ga, mb,
                                           global_batch)
                out["success"].append(success)
                ref_params, ref_momentum = reference["params"][k], reference["momentum"][k]
                out["norm"].append(abs(float(norm) - reference["norms"][k]) / reference["norms"][k])
                momentum = _momentum_by_param(opt, ddps)
                for expert, param_key, momentum_key in ((False, "param", "momentum"),
                                                        (True, "expert_param", "expert_momentum")):
                    mine_counted = [(ref, p) for ref, p in counted if _is_expert(p) == expert]
                    out[param_key].append(cmm._relative(
                        (p.detach().double() - cmp.shard_of(init[ref], p), cmp.shard_of(ref_params[ref] - init[ref], p))
                        for ref, p in mine_counted))
                    out[momentum_key].append(cmm._relative((momentum[id(p)], cmp.shard_of(ref_momentum[ref], p))
                                                           for ref, p in mine_counted if ref in ref_momentum))
            out.update(cmp.replica_checks(layout, chunks, init))
            out["expert_muon_params"] = sorted({ref for ref, p in counted
                                                if _is_expert(p) and ref in reference["momentum"][0]})
            out["children"] = [(c.config.optimizer, c.is_expert_parallel) for c in opt.chained_optimizers]
            out["optimizer_module"] = type(opt).__module__
        finally:
            megatron_opt.megatron.uninstall()
    return out


__all__ = ["LAYOUTS", "run_muon_ep", "train_step", "assert_every_rank_ran"]
