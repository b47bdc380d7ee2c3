"""Train a tiny GPT with Megatron-Bridge's own ``pretrain()`` on CPU (gloo), optionally with megatron_opt.

    OMP_NUM_THREADS=1 CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --standalone --nproc_per_node=2 \
        tools/megatron_bridge_cpu/run.py [--megatron-opt] [--install-late] [--tp N] [--pp N] \
        [--optimizer adam|dist_muon|muon] [--recipe-ddp] [--iters N] [--save DIR] [--load DIR] \
        [--ckpt-step N] [--save-interval N] [--exit-interval N]

Bridge's public API only: a ``GPTModelProvider`` (megatron-core's local layer spec: no Transformer
Engine), a ``ConfigContainer`` with Bridge's mock GPT data and NullTokenizer, ``pretrain(config,
gpt_step.forward_step, callbacks=[...])``. With --megatron-opt the one line ``import megatron_opt.megatron;
megatron_opt.megatron.install()`` comes before Bridge is imported (with --install-late: after).
--recipe-ddp trains with the DistributedDataParallelConfig of Bridge's GPT-3 175B pretrain recipe
(average_in_collective, grad_reduce_in_fp32, check_for_nan_in_grad, both overlaps, the distributed
optimizer). --optimizer dist_muon builds Muon with Bridge's ``distributed_muon_with_cosine_annealing``.
A callback prints, on the last rank, one ``PRECISE {json}`` line per iteration (losses, grad norm, zero
count, loss scale, skipped) in the format tools/megatron_lm_cpu/compare.py parses. compare.py runs the
matrix. Everything runs under ``if __name__ == "__main__"``: torch_dist's save workers re-import this file.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 128}
BATCH = {"micro_batch_size": 2, "global_batch_size": 8}
LR = 1e-3


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--megatron-opt", action="store_true", help="the one line, before Bridge's imports")
    p.add_argument("--install-late", action="store_true", help="with --megatron-opt: after Bridge's imports")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--optimizer", default="adam", choices=["adam", "dist_muon", "muon"])
    p.add_argument("--recipe-ddp", action="store_true", help="Bridge's GPT-3 175B recipe DDP config")
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--save")
    p.add_argument("--load")
    p.add_argument("--ckpt-step", type=int, help="with --load: the iteration to load (default: the latest)")
    p.add_argument("--save-interval", type=int)
    p.add_argument("--exit-interval", type=int)
    return p.parse_args(argv)


def optimizer_and_scheduler(opts: argparse.Namespace):
    """Adam with Megatron-LM's pretrain_gpt.py defaults (as tools/megatron_lm_cpu runs it), or Bridge's
    distributed-Muon recipe helper with fp32 Newton-Schulz ('high' is fp32 on the CPU)."""
    from megatron.bridge.training.config import OptimizerConfig, SchedulerConfig
    if opts.optimizer == "adam":
        optimizer = OptimizerConfig(optimizer="adam", lr=LR, min_lr=0.0, weight_decay=0.01, clip_grad=1.0,
                                    adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, use_distributed_optimizer=True,
                                    log_num_zeros_in_grad=True)
        scheduler = SchedulerConfig(lr_decay_style="linear", lr_warmup_iters=0, start_weight_decay=0.01,
                                    end_weight_decay=0.01, weight_decay_incr_style="constant")
        return optimizer, scheduler
    from megatron.bridge.recipes.utils.optimizer_utils import distributed_muon_with_cosine_annealing
    optimizer, scheduler = distributed_muon_with_cosine_annealing(
        precision="fp32", muon_fp32_matmul_prec="high", lr_warmup_iters=0, lr_decay_iters=opts.iters, max_lr=LR,
        min_lr=0.0)  # min_lr=None fails in megatron-core's scheduler (asserts min_lr >= 0.0)
    optimizer.optimizer = opts.optimizer  # 'muon': the non-distributed one (megatron-core's fp32 reference)
    optimizer.log_num_zeros_in_grad = True
    return optimizer, scheduler


def ddp_config(opts: argparse.Namespace):
    from megatron.bridge.training.config import DistributedDataParallelConfig
    if opts.recipe_ddp:
        # A Bridge pretraining recipe's DDP config (grad_reduce_in_fp32, average_in_collective, ...). The GPT-3
        # 175B recipe builds its model provider without Hugging Face (the Llama and Qwen recipes fetch a config
        # from the Hub); only its DDP config is used.
        from megatron.bridge.recipes.gpt.h100 import gpt3_175b_pretrain_32gpu_h100_bf16_config
        return gpt3_175b_pretrain_32gpu_h100_bf16_config().ddp
    distributed = opts.optimizer != "muon"
    return DistributedDataParallelConfig(use_distributed_optimizer=distributed, overlap_grad_reduce=True,
                                         overlap_param_gather=distributed, check_for_nan_in_grad=True)


def config(opts: argparse.Namespace):
    """The ConfigContainer: tiny GPT, mock data, fp32, gloo, 2 ranks."""
    from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec
    from megatron.bridge.training.config import (CheckpointConfig, ConfigContainer, DistributedInitConfig,
                                                 LoggerConfig, MockGPTDatasetConfig, RNGConfig, TokenizerConfig,
                                                 TrainingConfig, ValidationConfig)
    model = GPTModelProvider(**MODEL,
                             tensor_model_parallel_size=opts.tp, pipeline_model_parallel_size=opts.pp,
                             transformer_layer_spec=local_layer_spec,  # no Transformer Engine
                             # no fused CUDA kernels on the CPU (as tools/megatron_lm_cpu's flags)
                             masked_softmax_fusion=False, gradient_accumulation_fusion=False,
                             persist_layer_norm=False, cross_entropy_loss_fusion=False)
    optimizer, scheduler = optimizer_and_scheduler(opts)
    return ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=opts.iters, exit_interval=opts.exit_interval, **BATCH),
        validation=ValidationConfig(eval_iters=0, eval_interval=None),
        optimizer=optimizer,
        scheduler=scheduler,
        ddp=ddp_config(opts),
        dataset=MockGPTDatasetConfig(seq_length=MODEL["seq_length"], random_seed=1234, reset_position_ids=False,
                                     reset_attention_mask=False, eod_mask_loss=False, dataloader_type="single",
                                     num_workers=0, pin_memory=False, persistent_workers=False, split="9999,8,2"),
        logger=LoggerConfig(log_interval=1),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=MODEL["vocab_size"]),
        checkpoint=CheckpointConfig(save=opts.save, load=opts.load, ckpt_step=opts.ckpt_step,
                                    save_interval=opts.save_interval, ckpt_format="torch_dist",
                                    exit_on_missing_checkpoint=opts.load is not None),
        rng=RNGConfig(seed=1234),
        dist=DistributedInitConfig(distributed_backend="gloo"),
        mixed_precision=None,  # fp32: the two optimizers then differ by fp32 summation order only
    )


def recorder():
    """A Bridge callback: the last rank prints each iteration's values at full precision. The zero count is
    not in Bridge's callback context: it is read from optimizer.step()'s return value (wrapped, read only)."""
    import torch
    from megatron.bridge.training.callbacks import Callback

    class Recorder(Callback):
        def on_train_start(self, context) -> None:
            optimizer, step = context.optimizer, context.optimizer.step

            def recording_step(*args, **kwargs):
                result = step(*args, **kwargs)
                context.user_state["num_zeros"] = result[2]
                return result
            optimizer.step = recording_step
            # which classes Bridge's setup built (install() replaces both)
            context.user_state["modules"] = {"optimizer_module": type(optimizer).__module__,
                                             "ddp_module": type(context.model[0]).__module__}

        def on_train_step_end(self, context) -> None:
            if torch.distributed.get_rank() != torch.distributed.get_world_size() - 1:
                return
            zeros = context.user_state.get("num_zeros")
            record = {"iteration": context.state.train_state.step + 1,
                      "loss_scale": float(context.optimizer.get_loss_scale()),
                      "skipped": int(bool(context.skipped_iter)),
                      "grad_norm": None if context.grad_norm is None else float(context.grad_norm),
                      "num_zeros": None if zeros is None else float(zeros),
                      "losses": {k: float(v[0] / v[1]) if isinstance(v, tuple) else float(v)
                                 for k, v in (context.loss_dict or {}).items()},
                      **context.user_state["modules"]}
            print("PRECISE " + json.dumps(record), flush=True)

    return Recorder()


def main(argv: list[str]) -> None:
    opts = parse_args(argv)
    sys.path[:0] = [os.path.join(os.path.dirname(HERE), "megatron_lm_cpu"), HERE]
    import cpu_shim
    import bridge_shim
    cuda_to_cpu = cpu_shim.install()  # noqa: F841  (entered for the rest of the process)
    bridge_shim.stub_transformer_engine_for_lora_layers()
    if opts.megatron_opt and not opts.install_late:
        import megatron_opt.megatron; megatron_opt.megatron.install()  # noqa: E702  (the one line)
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain
    bridge_shim.install_training()
    if opts.megatron_opt and opts.install_late:
        import megatron_opt.megatron; megatron_opt.megatron.install()  # noqa: E702  (the one line)
    pretrain(config(opts), forward_step, callbacks=[recorder()])


if __name__ == "__main__":
    main(sys.argv[1:])
