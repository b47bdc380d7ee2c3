"""The model-parallel runner: megatron-core's GPTModel split by tensor (with sequence), pipeline
(1F1B and interleaved) and expert parallelism, trained through megatron-core's schedule and
finalize_model_grads on megatron_opt's DistributedDataParallel and optimizer, as Megatron-LM's
pretrain_gpt.py + training.py do it.

The Trainer takes this runner when a model-parallel size is above 1, or with --num-experts or
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
(components/megatron_core_on_cpu.py).

Checkpoints: --save/--load, --save-interval and the rest of the main job's checkpoint flags work here as
at data parallelism (the Trainer's save/resume, components/resume.py's rules: the tracker,
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

Not here yet (each refused with its reason by megatron_core_args.check_args): context parallelism (megatron-core's
local attention needs Transformer Engine for it), --log-params-norm.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist

import megatron_opt as mo
from megatron_opt.megatron import arguments as megatron_args
from megatron_opt.megatron.muon_call import WHOLE_TENSOR_NAMES, tag_qkv_split_shapes
from megatron_opt.optimizer.step import phase_timers

from ..components.data import Batch, build_source, padded_vocab_size
from ..components.megatron_core_on_cpu import patched
from ..components.timers import PhaseTimers
from .base import Place, Runner
from .megatron_core_model import build_chunks, count_params, dist_device, forward_step, loss_terms, transformer_config


class ModelParallelRunner(Runner):
    """megatron-core's model chunks under megatron_opt's DDP and optimizer, stepped by megatron-core's
    schedule with finalize_model_grads, as Megatron-LM's train_step."""

    def __init__(self, args: argparse.Namespace, place: Place, timers: PhaseTimers) -> None:
        """parallel_state, the data of this data-parallel rank, the model chunks, megatron_opt's DDP per
        chunk and optimizer over all of them, the schedule, and Megatron-LM's setup of the config."""
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.transformer.module import Float16Module

        super().__init__(args, place, timers)
        device = place.device
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
        with patched(device):
            tensor_parallel.model_parallel_cuda_manual_seed(args.seed)  # the tracker megatron-core forks
        self.source = build_source(args, parallel_state.get_data_parallel_rank(),
                                   parallel_state.get_data_parallel_world_size())
        self.dtype = megatron_args.params_dtype_from_args(args)
        vocab = padded_vocab_size(self.source.vocab_size,
                                  args.make_vocab_size_divisible_by * args.tensor_model_parallel_size)
        self.config = transformer_config(args, self.dtype)
        with patched(device):
            chunks = build_chunks(args, self.config, vocab)
        chunks = [chunk.to(device) for chunk in chunks]
        self.model = torch.nn.ModuleList(chunks)
        modules = [Float16Module(self.config, c) for c in chunks] if args.fp16 or args.bf16 else chunks
        ddp_config = megatron_args.ddp_config_from_args(args)
        with patched(device):  # the last stage's tied weight is synced at construction
            self.ddps = [mo.DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=m,
                                                    disable_bucketing=index > 0)
                         for index, m in enumerate(modules)]
        if args.optimizer in WHOLE_TENSOR_NAMES:  # megatron-core's own matrix-optimizer path tags the QKV weights
            tag_qkv_split_shapes(self.ddps)          # likewise (AdaptiveMuon's split is Muon's; SOAP reads none)
        self.optimizer = mo.get_megatron_optimizer(self.optimizer_config(), self.ddps)
        self.scheduler = megatron_args.scheduler_from_args(self.optimizer, args)
        self.data_parallel_size = args.data_parallel_size
        one = (lambda funcs: funcs[0]) if len(self.ddps) == 1 else (lambda funcs: funcs)
        if args.overlap_grad_reduce:  # Megatron-LM's setup_model_and_optimizer (align_grad_reduce: default)
            self.config.no_sync_func = one([ddp.no_sync for ddp in self.ddps])
            self.config.grad_sync_func = one([ddp.start_grad_sync for ddp in self.ddps])
        if args.overlap_param_gather:
            self.config.param_sync_func = one([ddp.start_param_sync for ddp in self.ddps])
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = self.optimizer.scale_loss
        # finalize_model_grads times its gradient sync by Megatron-LM's name; the rest of megatron-core's
        # timers (forward-compute, ...) are this runner's or the Trainer's own.
        self.config.timers = timers.only(phase_timers.GRAD_SYNC)
        self.forward_step = timers.wrap(forward_step, "forward-compute", level=2)

    def schedule(self, batches: list[Batch], forward_only: bool) -> list[dict]:
        """megatron-core's forward-backward over the micro-batches: the last stage's loss reports."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        args = self.args
        with patched(self.place.device):
            data = [iter(batches) for _ in self.ddps] if len(self.ddps) > 1 else iter(batches)
            return get_forward_backward_func()(
                forward_step_func=self.forward_step, data_iterator=data, model=self.ddps,
                num_microbatches=len(batches), seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                decoder_seq_length=None, forward_only=forward_only)

    def train_step(self, batches: list[Batch]) -> mo.TrainStepResult:
        """Megatron-LM's train_step: zero the grad buffers, the schedule (finalize_model_grads in it),
        the optimizer, the schedule's step by the global batch when the update happened."""
        args = self.args
        for ddp in self.ddps:
            ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self.schedule(batches, forward_only=False)
        with self.timers.time(phase_timers.OPTIMIZER):  # as Megatron-LM's train_step times it
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

    def evaluation_loss(self, split: str, consumed: int) -> float:
        """The evaluation through megatron-core's forward-only schedule."""
        args = self.args
        for ddp in self.ddps:
            ddp.eval()
        terms = torch.zeros(2, dtype=torch.float64, device=dist_device())
        with torch.no_grad():
            for k in range(args.eval_iters):
                batches = [tuple(t.to(self.place.device) for t in batch) for batch in
                           self.source.eval_batches(split, consumed + k * args.global_batch_size,
                                                    args.num_microbatches)]
                terms += loss_terms(self.schedule(batches, forward_only=True), args.loss_mode == "per_token",
                                    terms.device)
        for ddp in self.ddps:
            ddp.train()
        dist.all_reduce(terms)
        return (terms[0] / terms[1].clamp(min=1)).item()

    def layout(self) -> str:
        args = self.args
        vp = args.virtual_pipeline_model_parallel_size
        return (f"TP={args.tensor_model_parallel_size}{' (sequence parallel)' if args.sequence_parallel else ''}"
                f" x PP={args.pipeline_model_parallel_size}{f' (VP={vp})' if vp else ''} x "
                f"CP={args.context_parallel_size} x DP={args.data_parallel_size}"
                + (f", EP={args.expert_model_parallel_size} ({args.num_experts} experts, expert "
                   f"TP={args.expert_tensor_parallel_size})" if args.num_experts else ""))

    def describe(self) -> str:
        n_params = count_params(list(self.model))
        return (f"megatron-core GPTModel, {n_params / 1e6:.2f}M params, {self.layout()}, world {self.place.world}, "
                f"device={self.place.device}, dtype={self.dtype}")

    def data_extra(self) -> dict:
        """The data position of each data-parallel rank (all the ranks of one hold the same), run-wide: the
        per-rank extras come back only at the same world size and by global rank, which at another TP / PP
        layout is another data-parallel rank, so a resume takes its position from here instead."""
        from megatron.core import parallel_state

        gathered: list = [None] * self.place.world
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


__all__ = ["ModelParallelRunner"]
