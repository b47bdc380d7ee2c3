"""The main job's --save/--load with model parallelism (scripts/pretrain_model_parallel.py over
megatron_opt.checkpoint's megatron-core keys), on CPU/gloo under torchrun.

One TP2 x PP2 run saves at iteration 2 of 4 (its --load folder does not exist yet: it says so and
trains from scratch). From that checkpoint, fresh processes at TP2 x PP2 continue bit for bit as the
run itself did (--log-json values, and the checkpoints at iteration 4), and fresh processes at
TP1 x PP1 (--use-mcore-models) continue as a TP1 x PP1 run from scratch does, to fp32 reduction
order. --no-save-rng leaves the ranks' RNG states out. The --save/--load rules of the data-parallel
path hold (a --save over newer iterations is refused), and a checkpoint with local param names is
refused at a model-parallel layout, before anything runs.
"""
from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import megatron_opt.checkpoint as ckpt
from tests.main_job.main_job_script import write_fake_manifest
from megatron_opt_train.flags import parse_args
# the model-parallel test's tiny model (4 iterations), launcher and fp32 reduction-order tolerances
from tests.main_job.test_pretrain_model_parallel import LOSS_RTOL, NORM_RTOL, _pretrain

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="needs megatron-core")

TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]  # DP 1 at 4 ranks
SAVED_AT = 2  # of the 4 iterations


def _by_iteration(records: list[dict]) -> dict[int, dict]:
    return {r["iteration"]: r for r in records}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """TP2 x PP2 x DP1 for 4 iterations, saving at iteration 2 and at the end, with --load of the same
    (not yet existing) folder, as a restartable job script runs it."""
    tmp = tmp_path_factory.mktemp("tp2pp2")
    folder = tmp / "ckpt"
    stdout, records = _pretrain(tmp, "straight", 4, *TP2_PP2, "--load", str(folder), "--save", str(folder),
                                "--save-interval", str(SAVED_AT))
    assert "TP=2 x PP=2 x CP=1 x DP=1, world 4" in stdout, stdout
    assert f"pretrain_gpt.py: --load {folder}: no checkpoint (the folder does not exist); training from scratch" \
        in stdout, stdout
    assert ckpt.latest_iteration(folder) == 4 and (folder / f"iter_{SAVED_AT:07d}").is_dir()
    info = ckpt.read_info(folder, SAVED_AT)
    assert info.global_param_keys and info.world_size == 4, info
    return {"tmp": tmp, "folder": folder, "records": _by_iteration(records)}


def _rank_states(folder) -> dict[str, dict]:
    """The 'rank/<r>' entries of a checkpoint folder (each rank's RNG states and extras), read with DCP."""
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    state = {key: None for key in metadata.state_dict_metadata if key.startswith("rank/")}
    planner = DefaultLoadPlanner(flatten_state_dict=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder)), planner=planner, no_dist=True)
    return {key: planner.state_dict[key] for key in state}


def test_resume_at_the_same_layout_is_bit_exact(saved):
    """TP2 x PP2: iterations 3-4 after the resume equal the uninterrupted run's exactly, and so do the
    model, masters and moments it saves at iteration 4 (its own saves without RNG: --no-save-rng)."""
    tmp, folder = saved["tmp"], saved["folder"]
    resumed = tmp / "resumed"
    stdout, records = _pretrain(tmp, "resumed", 4, *TP2_PP2, "--load", str(folder / f"iter_{SAVED_AT:07d}"),
                                "--save", str(resumed), "--no-save-rng")
    assert (f"resumed from iteration {SAVED_AT} (saved at TP=2 x PP=2 x CP=1 x DP=1, now TP=2 x PP=2 x CP=1 x DP=1) "
            f"from {folder / f'iter_{SAVED_AT:07d}'}") in stdout, stdout
    ours, straight = _by_iteration(records), saved["records"]
    assert sorted(ours) == [3, 4]
    for it in ours:
        assert ours[it] == straight[it], (it, ours[it], straight[it])
    for what in ("model", "master", "exp_avg", "exp_avg_sq"):
        x, y = ckpt.read_tensors(folder, what), ckpt.read_tensors(resumed, what)
        assert sorted(x) == sorted(y)
        for name in x:
            assert torch.equal(x[name], y[name]), f"{what} {name} differs after the resume"
    # each rank's RNG states are in the straight run's checkpoint, not in the one saved with --no-save-rng
    with_rng, without = _rank_states(folder / "iter_0000004"), _rank_states(resumed / "iter_0000004")
    assert sorted(with_rng) == sorted(without) == [f"rank/{r}" for r in range(4)], (sorted(with_rng), sorted(without))
    assert all(s["rng"] is not None for s in with_rng.values()) and all(s["rng"] is None for s in without.values())


def test_tp2_pp2_checkpoint_continues_at_tp1(saved):
    """The TP2 x PP2 checkpoint loads at TP1 x PP1 (one rank; megatron-core's GPTModel) and continues as
    the TP1 x PP1 run from scratch does, to fp32 reduction order; the data position (the built-in
    corpus' stream of data-parallel rank 0) continues though the world size changed."""
    tmp, folder = saved["tmp"], saved["folder"]
    _, straight = _pretrain(tmp, "tp1_straight", 1, "--use-mcore-models")
    stdout, records = _pretrain(tmp, "tp1_resumed", 1, "--use-mcore-models", "--load",
                                str(folder / f"iter_{SAVED_AT:07d}"))
    assert (f"resumed from iteration {SAVED_AT} (saved at TP=2 x PP=2 x CP=1 x DP=1, now TP=1 x PP=1 x CP=1 x DP=1)"
            in stdout), stdout
    ours, theirs = _by_iteration(records), _by_iteration(straight)
    assert sorted(ours) == [3, 4] and sorted(theirs) == [1, 2, 3, 4]
    for it in ours:
        a, b = ours[it], theirs[it]
        assert a["consumed_samples"] == b["consumed_samples"] and a["learning_rate"] == b["learning_rate"], (a, b)
        assert a["lm loss"] == pytest.approx(b["lm loss"], rel=LOSS_RTOL, abs=0), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=NORM_RTOL, abs=0), (a, b)


def _refused(monkeypatch, capsys, world: int, flags: list[str]) -> str:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exc:
        parse_args(["--num-layers", "4", *flags])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("pretrain_gpt.py: error: ") and err.count("error:") == 1, err
    return err


def test_save_and_load_rules_before_anything_runs(saved, tmp_path, monkeypatch, capsys):
    """As at data parallelism, --save refuses to move a folder's tracker back over newer iterations;
    and a checkpoint whose params carry local names cannot be placed in a model-parallel layout."""
    folder = saved["folder"]
    err = _refused(monkeypatch, capsys, 4, [*TP2_PP2, "--load", str(folder / f"iter_{SAVED_AT:07d}"),
                                            "--save", str(folder)])
    assert (f"--save {folder} already holds iteration 4, newer than this run's start (it resumes from iteration "
            f"{SAVED_AT} of --load {folder / f'iter_{SAVED_AT:07d}'})") in err, err
    local = tmp_path / "local" / "iter_0000003"  # as megatron_opt.checkpoint writes at data parallelism
    write_fake_manifest(local, 3)
    err = _refused(monkeypatch, capsys, 2, ["--tensor-model-parallel-size", "2", "--load", str(local.parent)])
    assert f"--load {local.parent}: iteration 3 names its params locally" in err, err
