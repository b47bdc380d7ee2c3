"""Worker-side harness: megatron_opt's sharded SOAP (optimizer='soap' through install()) on megatron-core's MoE
GPTModel under expert parallelism, with overlap_grad_reduce and overlap_param_gather, against the float64
reference of the whole model (tests/support/reference_soap.py: SOAP on every matrix, one state per TP block, AdamW
on the rest) on the same global batches.

What is compared, per step: the params (dense and expert apart), the grad norm, and the per-matrix state that does
not depend on the eigenbases SOAP chose, as each matrix's home keeps it (``optimizer.state_dict()['matrix_state']``,
gathered over the world: each matrix, or each TP block of one, must be homed exactly once per data-parallel group,
expert matrices once per expert data-parallel group): plain Shampoo's factors L and R (``soap_use_kl_shampoo=False``:
decayed sums of G G^T and G^T G) and exp_avg in the parameter basis (Q_L M Q_R^T). They check that each matrix's
reduced gradient reached its home whole and that the rotations into and out of the eigenbases are consistent.

SOAP's update reads fp32 rounding noise through its eigenbases (docs/muon.md, "SOAP"): two roundings agree only where
eps dominates sqrt(V), and where they part the trajectories part too. The run sets SOAP's eps to ``EPS``
(megatron_opt's ``rule_constants['soap_eps']``), large beside these gradients, so the run stays a continuous
function of the gradients and comparable to float64. (At eps 1e-2 the factors part by 3e-3 within 3 steps.) The
update is then small beside the weight decay, so the params' error relative to their change is fp32's rounding of W.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tests.mcore import cases_model_parallel as cmp
from tests.mcore import cases_muon_expert_parallel as cme
from tests.mcore import cases_muon_model_parallel as cmm
from tests.mcore import mcore_cpu
from tests.mcore.mcore_cpu import cpu_megatron_core, token_losses
from tests.support import reference_soap as rs

import megatron.core.distributed as core_distributed  # noqa: E402
import megatron.core.optimizer as core_optimizer  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig as CoreDDPConfig  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler as CoreScheduler  # noqa: E402

import megatron_opt as mo
import megatron_opt.megatron
from tests.mcore.cases_megatron import global_batches

EPS = 1.0  # SOAP's eps for this comparison (see the module docstring); megatron-core's is 1e-8
SOAP = dict(beta1=0.9, beta2=0.95, shampoo_beta=0.95, use_kl_shampoo=False)


def _train_reference(layout: cmp.Layout, steps: list, dp: int, global_batch: int, eps: float) -> dict:
    """The whole TP1 model in float64 with ReferenceSOAP; per step the params, every matrix's per-block L and R
    and the grad norm."""
    model = mcore_cpu.build_gpt(cmm.transformer_config(layout, whole=True), tied=True)
    init = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    ref = mcore_cpu.clone_gpt(model).to(torch.float64)
    opt = rs.reference_soap(ref, cmm.LR, cmm.WD, soap=dict(SOAP, eps=eps), tp_size=layout.tp, expert_tp_size=layout.etp,
                            adam_betas=(SOAP["beta1"], SOAP["beta2"]), adam_eps=1e-8)
    sched = CoreScheduler(opt, **cmm.schedule(global_batch))
    named = dict(ref.named_parameters())
    out = {"init": init, "params": [], "factors": [], "norms": []}
    for batches in steps:
        opt.zero_grad()
        total = sum(int(b["loss_mask"].sum()) for b in batches)
        loss = sum((token_losses(ref, b).double() * b["loss_mask"]).sum() for b in batches) / total
        loss.backward()
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), cmm.CLIP)))
        opt.step()
        sched.step(increment=global_batch)
        out["params"].append({n: p.detach().clone() for n, p in named.items()})
        out["factors"].append({(n, i, k): v for n, p in named.items()
                               for i, block in enumerate(opt.state[p].get("blocks", []))
                               for k, v in _basis_free(block["L"], block["R"], block["M"], block["Q_L"],
                                                       block["Q_R"]).items()})
    return out


def _basis_free(L: torch.Tensor, R: torch.Tensor, exp_avg: torch.Tensor, q_l: torch.Tensor,
                q_r: torch.Tensor) -> dict:
    """The per-matrix state that does not depend on the eigenbases chosen: plain Shampoo's factors, and exp_avg
    seen in the parameter basis (Q_L M Q_R^T: the gradients' moving average, however often it was rotated)."""
    return {"L": L.double(), "R": R.double(), "exp_avg": q_l.double() @ exp_avg.double() @ q_r.double().T}


def _setup(chunks: list, config, global_batch: int, bucket_size: int, eps: float):
    """Megatron-LM's setup_model_and_optimizer with --optimizer soap (megatron_opt's OptimizerConfig: its
    rule_constants set SOAP's eps)."""
    ddp_config = CoreDDPConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True, overlap_param_gather=True,
                               use_distributed_optimizer=True, bucket_size=bucket_size)
    ddps = [core_distributed.DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk)
            for chunk in chunks]
    opt_config = mo.OptimizerConfig(optimizer="soap", lr=cmm.LR, min_lr=cmm.MIN_LR, weight_decay=cmm.WD,
                                    clip_grad=cmm.CLIP, adam_beta1=SOAP["beta1"], adam_beta2=SOAP["beta2"],
                                    adam_eps=1e-8, use_distributed_optimizer=True,
                                    soap_shampoo_beta=SOAP["shampoo_beta"],
                                    soap_use_kl_shampoo=SOAP["use_kl_shampoo"], rule_constants={"soap_eps": eps})
    with cpu_megatron_core():
        opt = core_optimizer.get_megatron_optimizer(opt_config, ddps, use_gloo_process_groups=True)
    cmp.wire_loop(config, ddps, opt, overlap=True)
    return ddps, opt, CoreScheduler(opt, **cmm.schedule(global_batch))


def _homed_factors(opt, chunk, whole: dict) -> dict:
    """{(reference name, TP block, 'L' | 'R' | 'exp_avg'): tensor} (``_basis_free``) of every matrix homed anywhere,
    gathered to every rank;
    a matrix homed twice in the world (other than once per (expert) data-parallel group) is an error."""
    refs = {name: cmp.reference_name(chunk, name, whole) for name, _ in chunk.named_parameters()}
    experts = {name for name, p in chunk.named_parameters() if cme._is_expert(p)}
    mine = []
    homed = opt.state_dict().get("matrix_state", {})
    for key in homed.get("L", {}):
        expert = key in experts
        tp = (parallel_state.get_expert_tensor_parallel_rank() if expert
              else parallel_state.get_tensor_model_parallel_rank())
        group = (parallel_state.get_expert_data_parallel_group() if expert
                 else parallel_state.get_data_parallel_group())
        state = _basis_free(*(homed[name][key] for name in ("L", "R", "exp_avg", "Q_L", "Q_R")))
        mine += [((refs[key], tp, name), t, dist.get_process_group_ranks(group)) for name, t in state.items()]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out, homed_in = {}, {}
    for part in everyone:
        for k, t, group in part:
            assert (k, tuple(group)) not in homed_in, f"{k} homed twice in data-parallel group {group}"
            homed_in[(k, tuple(group))] = True
            out[k] = t
    return out


def run_soap_ep(layout_name: str, steps: int = 3, eps: float = EPS, ga: int = 2, mb: int = 2,
                bucket_size: int = 4000) -> dict:
    """Train ``steps`` steps in the named EP layout (cases_muon_expert_parallel.LAYOUTS) and the float64
    reference; this rank's per-step figures (the same on every rank), the factors' worst relative error, replica
    checks and the chain's children."""
    layout = cme.LAYOUTS[layout_name]
    mcore_cpu.init_parallel_state()
    dp = dist.get_world_size() // (layout.tp * layout.pp)
    step_batches = global_batches(steps, dp, ga, mb)
    global_batch = dp * ga * mb
    with cpu_megatron_core():  # megatron-core 0.16.1's MoE router backward needs it (as cases_model_parallel's)
        reference = cmp.computed_on_rank0(_train_reference, layout, step_batches, dp, global_batch, eps)
    init = reference["init"]
    out = {"param": [], "expert_param": [], "factors": [], "norm": [], "success": []}
    with mcore_cpu.model_parallel_state(**layout.sizes()), cpu_megatron_core():
        megatron_opt.megatron.install()
        try:
            config = cmm.transformer_config(layout)
            chunks = cmp.build_chunks(layout, config, init)
            ddps, opt, sched = _setup(chunks, config, global_batch, bucket_size, eps)
            counted = cme._counted(chunks, init)
            dp_rank = parallel_state.get_data_parallel_rank()
            for k, batches in enumerate(step_batches):
                success, norm = cme.train_step(ddps, opt, sched, batches[dp_rank * ga:(dp_rank + 1) * ga], ga, mb,
                                               global_batch)
                out["success"].append(success)
                ref_params = reference["params"][k]
                out["norm"].append(abs(float(norm) - reference["norms"][k]) / reference["norms"][k])
                for expert, param_key in ((False, "param"), (True, "expert_param")):
                    out[param_key].append(cmm._relative(
                        (p.detach().double() - cmp.shard_of(init[ref], p), cmp.shard_of(ref_params[ref] - init[ref], p))
                        for ref, p in counted if cme._is_expert(p) == expert))
                factors = _homed_factors(opt, chunks[0], init)
                ref_factors = reference["factors"][k]
                assert set(factors) == set(ref_factors), (sorted(set(ref_factors) ^ set(factors))[:6])
                out["factors"].append(max(float((t.double() - ref_factors[key]).norm() / ref_factors[key].norm())
                                          for key, t in factors.items()))
                out["homed_matrices"] = sorted({(ref, tp) for ref, tp, _ in factors})
            out.update(cmp.replica_checks(layout, chunks, init))
            out["children"] = [(c.config.optimizer, c.is_expert_parallel) for c in opt.chained_optimizers]
            out["optimizer_module"] = type(opt).__module__
        finally:
            megatron_opt.megatron.uninstall()
    return out


__all__ = ["EPS", "run_soap_ep"]
