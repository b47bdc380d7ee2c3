"""Worker-side cases: megatron-core 0.16.1's GPTModel split by tensor (+sequence), pipeline (1F1B and
interleaved) and expert parallelism, trained through megatron-core's schedule and finalize_model_grads
with megatron-core's DDP + optimizer names (megatron_opt's after install(), megatron-core's own
without), against a float64 single-process reference of the whole model on the same global batch.

The reference is built first, in the worker's data-parallel-only state, as a TP1/PP1 GPTModel; the
split model is then built in the layout's parallel_state and loaded with slices of the reference's
weights (layer numbers from ``TransformerLayer.layer_number``, experts by expert-parallel rank, TP
slices along each param's ``partition_dim``), so both start from the same weights.
"""
from __future__ import annotations

import contextlib
import importlib
import re
import traceback
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from tests.mcore import mcore_cpu
from tests.mcore.mcore_cpu import cpu_megatron_core

import megatron.core.distributed as core_distributed  # noqa: E402
import megatron.core.optimizer as core_optimizer  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig as CoreDDPConfig  # noqa: E402
from megatron.core.distributed import finalize_model_grads  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler as CoreScheduler  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

import megatron_opt.megatron
from tests.mcore.cases_megatron import CLIP, LR, MIN_LR, WD, Float64Reference, forward_step, global_batches, schedule


@dataclass(frozen=True)
class Layout:
    """One way to split the model over the world (4 ranks unless said)."""

    tp: int = 1
    pp: int = 1
    vp: Optional[int] = None  # virtual pipeline stages per rank (interleaved schedule)
    sp: bool = False  # sequence parallel
    ep: int = 1
    etp: Optional[int] = None  # expert tensor parallel size (None: the dense TP size)
    experts: Optional[int] = None
    layers: int = 2
    dispatcher: str = "alltoall"  # megatron-core's MoE token dispatcher (gloo has the uneven all-to-all it needs)
    glu: bool = False  # SwiGLU MLPs: fc1 holds [gate; up], each half sliced over TP on its own (stride 2)

    @property
    def bias(self) -> bool:
        """megatron-core 0.16.1 allows expert biases only at expert TP 1."""
        return not self.experts or (self.etp or self.tp) == 1

    def sizes(self) -> dict:
        return dict(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
                    virtual_pipeline_model_parallel_size=self.vp, expert_model_parallel_size=self.ep,
                    expert_tensor_parallel_size=self.etp)


LAYOUTS = {
    "tp2": Layout(tp=2),
    "tp2_sp": Layout(tp=2, sp=True),
    "pp2": Layout(pp=2),
    "pp2_vp2": Layout(pp=2, vp=2, layers=4),
    "ep2": Layout(ep=2, experts=4),  # dense DP 4, expert DP 2
    "ep2_allgather": Layout(ep=2, experts=4, dispatcher="allgather"),
    # Expert TP 1 under dense TP 2: megatron-core 0.16.1 filters the replicated expert params (the experts'
    # fc2 biases) by the dense TP rank (#5916/#6470) and drops those held on dense TP rank 1.
    "tp2_sp_ep2_etp1": Layout(tp=2, sp=True, ep=2, etp=1, experts=4),
    # Expert TP 2 under dense TP 1, expert DP 1 (no expert biases: megatron-core allows them only at expert
    # TP 1). The all-to-all dispatcher would all-gather unequal token counts over expert TP: gloo refuses.
    "ep2_etp2": Layout(ep=2, etp=2, experts=4, dispatcher="allgather"),
}

# What each sabotage switches off in megatron-core's finalize_model_grads (to prove the checks can fail).
SABOTAGE = {"no_tp_sum": "_allreduce_non_tensor_model_parallel_grads",
            "no_embedding_allreduce": "_allreduce_word_embedding_grads"}


def transformer_config(layout: Layout, per_token: bool, dtype: torch.dtype, whole: bool = False) -> TransformerConfig:
    """The split model's config, or with ``whole`` the reference's (TP1/PP1/EP1, same architecture)."""
    split = not whole
    return TransformerConfig(
        num_layers=layout.layers, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, calculate_per_token_loss=per_token,
        bf16=dtype == torch.bfloat16, params_dtype=dtype, pipeline_dtype=dtype,
        tensor_model_parallel_size=layout.tp if split else 1, sequence_parallel=layout.sp and split,
        pipeline_model_parallel_size=layout.pp if split else 1,
        virtual_pipeline_model_parallel_size=layout.vp if split else None,
        # Megatron-LM's defaults: the interleaved schedule's p2p overlapped and unbatched (each direction on
        # its own communicator at PP 2: batched, gloo can match a gradient to an activation receive).
        overlap_p2p_comm=bool(layout.vp and split), batch_p2p_comm=not (layout.vp and split),
        add_bias_linear=layout.bias, num_moe_experts=layout.experts, moe_ffn_hidden_size=32 if layout.experts else None,
        moe_router_topk=2, moe_router_load_balancing_type="none", moe_token_dispatcher_type=layout.dispatcher,
        expert_model_parallel_size=layout.ep if split else 1,
        expert_tensor_parallel_size=layout.etp if split else None,
        gated_linear_unit=layout.glu,
        activation_func=torch.nn.functional.silu if layout.glu else torch.nn.functional.gelu)


# ----------------------------------------------------------------------------- reference weights -> shards
def _is_expert(param: torch.Tensor) -> bool:
    return getattr(param, "allreduce", True) is False


def reference_name(chunk: GPTModel, name: str, whole: dict) -> str:
    """The reference (TP1/PP1/EP1) name of a split chunk's param: global layer and expert numbers, and the
    last stage's tied output weight read as the embedding."""
    match = re.match(r"decoder\.layers\.(\d+)\.", name)
    if match:
        number = chunk.decoder.layers[int(match.group(1))].layer_number - 1
        name = f"decoder.layers.{number}." + name[match.end():]
    match = re.search(r"local_experts\.(\d+)\.", name)
    if match:
        local = chunk.config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
        number = parallel_state.get_expert_model_parallel_rank() * local + int(match.group(1))
        name = name[:match.start()] + f"local_experts.{number}." + name[match.end():]
    if name == "output_layer.weight" and name not in whole:
        name = "embedding.word_embeddings.weight"
    return name


def tp_slices(whole_shape: torch.Size, param: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """Where this rank's TP slice of a whole tensor lies: [(dim, whole start, local start, size)] along
    the split dimension; SwiGLU's fc1 (partition_stride 2) is its gate and its up half, each sliced on its
    own (expert params by the expert TP rank). [] when the param is not split."""
    if whole_shape == param.shape:
        return []
    stride, dim = getattr(param, "partition_stride", 1), param.partition_dim
    rank = (parallel_state.get_expert_tensor_parallel_rank() if _is_expert(param)
            else parallel_state.get_tensor_model_parallel_rank())
    size = param.shape[dim] // stride
    return [(dim, k * (whole_shape[dim] // stride) + rank * size, k * size, size) for k in range(stride)]


def shard_of(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's tensor-parallel slice of a whole tensor."""
    slices = tp_slices(full.shape, param)
    if not slices:
        return full
    return torch.cat([full.narrow(dim, start, size) for dim, start, _, size in slices], dim=slices[0][0])


def chunk_params(chunk: GPTModel, whole: dict) -> list:
    """(reference name, param, counted) for every param of a split chunk; ``counted``: this rank's copy is
    the one the test counts once in the world (expert params: expert TP rank 0 unless TP-split; dense:
    TP rank 0 unless TP-split; never the last stage's tied copy). Data-parallel replicas are checked
    bitwise equal separately and counted on DP rank 0 only (by the caller)."""
    out = []
    for name, param in chunk.named_parameters():
        ref = reference_name(chunk, name, whole)
        split = whole[ref].shape != param.shape
        tp_rank = (parallel_state.get_expert_tensor_parallel_rank() if _is_expert(param)
                   else parallel_state.get_tensor_model_parallel_rank())
        tied_copy = name == "output_layer.weight" and ref != name
        out.append((ref, param, (split or tp_rank == 0) and not tied_copy))
    return out


def build_chunks(layout: Layout, config: TransformerConfig, whole: dict) -> list:
    """Megatron-LM's get_model: one GPTModel per virtual stage, loaded with slices of the reference."""
    chunks = []
    for stage in range(layout.vp or 1):
        vp_stage = stage if layout.vp else None
        torch.manual_seed(0)
        with cpu_megatron_core():
            chunk = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=layout.experts),
                             vocab_size=mcore_cpu.VOCAB, max_sequence_length=mcore_cpu.SEQ,
                             pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                                                vp_stage=vp_stage),
                             post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                                                vp_stage=vp_stage),
                             share_embeddings_and_output_weights=True, vp_stage=vp_stage)
        with torch.no_grad():
            for ref, param, _ in chunk_params(chunk, whole):
                param.copy_(shard_of(whole[ref], param))
                # megatron-core 0.16.1 tags the experts' fc2 biases sequence_parallel, so finalize_model_grads
                # would sum them over the dense TP group, whose ranks hold other experts when expert TP is 1
                # (a wrong gradient in megatron-core's own model, not the optimizer's): untag them.
                if _is_expert(param) and getattr(param, "sequence_parallel", False):
                    param.sequence_parallel = False
        chunks.append(chunk)
    return chunks


# ----------------------------------------------------------------------------- the training loop
def setup(chunks: list, config: TransformerConfig, overlap: bool, bf16: bool, global_batch: int):
    """Megatron-LM's get_model + setup_model_and_optimizer, through megatron-core's names (ours after install())."""
    if bf16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    ddp_config = CoreDDPConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap, overlap_param_gather=overlap,
                               use_distributed_optimizer=True, bucket_size=4000 if overlap else None)
    ddps = [core_distributed.DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                                     disable_bucketing=index > 0)
            for index, chunk in enumerate(chunks)]
    opt_config = core_optimizer.OptimizerConfig(
        optimizer="adam", lr=LR, min_lr=MIN_LR, weight_decay=WD, clip_grad=CLIP, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
        use_distributed_optimizer=True, log_num_zeros_in_grad=True)
    with cpu_megatron_core():
        opt = core_optimizer.get_megatron_optimizer(opt_config, ddps, use_gloo_process_groups=True)
    wire_loop(config, ddps, opt, overlap)
    return ddps, opt, CoreScheduler(opt, **schedule(global_batch))


def wire_loop(config: TransformerConfig, ddps: list, opt: Any, overlap: bool) -> None:
    """What Megatron-LM's setup puts on the model config for its schedule: the chunks' no_sync (and, with
    --overlap-grad-reduce, start_grad_sync; align_grad_reduce on by default), one function for one chunk, a list
    for several; megatron-core's finalize_model_grads; the optimizer's loss scaling."""
    one = (lambda funcs: funcs[0]) if len(ddps) == 1 else (lambda funcs: funcs)
    config.no_sync_func = one([ddp.no_sync for ddp in ddps])
    if overlap:
        config.grad_sync_func = one([ddp.start_grad_sync for ddp in ddps])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = opt.scale_loss


def step_loss(losses: list, per_token: bool) -> Optional[float]:
    """The step's loss as the reference reports it, from the last stage's per-microbatch [sum, count]
    over the data-parallel group; None off the last stage."""
    if not losses:
        return None
    mine = torch.stack([entry["lm loss"] for entry in losses]).double()
    group = parallel_state.get_data_parallel_group()
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    sums, counts = torch.cat(parts).unbind(1)
    return float(sums.sum() / counts.sum()) if per_token else float((sums / counts).mean())


def train(ddps: list, opt, sched, step_batches: list, per_token: bool, ga: int, mb: int) -> tuple[list, list, list]:
    """Megatron-LM's train_step for each global batch: (per-step loss or None, per-step grad norm,
    per-step zero count)."""
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    losses, norms, zeros = [], [], []
    for batches in step_batches:
        mine = batches[dp_rank * ga:(dp_rank + 1) * ga]
        for ddp in ddps:
            ddp.zero_grad_buffer()
        opt.zero_grad()
        with cpu_megatron_core():
            data = [iter(mine) for _ in ddps] if len(ddps) > 1 else iter(mine)
            out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data, model=ddps,
                                              num_microbatches=ga, seq_length=mcore_cpu.SEQ, micro_batch_size=mb,
                                              decoder_seq_length=None, forward_only=False)
            success, norm, num_zeros = opt.step()
        assert success, "step skipped"
        sched.step(increment=ga * mb * dp)
        losses.append(step_loss(out, per_token))
        norms.append(float(norm))
        zeros.append(int(num_zeros))
    if ddps[0].ddp_config.overlap_param_gather:  # the last step's params are gathered at the next forward
        for ddp in ddps:
            ddp.disable_forward_pre_hook(param_sync=True)
    return losses, norms, zeros


# ----------------------------------------------------------------------------- checks
def _all_equal(tensor: torch.Tensor, group) -> bool:
    """Whether every rank of ``group`` holds bitwise this tensor (gathered, compared on every rank)."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return all(torch.equal(part, tensor) for part in parts)


def _flat(params: list) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in params]) if params else torch.zeros(0)


def replica_checks(layout: Layout, chunks: list, whole: dict) -> dict:
    """DP replicas bitwise equal (dense over DP, experts over expert DP), TP copies of replicated params
    bitwise equal, and the last stage's tied output weight equal to the first stage's embedding."""
    params = [entry for chunk in chunks for entry in chunk_params(chunk, whole)]
    dense = [p for _, p, _ in params if not _is_expert(p)]
    experts = [p for _, p, _ in params if _is_expert(p)]
    replicated = [p for p in dense if not getattr(p, "tensor_model_parallel", False)]
    out = {"dp_replicas_equal": _all_equal(_flat(dense), parallel_state.get_data_parallel_group()),
           "expert_dp_replicas_equal": _all_equal(_flat(experts), parallel_state.get_expert_data_parallel_group()),
           "tp_copies_equal": _all_equal(_flat(replicated), parallel_state.get_tensor_model_parallel_group())}
    if layout.pp > 1:  # the embedding group: first and last stage of each pipeline
        tied = [c.embedding.word_embeddings.weight for c in chunks if c.pre_process] + \
               [c.output_layer.weight for c in chunks if c.post_process and not c.pre_process]
        assert len(tied) == 1
        out["tied_embedding_equal"] = _all_equal(_flat(tied), parallel_state.get_embedding_group())
    return out


def update_error(chunks: list, whole: dict, init: dict) -> float:
    """|ours - reference| / |reference| of the whole-model update, each element counted once in the world."""
    sums = torch.zeros(2, dtype=torch.float64)
    for chunk in chunks:
        for ref, param, counted in chunk_params(chunk, whole):
            dp_rank = (parallel_state.get_expert_data_parallel_rank() if _is_expert(param)
                       else parallel_state.get_data_parallel_rank())
            if counted and dp_rank == 0:
                ours = param.detach().double() - shard_of(init[ref], param)
                theirs = shard_of(whole[ref], param) - shard_of(init[ref], param)
                sums += torch.stack([(ours - theirs).norm() ** 2, theirs.norm() ** 2])
    dist.all_reduce(sums)
    return float((sums[0] / sums[1]).sqrt())


# ----------------------------------------------------------------------------- the case
def computed_on_rank0(fn, *args) -> Any:
    """``fn(*args)`` run on rank 0 and broadcast to every rank (a failure there raises on every rank,
    instead of leaving the others in the broadcast)."""
    payload = [None]
    if dist.get_rank() == 0:
        try:
            payload = [{"value": fn(*args)}]
        except Exception:  # noqa: BLE001
            payload = [{"error": traceback.format_exc()}]
    dist.broadcast_object_list(payload, src=0)
    if "error" in payload[0]:
        raise RuntimeError("the reference failed on rank 0:\n" + payload[0]["error"])
    return payload[0]["value"]


def _reference(layout: Layout, per_token: bool, steps: list, dp: int, global_batch: int) -> dict:
    """Rank 0 trains the whole model in float64 (and in fp32, the plain-torch figure); every rank gets
    the initial and final weights, losses and norms."""
    return computed_on_rank0(_train_reference, layout, per_token, steps, dp, global_batch)


def _train_reference(layout: Layout, per_token: bool, steps: list, dp: int, global_batch: int) -> dict:
    model = mcore_cpu.build_gpt(transformer_config(layout, per_token, torch.float32, whole=True), tied=True)
    init = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    runs = {dtype: Float64Reference(model, global_batch, dtype) for dtype in (torch.float64, torch.float32)}
    losses, norms, zeros = [], [], []
    with cpu_megatron_core():  # the MoE router's backward needs it too
        for batches in steps:
            norms.append(runs[torch.float64].step(batches, per_token, dp))
            losses.append(runs[torch.float64].last_loss)
            zeros.append(runs[torch.float64].last_zeros)
            runs[torch.float32].step(batches, per_token, dp)
    return {"init": init, "final": runs[torch.float64].params(), "fp32_final": runs[torch.float32].params(),
            "losses": losses, "norms": norms, "zeros": zeros}


IMPLEMENTATIONS = ("megatron_core", "megatron_opt")  # megatron-core's own DDP + optimizer; ours through install()


def run_layout(layout_name: str, per_token: bool = True, overlap: bool = False, bf16: bool = False,
               impls: tuple = ("megatron_opt",), steps: int = 4, ga: int = 2, mb: int = 2,
               sabotage: Optional[str] = None) -> dict:
    """Train ``steps`` steps of the same global batches in the named layout once per implementation in
    ``impls`` (each from the same initial weights) and report this rank's figures and checks per
    implementation, with the float64 reference's losses and norms."""
    layout = LAYOUTS[layout_name]
    mcore_cpu.init_parallel_state()
    dp = dist.get_world_size() // (layout.tp * layout.pp)
    step_batches = global_batches(steps, dp, ga, mb)
    reference = _reference(layout, per_token, step_batches, dp, dp * ga * mb)
    out = {"reference": {"losses": reference["losses"], "norms": reference["norms"], "zeros": reference["zeros"],
                         "fp32_torch_error": _fp32_torch_error(reference)}}
    finalize_module = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    with mcore_cpu.model_parallel_state(**layout.sizes()), cpu_megatron_core():  # megatron-core's DDP needs it
        for impl in impls:
            assert impl in IMPLEMENTATIONS, impl
            with contextlib.ExitStack() as stack:
                if sabotage:  # test-side only: one of finalize_model_grads' reductions becomes a no-op
                    stack.enter_context(_patched(finalize_module, SABOTAGE[sabotage], lambda *a, **k: None))
                if impl == "megatron_opt":
                    megatron_opt.megatron.install()
                    stack.callback(megatron_opt.megatron.uninstall)
                config = transformer_config(layout, per_token, torch.bfloat16 if bf16 else torch.float32)
                chunks = build_chunks(layout, config, reference["init"])
                ddps, opt, sched = setup(chunks, config, overlap, bf16, dp * ga * mb)
                losses, norms, zeros = train(ddps, opt, sched, step_batches, per_token, ga, mb)
                out[impl] = {"losses": losses, "norms": norms, "zeros": zeros, "optimizer_module": type(opt).__module__,
                             "update_error": update_error(chunks, reference["final"], reference["init"]),
                             **replica_checks(layout, chunks, reference["init"])}
    return out


def _fp32_torch_error(reference: dict) -> float:
    """What plain fp32 torch AdamW reaches against the float64 reference (the floor of any fp32 figure)."""
    init, final, base = reference["init"], reference["final"], reference["fp32_final"]
    num = sum(float(((base[n] - final[n])).norm() ** 2) for n in final)
    den = sum(float((final[n] - init[n]).norm() ** 2) for n in final)
    return (num / den) ** 0.5


@contextlib.contextmanager
def _patched(obj, name: str, value):
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)
