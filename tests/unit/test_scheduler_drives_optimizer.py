"""megatron-core's own OptimizerParamScheduler drives megatron_opt's optimizer: the same lr / wd
sequence as ours for 100 steps, and the update the optimizer applies follows the written lr."""
import copy
import warnings

import torch

import megatron_opt as mo
from tests.support.common import Probe, TinyLM, build, sgd_exact

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler as CoreScheduler

KW = dict(init_lr=1e-4, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=80, lr_decay_steps=800, lr_decay_style="cosine",
          start_wd=0.01, end_wd=0.1, wd_incr_steps=800, wd_incr_style="linear")


def test_megatron_core_scheduler_drives_our_param_groups():
    model = TinyLM()
    _, opt = build(model, lr=1e-2, min_lr=1e-3, weight_decay=0.1)
    twin_groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    twin = type("Twin", (), {"param_groups": [dict(g, params=[]) for g in twin_groups]})()
    ours, core = mo.OptimizerParamScheduler(twin, **KW), CoreScheduler(opt, **KW)
    assert any(g["wd_mult"] == 0.0 for g in opt.param_groups) and any(g["wd_mult"] == 1.0 for g in opt.param_groups)
    for _ in range(100):
        ours.step(increment=8)
        core.step(increment=8)
        for a, b in zip(opt.param_groups, twin.param_groups):
            assert a["lr"] == b["lr"] and a["weight_decay"] == b["weight_decay"]


def test_optimizer_applies_the_scheduled_lr():
    """SGD, lr set by megatron-core's scheduler: the update is exactly -lr * gradient."""
    model = Probe(numel=300)
    ddp, opt = build(model, **sgd_exact())
    core = CoreScheduler(opt, **{**KW, "start_wd": 0.0, "end_wd": 0.0, "wd_incr_style": "constant"})
    for step in range(3):
        core.step(increment=8)
        lr = opt.param_groups[0]["lr"]
        before = model.w.detach().clone()
        res = mo.train_step(ddp, opt, None, [(2.0, 1)], lambda m, b: (m(b[0]) * b[1], b[1]))
        assert res.success and res.lr == lr
        torch.testing.assert_close(before - model.w.detach(), torch.full_like(before, 2.0 * lr), rtol=1e-6, atol=0)
