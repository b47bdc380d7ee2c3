"""What megatron-core's own optimizer='lion' is (megatron_opt refuses megatron-core's config for it by name:
config_conversion.MEGATRON_CORE_LION): built by megatron-core itself (no install()) on its GPTModel, it is a chain of
emerging-optimizers' Lion over the 2-D weights that are not embedding or output, with betas (adam_beta1, adam_beta2)
whatever lion_beta1 / lion_beta2 say, and AdamW over every other param. If megatron-core changes this, this test
fails and the refusal is to be revisited."""
from __future__ import annotations

import dataclasses

import pytest

from tests.mcore import mcore_cpu


def _lion_chain() -> list:
    import megatron.core.optimizer as core_optimizer
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    with mcore_cpu.model_parallel_state(), mcore_cpu.cpu_megatron_core():
        config = mcore_cpu.transformer_config(False)
        model = mcore_cpu.build_gpt(config)
        ddp = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(), module=model)
        opt = core_optimizer.get_megatron_optimizer(core_optimizer.OptimizerConfig(
            optimizer="lion", lr=1e-3, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.9, lion_beta1=0.5,
            lion_beta2=0.6), [ddp], use_gloo_process_groups=True)
        out = []
        for child in getattr(opt, "chained_optimizers", [opt]):
            params = [p for g in child.optimizer.param_groups for p in g["params"]]
            out.append((type(child.optimizer).__name__, {tuple(g["betas"]) for g in child.optimizer.param_groups},
                        {p.dim() == 2 and not getattr(p, "is_embedding_or_output_parameter", False) for p in params}))
        return out


def _run_in_one_rank_pool(pools):
    return pools(1).run(_lion_chain, timeout=120)[0]


def test_megatron_cores_lion_is_lion_on_linear_weights_with_adam_betas_and_adamw_elsewhere(pools):
    import megatron.core.optimizer as core_optimizer

    if "lion_beta1" not in {f.name for f in dataclasses.fields(core_optimizer.OptimizerConfig)}:
        pytest.skip("this megatron-core has no optimizer='lion' (0.16.1)")
    chain = _run_in_one_rank_pool(pools)
    assert chain == [("Lion", {(0.8, 0.9)}, {True}), ("AdamW", {(0.8, 0.9)}, {False})], chain
