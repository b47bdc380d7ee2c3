"""megatron_opt.checkpoint: bit-exact resume, resharding across DP sizes, validation before mutation,
async saves, export (CPU, gloo)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

import megatron_opt as mo
import megatron_opt.checkpoint as ckpt
from megatron_opt.checkpoint import directory
from megatron_opt.optimizer.state.boxes import flat_range_to_boxes

from tests.checkpoint import cases_checkpoint as cc

STEPS = 4


def _equal_digest(a: dict, b: dict, where: str) -> None:
    for i, (x, y) in enumerate(zip(a["params"], b["params"])):
        assert torch.equal(x, y), f"{where}: param {i} differs"
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert torch.equal(a["state"][k], b["state"][k]), f"{where}: optimizer state {k} differs"
    assert a["scalars"] == b["scalars"], where
    assert a["sched"] == b["sched"], where
    assert a["losses"][-len(b["losses"]):] == b["losses"], where


# ----------------------------------------------------------------------------- bit-exact resume
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("precision, async_save", [("fp32", False), ("bf16", True), ("fp16", False), ("fp16", True),
                                                   ("bf16_rem", True)])
def test_resume_is_bit_exact(pools, tmp_path, world, precision, async_save):
    pool = pools(world)
    straight = pool.run(cc.resume_case, str(tmp_path), precision, "straight", STEPS, async_save)
    pool.run(cc.resume_case, str(tmp_path), precision, "first", STEPS, async_save)
    assert ckpt.latest_iteration(tmp_path) == STEPS // 2
    resumed = pool.run(cc.resume_case, str(tmp_path), precision, "second", STEPS, async_save)
    for rank, (a, b) in enumerate(zip(straight, resumed)):
        assert b["iteration"] == STEPS // 2 and b["rng"]
        assert b["consumed"] == STEPS // 2 * cc.MB * cc.GA * world
        _equal_digest(a, b, f"world={world} {precision} async={async_save} rank={rank}")


# ----------------------------------------------------------------------------- resharding
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16_rem"])
def test_reshard_from_dp2_to_dp3_1_4_and_unsharded(pools, tmp_path, precision):
    saved = tmp_path / "dp2"
    straight = pools(2).run(cc.save_after_steps, str(saved), precision, 3)
    originals = {what: ckpt.read_tensors(saved, what) for what in ("model", "master", "exp_avg", "exp_avg_sq")}
    for world, distributed in ((3, True), (1, True), (4, True), (2, False)):
        resave = tmp_path / f"resaved_{world}_{distributed}"
        results = pools(world).run(cc.load_resharded, str(saved), str(resave), precision, distributed)
        for what, tensors in originals.items():
            again = ckpt.read_tensors(resave, what)
            for name, t in tensors.items():
                assert torch.equal(again[name], t), f"{what} {name} changed going DP=2 -> DP={world} ({distributed})"
        for res in results:
            assert res["saved_dp"] == 2 and res["rng"] == (world == 2)
        # Training goes on: at DP=2 without sharding the data and the state are those of the straight
        # DP=2 continuation, so the params agree up to the reduction (all-reduce vs reduce-scatter).
        for res in results:
            assert all(torch.isfinite(torch.tensor(res["losses"])))
        if world == 2:
            tol = 1e-6 if precision == "fp32" else 1e-2
            for a, b in zip(straight[0]["params"], results[0]["params"]):
                assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol), "DP=2 unsharded continuation"


def test_16_bit_state_loads_fp32_state_and_back(pools, tmp_path):
    """A checkpoint of fp32 moments loads into bf16 moments with remainders (rounded to nearest; the
    masters exactly, as fp32 values), and that state saved again loads into fp32 moments (widened)."""
    saved, sixteen, back = tmp_path / "fp32_state", tmp_path / "bf16_state", tmp_path / "fp32_again"
    pools(2).run(cc.save_after_steps, str(saved), "bf16", 2)
    pools(3).run(cc.load_resharded, str(saved), str(sixteen), "bf16_rem", True)
    pools(2).run(cc.load_resharded, str(sixteen), str(back), "bf16", True)
    for what in ("exp_avg", "exp_avg_sq"):
        original, rounded, widened = (ckpt.read_tensors(p, what) for p in (saved, sixteen, back))
        for name, t in original.items():
            assert rounded[name].dtype == torch.bfloat16 and torch.equal(rounded[name], t.to(torch.bfloat16)), name
            assert widened[name].dtype == torch.float32 and torch.equal(widened[name], rounded[name].float()), name
    masters = [ckpt.read_tensors(p, "master") for p in (saved, sixteen, back)]
    for name, t in masters[0].items():
        assert t.dtype == torch.float32
        assert torch.equal(masters[1][name], t) and torch.equal(masters[2][name], t), name


def test_lion_state_reshards(pools, tmp_path):
    saved = tmp_path / "lion"
    pools(2).run(cc.save_after_steps, str(saved), "fp32", 2, "lion")
    resave = tmp_path / "lion3"
    pools(3).run(cc.load_resharded, str(saved), str(resave), "fp32", True, "lion")
    for what in ("master", "exp_avg"):
        a, b = ckpt.read_tensors(saved, what), ckpt.read_tensors(resave, what)
        assert all(torch.equal(a[k], b[k]) for k in a), what


@pytest.mark.parametrize("world", [3, 1])
def test_muon_state_reshards(pools, tmp_path, world):
    """Muon's momentum_buffer (and its AdamW companion's moments) reshard in model space, bitwise."""
    saved = tmp_path / "muon"
    pools(2).run(cc.save_after_steps, str(saved), "fp32", 2, "muon")
    resave = tmp_path / f"muon{world}"
    pools(world).run(cc.load_resharded, str(saved), str(resave), "fp32", True, "muon")
    assert set(ckpt.read_tensors(saved, "momentum_buffer")) == {"emb.weight", "fc.weight", "out.weight"}  # 2-D
    for what in ("master", "momentum_buffer", "exp_avg", "exp_avg_sq"):
        a, b = ckpt.read_tensors(saved, what), ckpt.read_tensors(resave, what)
        assert a and set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), what


def test_boxes_cover_any_flat_range_exactly():
    for shape in [(7, 5), (3, 4, 6), (13,), (), (1, 1, 9), (4, 1, 3, 2)]:
        n = int(torch.tensor(shape).prod()) if shape else 1
        full = torch.arange(n).reshape(shape)
        for start in range(n + 1):
            for end in range(start, n + 1):
                seen = []
                for box in flat_range_to_boxes(shape, start, end):
                    region = full[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))] if shape else full
                    assert region.reshape(-1)[0].item() == box.flat_start
                    seen += region.reshape(-1).tolist()
                assert seen == list(range(start, end)), (shape, start, end)


# ----------------------------------------------------------------------------- damaged checkpoints
def _damage(folder, how: str) -> None:
    data = sorted(p for p in folder.iterdir() if p.suffix == ".distcp")
    if how == "truncated":
        with open(data[0], "r+b") as f:
            f.truncate(os.path.getsize(data[0]) // 2)
    elif how == "missing_file":
        data[-1].unlink()
    elif how == "corrupt":
        with open(data[0], "r+b") as f:
            f.seek(os.path.getsize(data[0]) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif how == "missing_manifest":
        (folder / directory.MANIFEST).unlink()
    elif how == "garbled_manifest":
        (folder / directory.MANIFEST).write_text("[1, 2")
    elif how == "truncated_metadata":
        with open(folder / ".metadata", "r+b") as f:
            f.truncate(10)
    elif how == "altered_metadata":
        _drop_a_key_from_metadata(folder)


def _drop_a_key_from_metadata(folder) -> str:
    """Rewrite DCP's .metadata without one optimizer key: it still unpickles, only its hash can tell."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(folder)).read_metadata()
    key = next(k for k in metadata.state_dict_metadata if k.startswith("optim/exp_avg/"))
    del metadata.state_dict_metadata[key]
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return key


def _as_an_older_manifest(folder) -> None:
    """The manifest as megatron_opt wrote it before it recorded the world size and hashed .metadata."""
    manifest = directory.read_manifest(folder)
    manifest.pop("world_size")
    manifest["files"].pop(".metadata")
    directory.write_manifest(folder, manifest)


@pytest.mark.parametrize("damage", ["truncated", "missing_file", "corrupt", "missing_manifest", "garbled_manifest",
                                    "truncated_metadata", "altered_metadata", "wrong_model", "no_checkpoint"])
def test_damaged_checkpoint_raises_everywhere_and_changes_nothing(pools, tmp_path, damage):
    pool = pools(2)
    pool.run(cc.save_after_steps, str(tmp_path), "fp32", 1)
    folder = directory.iteration_dir(tmp_path, 1)
    if damage == "no_checkpoint":
        shutil.rmtree(tmp_path)
    elif damage != "wrong_model":
        _damage(folder, damage)
    results = pool.run(cc.load_damaged, str(tmp_path), damage, timeout=60)
    expect = {"truncated": "truncated", "missing_file": "is missing", "corrupt": "corrupt",
              "missing_manifest": "not a complete checkpoint",
              "garbled_manifest": "megatron_opt_manifest.json cannot be read (JSONDecodeError",
              "truncated_metadata": ".metadata is corrupt",
              "altered_metadata": ".metadata is corrupt",
              "wrong_model": "different model", "no_checkpoint": "no checkpoint"}[damage]
    for res in results:
        assert res["error"] is not None and expect in res["error"], res
        assert res["untouched"], f"rank {res['rank']}: the model or optimizer changed before the error"
        assert res["seconds"] < 20


def test_nonfinite_saved_state_is_rejected(pools, tmp_path):
    pool = pools(2)
    pool.run(cc.save_with_nan_moment, str(tmp_path))
    for res in pool.run(cc.load_damaged, str(tmp_path), "nan", timeout=60):
        assert res["error"] and "non-finite" in res["error"] and res["untouched"], res


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_check_reaches_past_its_first_slice(bad):
    from megatron_opt.optimizer.state.view import FINITE_CHECK_SLICE, first_nonfinite

    n = 3 * FINITE_CHECK_SLICE + 5  # the check goes in slices; the bad value is in the last
    named = {"a": torch.zeros(7), "b": torch.zeros(n), "steps": torch.zeros(3, dtype=torch.int64)}
    assert first_nonfinite(named.items()) is None
    named["b"][-1] = bad
    assert first_nonfinite(named.items()) == "b"


def test_dcp_failure_names_each_rank_cause(pools, tmp_path):
    """A load that DCP itself refuses (an older checkpoint, whose manifest does not hash .metadata,
    with a .metadata missing a key) raises a CheckpointError stating DCP's cause per rank, not a traceback."""
    pool = pools(2)
    pool.run(cc.save_after_steps, str(tmp_path), "fp32", 1)
    folder = directory.iteration_dir(tmp_path, 1)
    _as_an_older_manifest(folder)
    key = _drop_a_key_from_metadata(folder)
    for res in pool.run(cc.load_damaged, str(tmp_path), "dcp", timeout=60):
        assert res["error"] is not None and res["untouched"], res
        assert f"rank 0: RuntimeError: Missing key in checkpoint state_dict: {key}" in res["error"], res["error"]
        assert "Traceback" not in res["error"], res["error"]


# ----------------------------------------------------------------------------- async saves
def test_async_save_failure_raises_on_every_rank(pools, tmp_path):
    for res in pools(2).run(cc.async_save_failure, str(tmp_path), timeout=120):
        assert res["error"] is not None and "disk full" in res["error"] and "rank 1" in res["error"], res
        assert res["tracker"] is None, "a failed save must not become the latest checkpoint"


def test_async_save_equals_sync_save(pools, tmp_path):
    pools(2).run(cc.async_save_overlaps_training, str(tmp_path))
    for what in ("model", "master", "exp_avg", "exp_avg_sq"):
        a = ckpt.read_tensors(tmp_path / "sync", what)
        b = ckpt.read_tensors(tmp_path / "async", what)
        assert all(torch.equal(a[k], b[k]) for k in a), f"{what}: the background save saw later updates"


# ----------------------------------------------------------------------------- retention, export, old API
def test_keep_latest_k_and_tracker(pools, tmp_path):
    pools(2).run(cc.save_iterations, str(tmp_path), [1, 2, 3, 4], 2)
    assert ckpt.complete_iterations(tmp_path) == [3, 4]
    assert ckpt.latest_iteration(tmp_path) == 4
    assert not list(tmp_path.glob(".tmp_iter_*"))

    # read_info describes what a load would read, without a process group or loading anything
    info = ckpt.read_info(tmp_path)
    assert (info.folder, info.iteration, info.has_optimizer, info.has_scheduler) == \
        (ckpt.resolve(tmp_path), 4, True, True), info
    assert (info.data_parallel_size, info.world_size, info.global_param_keys) == (2, 2, False), info
    assert ckpt.read_info(tmp_path, 3).iteration == 3 and ckpt.read_info(info.folder).iteration == 4
    (info.folder / directory.MANIFEST).write_text('{"iteration": 4')  # a manifest cut short
    with pytest.raises(mo.CheckpointError, match=r"megatron_opt_manifest.json cannot be read .*the checkpoint is "
                                                 r"damaged: load another iteration"):
        ckpt.read_info(tmp_path)
    (info.folder / directory.MANIFEST).write_text("[4]")  # valid JSON, but not the manifest's object
    with pytest.raises(mo.CheckpointError, match=r"cannot be read \(TypeError: a JSON list, not an object\)"):
        ckpt.read_info(tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        ckpt.read_info(tmp_path / "typo")


def test_export_cli_writes_a_plain_state_dict(pools, tmp_path):
    pools(2).run(cc.save_after_steps, str(tmp_path / "ck"), "bf16", 2)
    out = tmp_path / "model.pt"
    subprocess.run([sys.executable, "-m", "megatron_opt.checkpoint", "export", str(tmp_path / "ck"), str(out)],
                   check=True, capture_output=True, timeout=120)
    exported = torch.load(out, weights_only=True)
    model = cc.TinyLM(torch.bfloat16)
    model.load_state_dict(exported)  # names, shapes and dtypes of a plain module
    masters = ckpt.read_model_state(tmp_path / "ck", masters=True)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), masters[name].to(p.dtype)), name


def test_optimizer_state_dict_at_another_dp_points_to_checkpoint(pools, tmp_path):
    path = str(tmp_path / "sd.pt")
    pools(2).run(cc.save_state_dicts, path)
    for message in pools(3).run(cc.state_dict_other_dp, path):
        assert "megatron_opt.checkpoint" in message, message


def test_load_in_one_process_without_a_process_group(pools, tmp_path):
    """Inspection and export: load() of a DP=2 checkpoint in this (non-distributed) test process."""
    import torch.distributed as dist
    assert not dist.is_initialized()
    pools(2).run(cc.save_after_steps, str(tmp_path), "bf16", 2)
    model, ddp, opt, sched = cc.build_run("bf16", seed=321)
    state = ckpt.load(tmp_path, ddp, opt, sched)
    assert state.saved_data_parallel_size == 2 and state.rank_extra is None and not state.rng_restored
    masters = opt.gather_main_params()
    saved = ckpt.read_tensors(tmp_path, "master")
    assert all(torch.equal(masters[k], saved[k]) for k in saved)
    assert all(torch.equal(p.detach(), saved[n].to(p.dtype)) for n, p in model.named_parameters())


def test_a_scheduler_mismatch_is_refused_before_anything_changes(pools, tmp_path):
    pools(2).run(cc.save_after_steps, str(tmp_path), "fp32", 1)
    for res in pools(2).run(cc.load_with_other_schedule, str(tmp_path), timeout=60):
        assert res["error"] is not None and "scheduler" in res["error"] and res["untouched"], res


def test_chained_optimizer_with_two_update_rules_round_trips(pools, tmp_path):
    saved = pools(2).run(cc.chained_with_two_rules, str(tmp_path), "save")
    loaded = pools(2).run(cc.chained_with_two_rules, str(tmp_path), "load")
    for a, b in zip(saved, loaded):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_older_checkpoint_still_loads(pools, tmp_path):
    """A manifest without the world size and without the .metadata hash (megatron_opt before both)."""
    pools(2).run(cc.save_after_steps, str(tmp_path), "fp32", 2)
    _as_an_older_manifest(directory.iteration_dir(tmp_path, 2))
    model, ddp, opt, sched = cc.build_run("fp32", seed=321)
    state = ckpt.load(tmp_path, ddp, opt, sched)
    assert state.saved_data_parallel_size == 2 and state.saved_world_size == 2 and state.iteration == 2
    saved = ckpt.read_tensors(tmp_path, "master")
    assert all(torch.equal(v, saved[k]) for k, v in opt.gather_main_params().items())


def test_the_manifest_records_the_data_parallel_size_not_the_world_size(pools, tmp_path):
    pools(2).run(cc.data_parallel_inside_a_larger_world, str(tmp_path), "save")
    info = ckpt.read_info(tmp_path)
    assert info.data_parallel_size == 1 and info.world_size == 2, info
    for res in pools(2).run(cc.data_parallel_inside_a_larger_world, str(tmp_path), "load"):
        assert res == dict(saved_dp=1, saved_world=2, rng=True), res


# ----------------------------------------------------------------------------- the in-memory state_dict
def test_chained_state_dict_covers_every_rule_and_round_trips(pools):
    for res in pools(2).run(cc.chained_state_dict_round_trip):
        assert res["states"] == ["exp_avg", "exp_avg_sq", "master", "momentum_buffer"], res["states"]
        assert res["loaded_equal"] and res["params_equal"], res
        assert res["steps"][0] == res["steps"][1] == [2, 2], res["steps"]


def test_a_one_rank_state_dict_loads_at_any_data_parallel_size(pools, tmp_path):
    """The state_dict is per parameter: a DP=1 one holds every element, so each rank of DP=3 finds its own."""
    path = str(tmp_path / "sd.pt")
    (saved,) = pools(1).run(cc.one_rank_state_dict, path)
    for res in pools(3).run(cc.state_dict_loads_where_covered, path):
        assert res["scalars"] == saved["scalars"]
        assert res["masters"].keys() == saved["masters"].keys()
        assert all(torch.equal(res["masters"][k], v) for k, v in saved["masters"].items())
