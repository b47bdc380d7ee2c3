"""Worker-side cases: a rule's per-matrix state (SOAP's by default, optimizer='soap'; ``optimizer`` / ``extra``:
another rule that keeps it, AdaptiveMuon's NorMuon) through install() on megatron-core's GPTModel, in Megatron-LM's
torch_dist formats and megatron_opt.checkpoint (tests/mcore/cases_checkpoint_muon.py's harness). What is compared:
every rank's per-matrix state as ``optimizer.state_dict()['matrix_state']`` gives it (the matrices homed there),
gathered to rank 0, and the losses and params of the continuation."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from tests.mcore import cases_checkpoint_muon as ccm
from tests.mcore import mcore_cpu


def homed_state(opt: Any) -> dict:
    """{(state, param key, TP rank): tensor} of every rank's homed matrices (a TP rank's are its blocks), gathered
    to every rank (a collective)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_rank()
    mine = {(state, key, tp): t for state, per_key in opt.state_dict().get("matrix_state", {}).items()
            for key, t in per_key.items()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out: dict = {}
    for part in everyone:
        for k, t in part.items():
            assert k not in out, f"{k} homed on two ranks"
            out[k] = t
    return out


def params(chunks: list) -> dict:
    return {n: p.detach().clone() for i, c in enumerate(chunks) for n, p in c.named_parameters()}


def run_save(path: str, before: int, after: int, layout_name: str = "dp", optimizer: str = "soap",
             extra: Optional[dict] = None) -> dict:
    """``before`` steps, save in every format, ``after`` more steps (the uninterrupted run); ``layout_name``:
    cases_checkpoint_muon's ('dp', or 'tp2': blockwise, each TP block's state at its home)."""
    mcore_cpu.init_parallel_state()
    layout = ccm.LAYOUTS[layout_name]
    whole = ccm.ccmp._whole_init(0, layout)
    with ccm._installed(layout):
        chunks, ddps, opt, sched, whole = ccm.build(layout_name, whole, optimizer=optimizer, **(extra or {}))
        batches = ccm.plan(before + after)
        ccm.train(layout_name, ddps, opt, sched, batches[:before])
        for fmt in ccm.FORMATS:
            ccm.save(path, fmt, chunks, ddps, opt, sched, before)
        saved = homed_state(opt)
        losses = ccm.train(layout_name, ddps, opt, sched, batches[before:])
        return {"saved": saved, "losses": losses, "params": params(chunks)}


def run_load(path: str, before: int, after: int, formats: tuple = ccm.FORMATS, layout_name: str = "dp",
             optimizer: str = "soap", extra: Optional[dict] = None, resave_path: str = "") -> dict:
    """Per format: a fresh run (other weights) loads it; the per-matrix state right after, then (``resave_path``:
    saved there in that format, as iteration ``before``) ``after`` steps."""
    mcore_cpu.init_parallel_state()
    layout = ccm.LAYOUTS[layout_name]
    whole = ccm.ccmp._whole_init(1, layout)
    out = {}
    with ccm._installed(layout):
        for fmt in formats:
            chunks, ddps, opt, sched, whole = ccm.build(layout_name, whole, optimizer=optimizer, **(extra or {}))
            ccm.load(path, fmt, chunks, ddps, opt, sched)
            loaded = homed_state(opt)
            if resave_path:
                ccm.save(resave_path, fmt, chunks, ddps, opt, sched, before)
            losses = ccm.train(layout_name, ddps, opt, sched, ccm.plan(before + after)[before:])
            out[fmt] = {"loaded": loaded, "losses": losses, "params": params(chunks)}
    return out


def load_refused(path: str, fmt: str, layout_name: str, optimizer: str = "soap", extra: Optional[dict] = None) -> str:
    """The message of a load refused (every rank), or 'loaded'."""
    try:
        run_load(path, 0, 0, (fmt,), layout_name, optimizer, extra)
    except Exception as exc:  # noqa: BLE001  (the message is what the test reads)
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


__all__ = ["run_save", "run_load", "load_refused", "homed_state", "torch"]
