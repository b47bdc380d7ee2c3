"""The main job with model parallelism (scripts/pretrain_model_parallel.py): megatron-core's GPTModel
through its schedule and finalize_model_grads on megatron_opt, on CPU/gloo under torchrun.

TP2 (sequence parallel) x PP2 (two virtual stages) x DP2 at 8 ranks logs the same per-iteration loss
and grad norm as TP1 x PP1 x DP2 at 2 ranks on the same global batch, to fp32 reduction order;
EP2 with two experts trains; the layouts the script cannot run are refused before any process group;
the CPU patches of megatron-core (megatron_opt_train/components/megatron_core_on_cpu.py) are applied and undone."""
from __future__ import annotations

import importlib.util
import json
import subprocess

import pytest
import torch

from tests.main_job.main_job_script import ENV, ROOT, SCRIPT, TORCHRUN
from megatron_opt_train.flags import parse_args

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="needs megatron-core")

# A tiny model; the vocabulary is padded to 128 at TP 1 and 2 (Megatron-LM pads to a multiple of
# --make-vocab-size-divisible-by x TP), so both layouts have the same model.
TINY = ["--hidden-size", "32", "--num-layers", "4", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4", "--lr-warmup-iters", "1",
        "--make-vocab-size-divisible-by", "64", "--eval-iters", "0", "--use-distributed-optimizer"]
# fp32 reduction order: the split matmuls, the TP all-reduces and the pipeline change the order of sums.
LOSS_RTOL, NORM_RTOL = 2e-6, 2e-6


def _pretrain(tmp_path, name: str, world: int, *flags: str) -> tuple[str, list[dict]]:
    log = tmp_path / f"{name}.jsonl"
    cmd = [*TORCHRUN, f"--nproc_per_node={world}", SCRIPT, *TINY, "--log-json", str(log), *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out.stdout, [json.loads(line) for line in log.read_text().splitlines()]


@pytest.fixture(scope="module")
def tp1(tmp_path_factory) -> list[dict]:
    """The baseline: megatron-core's GPTModel at TP1 x PP1 x DP2."""
    stdout, records = _pretrain(tmp_path_factory.mktemp("tp1"), "tp1", 2, "--use-mcore-models")
    assert "megatron-core GPTModel" in stdout and "TP=1 x PP=1 x CP=1 x DP=2, world 2" in stdout, stdout
    losses = [r["lm loss"] for r in records]
    assert len(losses) == 4 and losses[-1] < losses[0], losses  # it trains
    return records


def _assert_same_run(records: list[dict], baseline: list[dict]) -> None:
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    for ours, theirs in zip(records, baseline):
        assert (ours["consumed_samples"] == theirs["consumed_samples"]
                and ours["learning_rate"] == theirs["learning_rate"])
        # iteration 1's loss compares the initial weights; the later ones the updates too
        assert ours["lm loss"] == pytest.approx(theirs["lm loss"], rel=LOSS_RTOL, abs=0), (ours, theirs)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=NORM_RTOL, abs=0), (ours, theirs)


def test_tp2_sp_pp2_dp2_matches_tp1(tmp_path, tp1):
    """docs/pretrain.md's command: tensor (sequence) parallel, interleaved pipeline with two virtual
    stages per rank and the gradient reduction overlapped with the backward (the plain 1F1B schedule,
    without --num-layers-per-virtual-pipeline-stage, matches too; one 8-rank run keeps the test short)."""
    stdout, records = _pretrain(tmp_path, "tp2pp2", 8, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                                "--overlap-grad-reduce")
    assert "TP=2 (sequence parallel) x PP=2 (VP=2) x CP=1 x DP=2, world 8" in stdout, stdout
    _assert_same_run(records, tp1)


def test_interleaved_pipeline_with_more_micro_batches_than_stages_matches_tp1(tmp_path):
    """PP2 x VP2 at DP1 runs 4 micro-batches through 2 stages, so the interleaved schedule sends
    activations and gradients of one shape to the one peer in the same round: each direction must keep
    to its own stream (Megatron-LM's overlapped, unbatched p2p), or a gradient lands in an activation."""
    _, records = _pretrain(tmp_path, "pp2vp2", 2, "--pipeline-model-parallel-size", "2",
                           "--num-layers-per-virtual-pipeline-stage", "1", "--train-iters", "2")
    _, baseline = _pretrain(tmp_path, "tp1dp1", 1, "--use-mcore-models", "--train-iters", "2")
    assert [r["iteration"] for r in records] == [1, 2]
    for ours, theirs in zip(records, baseline):
        assert ours["lm loss"] == pytest.approx(theirs["lm loss"], rel=LOSS_RTOL, abs=0), (ours, theirs)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=NORM_RTOL, abs=0), (ours, theirs)


def test_expert_parallel_trains(tmp_path):
    """EP2 with two experts and the all-gather dispatcher (its experts are drawn per expert-parallel
    rank, so its numbers are not the dense run's): it trains, finitely."""
    stdout, records = _pretrain(tmp_path, "ep2", 2, "--num-experts", "2", "--expert-model-parallel-size", "2",
                                "--moe-token-dispatcher-type", "allgather")
    assert "DP=2, EP=2 (2 experts, expert TP=1)" in stdout, stdout
    losses = [r["lm loss"] for r in records]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


# ----------------------------------------------------------------------------- refused before anything runs
@pytest.mark.parametrize("world, flags, message", [
    (3, ["--tensor-model-parallel-size", "2"],
     "world size 3 is not divisible by --tensor-model-parallel-size 2 x --pipeline-model-parallel-size 1 x "
     "--context-parallel-size 1 = 2"),
    (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "3"],
     "world size 8 is not divisible by --tensor-model-parallel-size 2 x --pipeline-model-parallel-size 3"),
    (4, ["--context-parallel-size", "2"], "needs Transformer Engine's attention for context parallelism"),
    (4, ["--expert-model-parallel-size", "2"], "--expert-model-parallel-size 2 needs --num-experts"),
    (2, ["--num-experts", "2", "--moe-token-dispatcher-type", "alltoall", "--device", "cpu"],
     "--moe-token-dispatcher-type alltoall needs CUDA"),
    (4, ["--pipeline-model-parallel-size", "2", "--num-layers", "3"],
     "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
    (4, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"],
     "into at least two virtual stages"),
])
def test_layouts_the_script_cannot_run_are_refused(monkeypatch, capsys, world, flags, message):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exc:
        parse_args(["--num-layers", "4", *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("pretrain_gpt.py: error: ") and message in err, err


def test_data_parallel_size_is_world_over_tp_pp_cp(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = parse_args(["--num-layers", "4", "--tensor-model-parallel-size", "2",
                       "--pipeline-model-parallel-size", "2", "--sequence-parallel",
                       "--micro-batch-size", "2", "--num-microbatches", "3"])
    assert args.data_parallel_size == 2 and args.global_batch_size == 2 * 3 * 2 and args.sequence_parallel
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = parse_args(["--sequence-parallel"])  # Megatron-LM: off at TP 1
    assert args.data_parallel_size == 2 and not args.sequence_parallel


# ----------------------------------------------------------------------------- the CPU patches
def test_cpu_patches_apply_and_undo():
    import megatron.core.models.backends as backends
    import megatron.core.tensor_parallel.layers as tp_layers
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_opt_train.components import megatron_core_on_cpu

    before = {"cuda": "cuda" in vars(torch.Tensor), "gemm": "te_general_gemm" in vars(moe_utils),
              "reduce": tp_layers.reduce_from_tensor_model_parallel_region, "ln": backends.LNImpl,
              "sync": torch.cuda.synchronize}
    with pytest.raises(RuntimeError, match="inside"):
        with megatron_core_on_cpu.on_cpu():
            t = torch.ones(2)
            assert t.cuda() is t and torch.cuda.current_device() == torch.device("cpu")
            torch.cuda.synchronize()  # a no-op
            assert moe_utils.te_general_gemm is None or before["gemm"]
            if before["ln"] is WrappedTorchNorm:
                config = type("Config", (), {"normalization": "LayerNorm", "sequence_parallel": True})()
                norm = backends.LNImpl(config, 8)
                assert isinstance(norm, torch.nn.LayerNorm)
                assert all(p.sequence_parallel for p in norm.parameters())
            raise RuntimeError("inside")  # the patches are undone when the body raises
    after = {"cuda": "cuda" in vars(torch.Tensor), "gemm": "te_general_gemm" in vars(moe_utils),
             "reduce": tp_layers.reduce_from_tensor_model_parallel_region, "ln": backends.LNImpl,
             "sync": torch.cuda.synchronize}
    assert after == before
    # On CUDA only the fallbacks for missing Transformer Engine / apex apply, never the CPU patches.
    with megatron_core_on_cpu.patched(torch.device("cuda")):
        assert "cuda" not in vars(torch.Tensor) and torch.cuda.synchronize is before["sync"]
