"""megatron-core's GPTModel for the model-parallel runner, as Megatron-LM's pretrain_gpt.py builds and
steps it: the TransformerConfig from the flags, layout-independent initial weights, the model chunks
of this rank, the forward step and loss function the schedule calls, and the loss terms of a step.
megatron-core is imported inside the functions (only a run that takes this runner needs it)."""
from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any, Iterator

import torch
import torch.distributed as dist

Batch = tuple[torch.Tensor, torch.Tensor]  # (tokens, labels with -100 where no loss is taken)


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


__all__ = ["transformer_config", "seeded_layer_class", "build_chunks", "count_params", "dist_device", "loss_func",
           "forward_step", "loss_terms"]
