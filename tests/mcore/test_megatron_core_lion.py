"""megatron-core's own optimizer='lion' against megatron_opt's through install().

megatron-core (0.19.2; Megatron-LM main the same) sends 'lion' through its emerging-optimizer path: a chain of
emerging-optimizers' Lion over the 2-D weights that are not embedding or output, with betas (adam_beta1,
adam_beta2) whatever lion_beta1 / lion_beta2 say, and AdamW over every other param. install() converts its config to
megatron_opt's Lion with ``lion_scope='matrices'`` and those betas (config_conversion.as_optimizer_config).

Both built on megatron-core's GPTModel (one rank, the same weights and batches, fp32, Megatron-LM's scheduler at a
constant lr and weight decay), three steps: the same chain (which params each child updates, its betas); the AdamW
params' update within 1e-4 of the whole AdamW update (megatron-core's AdamW is torch's, ours pass 2's); the Lion
params within a few ulps where the sign agrees (the weight decay's rounding). Lion's update is lr * sign(c): where c
is within an ulp of 0 the two may take other signs (emerging-optimizers' ``calculate_lion_update`` is
torch.compile'd; its weight decay is p + p * (-lr wd), ours p * (1 - lr wd)); such elements are counted (at most
1e-3 of them; measured 0 of 75264).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.mcore import mcore_cpu

LR, WD, BETAS, LION_BETAS, STEPS = 1e-3, 0.1, (0.8, 0.9), (0.5, 0.6), 3


def _train(installed: bool, sharded: bool = False) -> dict:
    """Build megatron-core's GPT, its DDP and get_megatron_optimizer (megatron_opt's after install()), train STEPS
    steps on fixed batches (each rank its own): the params after each step, and per child (optimizer class, betas,
    its params' names). ``sharded`` (megatron_opt's run only): use_distributed_optimizer, as Megatron-LM's
    --use-distributed-optimizer asks of megatron_opt (megatron-core's own: its layer-wise optimizer)."""
    import megatron_opt.megatron

    with mcore_cpu.model_parallel_state(), mcore_cpu.cpu_megatron_core():
        if installed:
            megatron_opt.megatron.install()
        try:
            import megatron.core.distributed as core_distributed  # megatron_opt's names after install()
            import megatron.core.optimizer as core_optimizer
            from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

            config = mcore_cpu.transformer_config(False)
            model = mcore_cpu.build_gpt(config, seed=3)
            ddp = core_distributed.DistributedDataParallel(
                config=config, ddp_config=core_distributed.DistributedDataParallelConfig(
                    grad_reduce_in_fp32=True, use_distributed_optimizer=sharded), module=model)
            opt = core_optimizer.get_megatron_optimizer(core_optimizer.OptimizerConfig(
                optimizer="lion", lr=LR, weight_decay=WD, adam_beta1=BETAS[0], adam_beta2=BETAS[1],
                lion_beta1=LION_BETAS[0], lion_beta2=LION_BETAS[1], clip_grad=0.0, use_distributed_optimizer=sharded),
                [ddp], use_gloo_process_groups=True)
            # Megatron-LM's scheduler sets each group's lr and weight decay (wd_mult 0: biases and norms)
            sched = OptimizerParamScheduler(opt, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0,
                                            lr_decay_steps=10, lr_decay_style="constant", start_wd=WD, end_wd=WD,
                                            wd_incr_steps=10, wd_incr_style="constant")
            names = {id(p): n for n, p in model.named_parameters()}
            chain = []  # per child: (its optimizer, its betas, its params)
            for child in opt.chained_optimizers:
                if installed:  # (a leaf's groups hold its masters; gather_main_params names its params)
                    params = sorted(n.removeprefix("module.") for n in child.gather_main_params())
                    c = child.config
                    betas = (c.lion_beta1, c.lion_beta2) if c.optimizer == "lion" else (c.adam_beta1, c.adam_beta2)
                    chain.append(({"lion": "Lion", "adam": "AdamW"}[c.optimizer], {betas}, params))
                else:
                    params = sorted(names[id(p)] for g in child.param_groups for p in g["params"])
                    chain.append((type(child.optimizer).__name__,
                                  {tuple(g["betas"]) for g in child.optimizer.param_groups}, params))
            gen = torch.Generator().manual_seed(5 + torch.distributed.get_rank())
            out = {"chain": chain, "params": []}
            for _ in range(STEPS):
                ddp.zero_grad_buffer()
                opt.zero_grad()
                batch = mcore_cpu.microbatch(gen, 2)
                loss = (mcore_cpu.token_losses(ddp, batch) * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
                loss.backward()
                ddp.finish_grad_sync()
                opt.step()
                sched.step(increment=1)
                out["params"].append({n: p.detach().double().clone() for n, p in model.named_parameters()})
            out["init"] = {n: p.detach().double().clone() for n, p in mcore_cpu.build_gpt(config, seed=3)
                           .named_parameters()}
            return out
        finally:
            if installed:
                megatron_opt.megatron.uninstall()


def _both(sharded: bool) -> tuple[dict, dict]:
    mcore_cpu.init_parallel_state()
    return _train(False), _train(True, sharded)


@pytest.mark.parametrize("world, sharded", [(1, False), (2, True)])
def test_install_runs_megatron_cores_lion(pools, world, sharded):
    """One rank; and DP 2 with megatron_opt's Lion and AdamW sharded (the gradients reduced alike: a + b)."""
    import megatron.core.optimizer as core_optimizer

    if "lion_beta1" not in {f.name for f in dataclasses.fields(core_optimizer.OptimizerConfig)}:
        pytest.skip("this megatron-core has no optimizer='lion' (0.16.1)")
    core, ours = pools(world).run(_both, sharded, timeout=240)[0]
    (lion_cls, lion_betas, lion_params), (adam_cls, adam_betas, adam_params) = core["chain"]
    assert (lion_cls, lion_betas, adam_cls, adam_betas) == ("Lion", {BETAS}, "AdamW", {BETAS}), core["chain"]
    assert len(lion_params) == 9 and all(n.endswith(".weight") for n in lion_params), lion_params  # 4 per layer + pos
    assert ours["chain"] == core["chain"], (ours["chain"], core["chain"])
    init = core["init"]
    flipped = total = 0
    for step, (theirs, mine) in enumerate(zip(core["params"], ours["params"])):
        adam_diff = adam_change = 0.0
        for n, t in theirs.items():
            diff = (mine[n] - t).abs()
            if n in lion_params:  # per element: a few ulps of the weight (the decay's rounding), or a flipped sign
                flips = diff > LR / 2
                ulps = 4 * (step + 1) * 2.0 ** -23 * t.abs().clamp_min(LR)  # of w, and of w - lr (the step)
                assert bool((diff <= ulps)[~flips].all()), (n, step, float((diff - ulps)[~flips].max()))
                assert float(diff.max()) <= 2 * LR * (step + 1) + 1e-6, (n, step, float(diff.max()))
                flipped, total = flipped + int(flips.sum()), total + diff.numel()
            else:
                adam_diff += float(diff.square().sum())
                adam_change += float((t - init[n]).square().sum())
        # AdamW over the model, as tests/mcore/test_megatron_core.py compares it: torch's AdamW and pass 2 round
        # otherwise, and Adam lifts a bias gradient that is rounding noise (K's, softmax-invariant) toward +-lr
        assert (adam_diff / adam_change) ** 0.5 <= 1e-4, (step, (adam_diff / adam_change) ** 0.5)
    assert flipped <= 1e-3 * total, (flipped, total)
