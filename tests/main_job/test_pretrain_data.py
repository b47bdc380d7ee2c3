"""The main job's Megatron-LM data, evaluation and log blocks, through megatron-core's own data code.

A fixture made here (scripts/pretrain_fixture.py: a GPT-2-format vocabulary and merges, and documents
written with megatron-core's IndexedDatasetBuilder), then three torchrun launches:

* A, DP=2: Megatron-LM's data block (--data-path with weights, --split, GPT2BPETokenizer), its evaluation
  block and its logging flags. Every log line matches Megatron-LM's training_log format; validation
  lines come at --eval-interval and after training (validation and test split); the timers, params
  norm, throughput and memory are there; TensorBoard gets the scalars.
* B, DP=1, from A's iteration-2 checkpoint at the same global batch: iterations 3-4 read the samples A
  read (same losses up to the reduction order) and its validation at iteration 4 reads A's validation
  samples; in the same TensorBoard folder, each iteration's point is there once (A's 3-4 replaced).
* C: --skip-train evaluates the loaded model only.
Plus the data flags' errors, in this process.
"""
from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
from pathlib import Path

import pytest

from tests.main_job.main_job_script import (ENV, MEGATRON_VALIDATION_LINE, ROOT, SCRIPT, TORCHRUN,
                             log_lines)
from megatron_opt_train.flags import parse_args

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None,
                                reason="megatron-core is not installed (pip install megatron-core)")

SMALL = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "1",
         "--train-iters", "4"]


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    from megatron_opt_train.fixture import write_fixture

    out = tmp_path_factory.mktemp("data")
    write_fixture(str(out), merges=8, limit=300)
    return out


def _data_block(d) -> list[str]:
    prefix = str(d / "corpus_text_document")
    return ["--data-path", "30", prefix, "70", prefix, "--split", "90,8,2", "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", str(d / "gpt2-vocab.json"), "--merge-file", str(d / "gpt2-merges.txt")]


def _run(world: int, flags: list[str]) -> str:
    out = subprocess.run([*TORCHRUN, f"--nproc_per_node={world}", SCRIPT, *SMALL, *flags], capture_output=True,
                         text=True, timeout=240, env=ENV, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _records(path) -> dict[int, dict]:
    return {r["iteration"]: r for r in map(json.loads, path.read_text().splitlines())}


def _validations(stdout: str) -> dict[str, float]:
    return {m["prefix"]: float(m["loss"]) for m in map(MEGATRON_VALIDATION_LINE.match, stdout.splitlines()) if m}


@pytest.mark.timeout(600)
def test_megatron_data_eval_and_log_blocks(fixture_dir, tmp_path):
    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    log_a, log_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a = _run(2, [*_data_block(fixture_dir), "--eval-interval", "2", "--eval-iters", "2", "--save", str(ckpt),
                 "--save-interval", "2", "--tensorboard-dir", str(tb), "--log-json", str(log_a), "--log-throughput",
                 "--log-params-norm", "--timing-log-level", "2", "--log-memory-to-tensorboard",
                 "--log-world-size-to-tensorboard", "--log-validation-ppl-to-tensorboard",
                 "--log-timers-to-tensorboard"])
    # Megatron-LM's log line, every field in its format
    lines = log_lines(a)
    assert [int(m["iteration"]) for m in lines] == [1, 2, 3, 4], a
    assert [int(m["consumed"]) for m in lines] == [4, 8, 12, 16] and {int(m["gbs"]) for m in lines} == {4}
    assert all(m["params_norm"] and m["tflops"] and m["mfu"] is None for m in lines), a  # no MFU on CPU
    assert all(" mem RSS (MB): " in line and " mem max RSS (MB): " in line
               for line in a.splitlines() if line.startswith(" [")), a
    records = _records(log_a)
    assert [float(m["loss"]) for m in lines] == [float(f"{records[i]['lm loss']:.6E}") for i in (1, 2, 3, 4)]
    for name in ("forward-backward", "all-grads-sync", "optimizer", "optimizer-unscale-and-check-inf",
                 "optimizer-inner-step", "params-all-gather", "batch-generator", "forward-compute", "backward-compute"):
        assert a.count(f"    {(name + ' ').ljust(48, '.')}: (") == 4, (name, a)
    # timed by the optimizer itself, and by megatron_opt.train_step, through OptimizerConfig.timers
    for name in ("optimizer-unscale-and-check-inf", "optimizer-inner-step", "all-grads-sync", "optimizer"):
        times = re.findall(rf"    {re.escape((name + ' ').ljust(48, '.'))}: \(([0-9.]+), ([0-9.]+)\)", a)
        assert len(times) == 4 and all(float(high) > 0.0 for _, high in times), (name, times)
    assert "data: --data-path 30 " in a and "GPT2BPETokenizer vocabulary 265 padded to 384" in a, a
    # Megatron-LM's validation lines: at --eval-interval, then validation and test after training
    val_a = _validations(a)
    assert list(val_a) == ["iteration 2", "iteration 4", "iteration 4 on validation set", "iteration 4 on test set"]

    # B: DP=1 from iteration 2 (same global batch): the same samples as A's iterations 3 and 4
    b = _run(1, [*_data_block(fixture_dir), "--eval-interval", "2", "--eval-iters", "2", "--load",
                 str(ckpt / "iter_0000002"), "--tensorboard-dir", str(tb), "--log-json", str(log_b)])
    assert "resumed from iteration 2 (saved at DP=2, now DP=1)" in b, b
    b_records = _records(log_b)
    assert sorted(b_records) == [3, 4]
    for i in (3, 4):  # another reduction order: equal to rounding; other samples would differ by far more
        assert math.isclose(b_records[i]["lm loss"], records[i]["lm loss"], rel_tol=1e-5), (i, b_records, records)
    assert math.isclose(_validations(b)["iteration 4"], val_a["iteration 4"], rel_tol=1e-4), (b, val_a)
    _check_tensorboard(tb, records, b_records)

    # C: --skip-train evaluates the loaded model (iteration 4) and trains nothing
    c = _run(1, [*_data_block(fixture_dir), "--eval-iters", "1", "--load", str(ckpt), "--skip-train"])
    assert not log_lines(c) and list(_validations(c)) == ["iteration 4 on validation set",
                                                          "iteration 4 on test set"], c
    assert "done:" not in c


def _huggingface_copy(fixture: Path, out: Path) -> Path:
    """The fixture's GPT-2 vocabulary and merges as a HuggingFace tokenizer folder (tokenizer.json), saved
    with transformers, as --tokenizer-model takes it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE.from_file(str(fixture / "gpt2-vocab.json"), str(fixture / "gpt2-merges.txt")))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(str(out))
    return out


@pytest.mark.timeout(300)
def test_huggingface_tokenizer_trains_as_the_same_gpt2_vocabulary(fixture_dir, tmp_path):
    """--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR goes through megatron-core's own
    HuggingFace tokenizer class: over the fixture's vocabulary it gives the same vocabulary size and
    end-of-document id as GPT2BPETokenizer, so the same data trains to the same losses, bitwise."""
    hf = _huggingface_copy(fixture_dir, tmp_path / "hf")
    data = _data_block(fixture_dir)[:7]  # --data-path ... --split ...
    logs, vocabularies = {}, {}
    for name, tokenizer in (("gpt2", _data_block(fixture_dir)[7:]),
                            ("hf", ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf)])):
        logs[name] = tmp_path / f"{name}.jsonl"
        out = _run(1, [*data, *tokenizer, "--train-iters", "2", "--log-json", str(logs[name])])
        vocabularies[name] = re.findall(r"(\w+) vocabulary (\d+) padded to (\d+)", out)
    assert vocabularies["gpt2"][0][0] == "GPT2BPETokenizer" and vocabularies["hf"][0][0] == "HuggingFaceTokenizer"
    assert vocabularies["gpt2"][0][1:] == vocabularies["hf"][0][1:], vocabularies
    gpt2, hf_records = _records(logs["gpt2"]), _records(logs["hf"])
    assert sorted(hf_records) == [1, 2] and [r["lm loss"] for r in hf_records.values()] == \
        [r["lm loss"] for r in gpt2.values()], (gpt2, hf_records)


def _check_tensorboard(tb, a_records: dict[int, dict], b_records: dict[int, dict]) -> None:
    if importlib.util.find_spec("tensorboard") is None:
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("lm loss", "lm loss validation", "lm loss validation vs samples", "lm loss validation ppl",
                "world-size", "params-norm", "mem-allocated-bytes", "mem-max-allocated-bytes", "iteration-time",
                "throughput", "forward-backward-time", "optimizer-time"):
        assert tag in tags, (tag, sorted(tags))
    steps = [e.step for e in acc.Scalars("lm loss")]
    assert steps == [1, 2, 3, 4], steps  # A's 3 and 4 were replaced by B's, not doubled
    assert [e.step for e in acc.Scalars("lm loss vs samples")] == [4, 8, 12, 16]
    latest = {e.step: e.value for e in acc.Scalars("lm loss")}
    import torch

    as_f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731
    assert [latest[i] for i in (1, 2, 3, 4)] == [as_f32(a_records[1]["lm loss"]), as_f32(a_records[2]["lm loss"]),
                                                 as_f32(b_records[3]["lm loss"]), as_f32(b_records[4]["lm loss"])]
    assert [e.step for e in acc.Scalars("lm loss validation")] == [2, 4, 4]  # A's at 2; B's at 4 and after training


# ----------------------------------------------------------------------------- the data flags' errors
DATA_ERRORS = [
    (["--data-path", "nowhere/corpus"], "--data-path: nowhere/corpus.bin, nowhere/corpus.idx not found"),
    (["--data-path", "30", "PREFIX", "70"], "give prefixes alone (PREFIX ...) or weight-prefix pairs"),
    (["--data-path", "PREFIX"], "--data-path needs --tokenizer-type"),
    (["--data-path", "PREFIX", "--tokenizer-type", "GPT2BPETokenizer"],
     "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"),
    (["--data-path", "PREFIX", "--mock-data"], "--data-path and --mock-data are exclusive"),
    (["--mock-data"], "--mock-data needs a tokenizer: --tokenizer-type NullTokenizer --vocab-size N"),
    (["--vocab-file", "v.json"], "--vocab-file without --data-path or --mock-data"),
    (["--eval-interval", "0"], "--eval-interval must be a positive integer, got 0"),
    (["--skip-train"], "--skip-train evaluates a loaded model: give --load with a checkpoint"),
]


@pytest.mark.parametrize("flags, expected", DATA_ERRORS, ids=[" ".join(f) for f, _ in DATA_ERRORS])
def test_data_flag_errors(fixture_dir, monkeypatch, capsys, flags, expected):
    monkeypatch.setenv("WORLD_SIZE", "1")
    flags = [str(fixture_dir / "corpus_text_document") if f == "PREFIX" else f for f in flags]
    with pytest.raises(SystemExit) as exc:
        parse_args(flags)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("pretrain_gpt.py: error: ") and expected in err, err
    assert err.count("error:") == 1 and "usage:" not in err, err


def test_data_flags_parse(fixture_dir, monkeypatch):
    """--split defaults to Megatron-LM's legacy "969, 30, 1" with --data-path (and the run says so)."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = parse_args([*_data_block(fixture_dir)[:5], *_data_block(fixture_dir)[7:]])
    assert args.split == "969, 30, 1" and args.data_split_defaulted
    args = parse_args(_data_block(fixture_dir))
    assert args.split == "90,8,2" and not args.data_split_defaulted and args.data_path[0] == "30"


def test_missing_megatron_core_is_a_clear_error(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("megatron") else real(name, *a))
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit):
        parse_args(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"])
    err = capsys.readouterr().err
    assert "use megatron-core's data code (megatron.core.datasets), which is not installed: `pip install " \
           "megatron-core`" in err, err
