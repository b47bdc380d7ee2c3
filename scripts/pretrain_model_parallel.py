"""The main job's model-parallel path: megatron-core's GPTModel split by tensor (with sequence), pipeline
(1F1B and interleaved) and expert parallelism, trained through megatron-core's schedule and
finalize_model_grads on megatron_opt's DistributedDataParallel and optimizer, as Megatron-LM's
pretrain_gpt.py + training.py do it.

pretrain_gpt.py takes this path when a model-parallel size is above 1, or with --num-experts or
--use-mcore-models (megatron-core's GPTModel without model parallelism, e.g. as the TP1/PP1 baseline
of a model-parallel run). megatron-core is needed only here, and only then (it is optional for the
main job and never needed by megatron_opt). The data, the schedule, the optimizer, the log line and
the evaluation are the main job's; data-parallel size = world / (TP x PP x CP) and each data-parallel
rank reads the batches a rank of that index reads in a data-parallel-only run of that size.

Initial weights do not depend on the layout: every weight is drawn whole on the CPU and sliced
(megatron-core's ``use_cpu_initialization``), the embeddings from ``--seed``, and each transformer
layer from a generator seeded by ``--seed`` and its global layer number. So a TP2xPP2xDP2 run starts
from the TP1xPP1xDP2 run's weights, and their logs agree to fp32 reduction order (docs/usage.md,
"Model parallelism in the main job"). Experts under expert parallelism are drawn per expert-parallel
rank (the same on every expert data-parallel replica, not the same as at EP 1).

Megatron-LM pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP; so does this path.
On CPU, megatron-core's CUDA assumptions are patched only while megatron-core code runs
(scripts/megatron_core_on_cpu.py).

Checkpoints: --save/--load, --save-interval and the rest of the main job's checkpoint flags work here as
at data parallelism (pretrain_gpt.py's Job.save/resume, scripts/pretrain_resume.py's rules: the tracker,
the newest-folder fallback, the refusal to move a newer tracker back, the schedule and batch warnings,
--exit-signal-handler, --exit-interval, --async-save, --no-load-optim, --no-save-rng). megatron_opt.checkpoint
saves the optimizer over all model chunks' DDPs with megatron-core's global keys ("param_keys":
"megatron_core"), so a checkpoint saved with tensor / pipeline / expert parallelism loads at another
TP / PP / DP layout (TP2 x PP2 -> TP1 x PP1 is tested) and continues as that layout's run from scratch
does. Each data-parallel rank's data position is saved run-wide (``data_by_dp_rank``), so the built-in
corpus continues exactly at any layout of the same data-parallel size (megatron-core's datasets
continue from the consumed samples at any size). --no-save-optim saves the model by the same global keys
(megatron_opt.checkpoint sees the chunks' model-parallel groups). Refused before anything runs: --load
of a local-names checkpoint (saved at data parallelism, or at TP1 x PP1 x EP1) into a TP / PP / EP layout.

Not here yet (each refused with its reason by ``check_args``): context parallelism (megatron-core's
local attention needs Transformer Engine for it), --log-params-norm.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

import megatron_opt as mo
import megatron_opt.checkpoint  # noqa: F401  (mo.checkpoint)
from megatron_opt.megatron import arguments as megatron_args
import pretrain_data
import pretrain_eval
from megatron_core_on_cpu import patched

Batch = tuple[torch.Tensor, torch.Tensor]  # (tokens, labels with -100 where no loss is taken)
SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
         "expert_model_parallel_size")


# ----------------------------------------------------------------------------- flags
def add_args(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's flags of megatron-core's model that this path implements (the model-parallel sizes
    are megatron_opt.megatron.arguments' flags)."""
    g = parser.add_argument_group("megatron-core's GPTModel (model parallelism; megatron-core needed)")
    g.add_argument("--use-mcore-models", action="store_true",
                   help="train megatron-core's GPTModel (implied by any model-parallel size > 1 or --num-experts)")
    g.add_argument("--num-experts", type=int, default=None, help="a mixture of experts in every MLP")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="default --ffn-hidden-size")
    g.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall"), default="allgather")


def wanted(args: argparse.Namespace) -> bool:
    """Whether the run trains megatron-core's GPTModel through this path."""
    return args.use_mcore_models or args.num_experts is not None or any(getattr(args, s) > 1 for s in SIZES)


def check_args(args: argparse.Namespace) -> Optional[str]:
    """What this path cannot run, as one problem with its fix; None when it can (or is not taken)."""
    if not wanted(args):
        return None
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return ("model parallelism (and --num-experts, --use-mcore-models) trains megatron-core's GPTModel, and "
                "megatron-core is not installed: `pip install megatron-core`, or use data parallelism only")
    tp, pp, cp, ep = (getattr(args, s) for s in SIZES)
    if cp > 1:
        return (f"--context-parallel-size {cp}: megatron-core's GPTModel needs Transformer Engine's attention for "
                f"context parallelism (its local attention refuses it), and this script builds the local layer spec; "
                f"use --context-parallel-size 1 (megatron_opt itself supports CP: docs/megatron.md)")
    if ep > 1 and args.num_experts is None:
        return f"--expert-model-parallel-size {ep} needs --num-experts (experts to split)"
    if args.num_experts is not None and (args.num_experts <= 0 or args.num_experts % ep):
        return (f"--num-experts {args.num_experts} must be a positive multiple of --expert-model-parallel-size {ep} "
                f"(each expert-parallel rank holds num-experts / EP experts)")
    if args.num_experts is not None and not 0 < args.moe_router_topk <= args.num_experts:
        return f"--moe-router-topk {args.moe_router_topk} must be in [1, --num-experts {args.num_experts}]"
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    if args.num_experts is not None and args.moe_token_dispatcher_type == "alltoall" and on_cpu:
        return ("--moe-token-dispatcher-type alltoall needs CUDA (megatron-core's all-to-all dispatcher creates CUDA "
                "streams); on CPU use --moe-token-dispatcher-type allgather")
    if args.log_params_norm:
        return "--log-params-norm is not supported with megatron-core's GPTModel yet (model-parallel shards)"
    problem = check_checkpoint_args(args)
    if problem:
        return problem
    ffn = args.ffn_hidden_size or 4 * args.hidden_size
    for flag, value in (("--hidden-size", args.hidden_size), ("--num-attention-heads", args.num_attention_heads),
                        ("--ffn-hidden-size", ffn)):
        if value % tp:
            return f"{flag} {value} is not divisible by --tensor-model-parallel-size {tp}: each TP rank holds 1/TP"
    if args.sequence_parallel and args.seq_length % tp:
        return (f"--seq-length {args.seq_length} is not divisible by --tensor-model-parallel-size {tp}: "
                f"--sequence-parallel splits the sequence over the TP ranks")
    return None


def model_parallel(args: argparse.Namespace) -> bool:
    """A layout that splits the model over ranks (tensor, pipeline or expert parallelism)."""
    return any(getattr(args, s) > 1 for s in SIZES) or (args.expert_tensor_parallel_size or 1) > 1


def check_checkpoint_args(args: argparse.Namespace) -> Optional[str]:
    """--save/--load on this path (pretrain_resume's rules apply as at data parallelism): what
    megatron_opt.checkpoint cannot do here, before anything runs. It names a model-parallel model's
    params by megatron-core's global keys (a checkpoint then loads at any TP / PP / DP layout) at tensor /
    pipeline / expert parallelism, with or without the optimizer; at TP1 x PP1 x EP1 by their local names."""
    if not model_parallel(args):
        return None
    if args.load_iteration is not None:
        if not mo.checkpoint.read_info(args.load).global_param_keys:
            return (f"--load {args.load}: iteration {args.load_iteration} names its params locally (saved at data "
                    f"parallelism: by this script's own GPT, or by megatron-core's GPTModel at TP1 x PP1 x EP1), so it "
                    f"cannot be placed in a tensor, pipeline or expert-parallel layout; load it at TP1 x PP1 x EP1 "
                    f"(--use-mcore-models), or resume from a checkpoint saved with model parallelism")
    return None


# ----------------------------------------------------------------------------- the model
def transformer_config(args: argparse.Namespace, dtype: torch.dtype) -> Any:
    """megatron-core's TransformerConfig from the flags, as Megatron-LM's core_transformer_config_from_args
    (no dropout: the main job's model has none)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    experts = args.num_experts
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size, init_method_std=args.init_method_std,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,  # layout-independent weights
        calculate_per_token_loss=args.loss_mode == "per_token", fp16=args.fp16, bf16=args.bf16,
        params_dtype=dtype, pipeline_dtype=dtype,
        tensor_model_parallel_size=args.tensor_model_parallel_size, sequence_parallel=args.sequence_parallel,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        # Megatron-LM's defaults: the interleaved schedule overlaps its p2p, which then runs unbatched; at
        # PP 2 that sends each direction on its own communicator. Batched, both directions to the one
        # peer share a stream, and gloo matches a gradient to an activation receive of the same shape.
        overlap_p2p_comm=args.virtual_pipeline_model_parallel_size is not None,
        batch_p2p_comm=args.virtual_pipeline_model_parallel_size is None,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        num_moe_experts=experts, moe_router_topk=args.moe_router_topk if experts else 2,
        moe_ffn_hidden_size=(args.moe_ffn_hidden_size or args.ffn_hidden_size or 4 * args.hidden_size)
        if experts else None,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type)


def seeded_layer_class(seed: int) -> type:
    """megatron-core's TransformerLayer drawing its weights from the CPU generator seeded by ``seed`` and
    its global layer number, so a layer's weights do not depend on which pipeline stage builds it."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset

    class SeededTransformerLayer(TransformerLayer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            config = kwargs["config"] if "config" in kwargs else args[0]
            offset = get_transformer_layer_offset(config, kwargs.get("vp_stage"),
                                                  parallel_state.get_pipeline_model_parallel_rank())
            torch.manual_seed(seed * 100003 + kwargs.get("layer_number", 1) + offset)
            super().__init__(*args, **kwargs)

    return SeededTransformerLayer


def build_chunks(args: argparse.Namespace, config: Any, vocab_size: int) -> list[torch.nn.Module]:
    """Megatron-LM's get_model: one GPTModel per virtual pipeline stage of this rank (one without VPP),
    the output layer tied to the embedding unless --untie-embeddings-and-output-weights."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    spec = get_gpt_layer_local_spec(num_experts=args.num_experts)
    spec = dataclasses.replace(spec, module=seeded_layer_class(args.seed))
    chunks = []
    for stage in range(args.virtual_pipeline_model_parallel_size or 1):
        vp_stage = stage if args.virtual_pipeline_model_parallel_size else None
        torch.manual_seed(args.seed)  # the embeddings: the same draw on the first stage at any layout
        chunks.append(GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
            max_sequence_length=args.max_position_embeddings or args.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type="learned_absolute", vp_stage=vp_stage))
    return chunks


def count_params(chunks: list[torch.nn.Module]) -> int:
    """The whole model's parameter count (collective over the world): each element once, i.e. TP-split
    params on every TP rank, replicated ones on TP rank 0, never the last stage's tied output weight,
    data-parallel rank 0 only (expert params by their expert ranks)."""
    from megatron.core import parallel_state as ps

    local = 0
    for chunk in chunks:
        for param in chunk.parameters():
            expert = getattr(param, "allreduce", True) is False
            tp_rank = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
            dp_rank = ps.get_expert_data_parallel_rank() if expert else ps.get_data_parallel_rank()
            split = getattr(param, "tensor_model_parallel", False)
            if (split or tp_rank == 0) and dp_rank == 0 and not getattr(param, "shared", False) \
                    and ps.get_context_parallel_rank() == 0:
                local += param.numel()
    total = torch.tensor([local], dtype=torch.float64, device=dist_device())
    dist.all_reduce(total)
    return int(total.item())


def dist_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


# ----------------------------------------------------------------------------- the step
def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Megatron-LM pretrain_gpt's loss_func: (sum of token losses, token count, {"lm loss": [sum, count]})."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])}


def forward_step(data_iterator: Iterator[Batch], model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    """Megatron-LM's forward_step on the main job's (tokens, labels) batches; the model computes the
    per-token loss itself (vocab-parallel cross-entropy). The causal mask is given, as Megatron-LM's data
    loader gives it by default (True: masked out)."""
    tokens, labels = next(data_iterator)
    seq = tokens.shape[1]
    position_ids = torch.arange(seq, device=tokens.device).expand_as(tokens)
    mask = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).triu(1)[None, None]
    output = model(tokens, position_ids, mask, labels=labels.clamp(min=0))
    return output, functools.partial(loss_func, labels.ne(-100))


def loss_terms(outputs: list[dict], per_token: bool, device: torch.device) -> torch.Tensor:
    """[numerator, denominator] of the step's loss as mo.train_step reports it (per token: token-loss sum
    / token count; mean: the micro-batch means summed / their count), from this rank's micro-batches; only
    the last pipeline stage's TP/CP rank 0 contributes, so one all-reduce over the world gives the step's."""
    from megatron.core import parallel_state as ps

    terms = torch.zeros(2, dtype=torch.float64, device=device)
    if outputs and ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0:
        sums, counts = torch.stack([entry["lm loss"] for entry in outputs]).double().unbind(1)
        terms += torch.stack([sums.sum(), counts.sum()]) if per_token else \
            torch.stack([(sums / counts.clamp(min=1)).sum(), torch.tensor(float(len(outputs)), dtype=torch.float64)])
    return terms


def job_class(base: type) -> type:
    """pretrain_gpt.py's Job with megatron-core's model, schedule and finalize_model_grads in it."""
    class ModelParallelJob(base):  # type: ignore[misc, valid-type]
        def __init__(self, args: argparse.Namespace) -> None:
            super().__init__(args)
            if self.timers.level >= 1:  # the base instruments the first chunk; the other chunks' syncs too
                for ddp in self.ddps[1:]:
                    ddp.finish_grad_sync = self.timers.wrap(ddp.finish_grad_sync, "all-grads-sync")

        def build(self) -> None:
            """parallel_state, the data of this data-parallel rank, the model chunks, megatron_opt's DDP per
            chunk and optimizer over all of them, the schedule, and Megatron-LM's setup of the config."""
            from megatron.core import parallel_state, tensor_parallel
            from megatron.core.distributed import finalize_model_grads
            from megatron.core.transformer.module import Float16Module

            args = self.args
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=args.tensor_model_parallel_size,
                pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
                context_parallel_size=args.context_parallel_size,
                expert_model_parallel_size=args.expert_model_parallel_size,
                expert_tensor_parallel_size=args.expert_tensor_parallel_size,
                num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
                distributed_timeout_minutes=args.distributed_timeout_minutes,
                create_gloo_process_groups=False)  # megatron_opt needs none
            with patched(self.device):
                tensor_parallel.model_parallel_cuda_manual_seed(args.seed)  # the tracker megatron-core forks
            self.source = pretrain_data.build_source(args, parallel_state.get_data_parallel_rank(),
                                                     parallel_state.get_data_parallel_world_size())
            self.dtype = megatron_args.params_dtype_from_args(args)
            vocab = pretrain_data.padded_vocab_size(self.source.vocab_size,
                                                    args.make_vocab_size_divisible_by * args.tensor_model_parallel_size)
            self.config = transformer_config(args, self.dtype)
            with patched(self.device):
                chunks = build_chunks(args, self.config, vocab)
            chunks = [chunk.to(self.device) for chunk in chunks]
            self.model = torch.nn.ModuleList(chunks)
            modules = [Float16Module(self.config, c) for c in chunks] if args.fp16 or args.bf16 else chunks
            ddp_config = megatron_args.ddp_config_from_args(args)
            with patched(self.device):  # the last stage's tied weight is synced at construction
                self.ddps = [mo.DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=m,
                                                        disable_bucketing=index > 0)
                             for index, m in enumerate(modules)]
            self.ddp = self.ddps[0]
            self.optimizer = mo.get_megatron_optimizer(megatron_args.optimizer_config_from_args(args), self.ddps)
            self.scheduler = megatron_args.scheduler_from_args(self.optimizer, args)
            one = (lambda funcs: funcs[0]) if len(self.ddps) == 1 else (lambda funcs: funcs)
            if args.overlap_grad_reduce:  # Megatron-LM's setup_model_and_optimizer (align_grad_reduce: default)
                self.config.no_sync_func = one([ddp.no_sync for ddp in self.ddps])
                self.config.grad_sync_func = one([ddp.start_grad_sync for ddp in self.ddps])
            if args.overlap_param_gather:
                self.config.param_sync_func = one([ddp.start_param_sync for ddp in self.ddps])
            self.config.finalize_model_grads_func = finalize_model_grads
            self.config.grad_scale_func = self.optimizer.scale_loss

        def schedule(self, batches: list[Batch], forward_only: bool) -> list[dict]:
            """megatron-core's forward-backward over the micro-batches: the last stage's loss reports."""
            from megatron.core.pipeline_parallel import get_forward_backward_func

            args = self.args
            step = self.timers.wrap(forward_step, "forward-compute", level=2)
            with patched(self.device):
                data = [iter(batches) for _ in self.ddps] if len(self.ddps) > 1 else iter(batches)
                return get_forward_backward_func()(
                    forward_step_func=step, data_iterator=data, model=self.ddps, num_microbatches=len(batches),
                    seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, decoder_seq_length=None,
                    forward_only=forward_only)

        def train_step(self, batches: list[Batch]) -> mo.TrainStepResult:
            """Megatron-LM's train_step: zero the grad buffers, the schedule (finalize_model_grads in it),
            the optimizer, the schedule's step by the global batch when the update happened."""
            args = self.args
            for ddp in self.ddps:
                ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            outputs = self.schedule(batches, forward_only=False)
            success, grad_norm, num_zeros = self.optimizer.step()
            if success:
                self.scheduler.step(increment=args.global_batch_size)
            terms = loss_terms(outputs, args.loss_mode == "per_token", dist_device())
            dist.all_reduce(terms)
            values = torch.cat([terms, self.optimizer.get_loss_scale().to(terms).reshape(1)]).tolist()
            reason = getattr(self.optimizer, "last_skip_reason", None)
            return mo.TrainStepResult(
                loss=values[0] / max(values[1], 1.0), success=success, grad_norm=grad_norm, num_zeros=num_zeros,
                loss_scale=values[2], lr=mo.canonical_lr(self.optimizer.param_groups),
                skipped_steps=getattr(self.optimizer, "skipped_steps", 0), num_tokens=int(values[1]),
                skip_reason=None if success or reason is None else str(reason.value))

        def evaluate(self, split: str, prefix: str, to_tensorboard: bool) -> None:
            """pretrain_gpt.py's evaluation through megatron-core's forward-only schedule."""
            args = self.args
            consumed = self.consumed_valid if split == "valid" else 0
            if args.overlap_param_gather:  # the forward pre-hooks gather params only inside a step
                for ddp in self.ddps:
                    ddp.disable_forward_pre_hook()
            for ddp in self.ddps:
                ddp.eval()
            terms = torch.zeros(2, dtype=torch.float64, device=dist_device())
            with torch.no_grad():
                for k in range(args.eval_iters):
                    batches = [tuple(t.to(self.device) for t in batch) for batch in
                               self.source.eval_batches(split, consumed + k * args.global_batch_size,
                                                        args.num_microbatches)]
                    terms += loss_terms(self.schedule(batches, forward_only=True), args.loss_mode == "per_token",
                                        terms.device)
            for ddp in self.ddps:
                ddp.train()
            if args.overlap_param_gather:
                for ddp in self.ddps:
                    ddp.enable_forward_pre_hook()
            dist.all_reduce(terms)
            loss = (terms[0] / terms[1].clamp(min=1)).item()
            if split == "valid":
                self.consumed_valid += args.eval_iters * args.global_batch_size
                if to_tensorboard and self.tensorboard is not None:
                    self.tensorboard.log_validation(loss, self.iteration, self.consumed)
            self.say(*pretrain_eval.result_lines(prefix, loss))

        def model_chunks(self) -> list:
            """Every model chunk's DDP (the optimizer's chunks): megatron_opt.checkpoint names their params by
            megatron-core's global keys, so a checkpoint loads at another TP / PP / DP layout."""
            return list(self.ddps)

        def layout(self) -> str:
            args = self.args
            vp = args.virtual_pipeline_model_parallel_size
            return (f"TP={args.tensor_model_parallel_size}{' (sequence parallel)' if args.sequence_parallel else ''}"
                    f" x PP={args.pipeline_model_parallel_size}{f' (VP={vp})' if vp else ''} x "
                    f"CP={args.context_parallel_size} x DP={args.data_parallel_size}"
                    + (f", EP={args.expert_model_parallel_size} ({args.num_experts} experts, expert "
                       f"TP={args.expert_tensor_parallel_size})" if args.num_experts else ""))

        def data_extra(self) -> dict:
            """The data position of each data-parallel rank (all the ranks of one hold the same), run-wide: the
            per-rank extras come back only at the same world size and by global rank, which at another TP / PP
            layout is another data-parallel rank, so a resume takes its position from here instead."""
            from megatron.core import parallel_state

            gathered: list = [None] * self.world
            dist.all_gather_object(gathered, (parallel_state.get_data_parallel_rank(), self.source.rank_state()))
            by_dp_rank = dict(reversed(gathered))  # any rank of each data-parallel rank
            return {"data_by_dp_rank": [by_dp_rank[r] for r in range(len(by_dp_rank))]}

        def resume_data(self, state: Any) -> None:
            """The position this data-parallel rank saved, at any TP / PP layout of the same data-parallel size
            (at another size the built-in corpus' streams start afresh, as at data parallelism; megatron-core's
            datasets continue from the consumed samples at any size)."""
            from megatron.core import parallel_state

            saved = state.extra.get("data_by_dp_rank")
            same_dp = saved is not None and len(saved) == self.args.data_parallel_size
            self.source.resume(saved[parallel_state.get_data_parallel_rank()] if same_dp else None, state.iteration)

        def header(self) -> None:
            args = self.args
            n_params = count_params(list(self.model))
            threads, threads_from = self.threads
            self.say(f"megatron_opt pretrain_gpt: megatron-core GPTModel, {n_params / 1e6:.2f}M params, "
                     f"{self.layout()}, "
                     f"world {self.world}, device={self.device}, dtype={self.dtype}, "
                     f"{'distributed' if args.use_distributed_optimizer else 'non-distributed'} optimizer, "
                     f"loss mode={args.loss_mode}, global batch {args.global_batch_size} = {args.micro_batch_size} x "
                     f"{args.num_microbatches} micro-batches x DP {args.data_parallel_size}, {args.train_iters} "
                     f"iterations, {threads} intra-op thread{'s' if threads > 1 else ''} per rank ({threads_from})",
                     f"data: {self.source.description}")
            if args.data_split_defaulted:
                self.say(f"warning: --data-path without --split: using Megatron-LM's legacy default "
                         f"{pretrain_data.LEGACY_DEFAULT_SPLIT!r}")
            if args.loss_scale is not None and not (args.fp16 or args.bf16):
                self.say("note: --loss-scale has no effect without --fp16 or --bf16 (as in Megatron-LM)")

    return ModelParallelJob


__all__ = ["add_args", "wanted", "check_args", "job_class", "transformer_config", "build_chunks", "forward_step",
           "loss_func", "loss_terms", "count_params"]
