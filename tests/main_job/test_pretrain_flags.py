"""scripts/pretrain_gpt.py speaks Megatron-LM's flags: a Megatron-LM launch script's optimizer, schedule,
precision, batch, logging and checkpoint block runs with only the entry point changed.

* The blocks of Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh (its mock-data and evaluation
  blocks included) and examples/gpt3/train_gpt3_175b_distributed.sh, scaled down to a tiny model, run a
  few steps on CPU at DP=2 (torchrun), log Megatron-LM's log and validation lines, and the per-step
  values they log follow the schedule the flags describe.
* Each flag maps to the right field of megatron_opt's configs (megatron_opt.megatron.arguments) or of
  the script's model, with Megatron-LM's defaults; the old flags are aliases.
* The flags the script does not implement are named together in one error (exit code 2) before any
  process group exists, "not supported yet" for Megatron-LM's, "unknown flag ...; did you mean" for
  others, once (rank 0) and without the usage text; values that are no-ops here
  (--tensor-model-parallel-size 1) are accepted.
* One intra-op thread per rank unless OMP_NUM_THREADS is set; the demo's warm-up scales with --train-iters.
* The number of micro-batches is global batch / (micro batch x data-parallel size), or an error.
* --tensorboard-dir writes Megatron-LM's scalar names (when tensorboard is installed) or says
  `pip install tensorboard` (when it is not).
"""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import megatron_opt as mo
from tests.main_job.main_job_script import (ENV, MEGATRON_VALIDATION_LINE, ROOT, SCRIPT, TORCHRUN,
                             log_lines)
from megatron_opt_train.flags import DEMO_DEFAULTS, parse_args
from megatron_opt_train.components.model import GPT
from megatron_opt.megatron import arguments as megatron_args

RUN_TIMEOUT_S = 240



def _has_tensorboard() -> bool:
    try:
        importlib.import_module("torch.utils.tensorboard")
        return True
    except ImportError:
        return False


HAS_TENSORBOARD = _has_tensorboard()

# examples/llama/train_llama3_8b_h100_fp8.sh, its blocks with the flag names and values kept, sizes scaled
# down (8B model -> 2 layers of 32; 1.95e9 samples -> 40; global batch 128 -> 4) and the paths made
# temporary. Its flags for features the script does not have are in LLAMA_UNSUPPORTED below.
LLAMA_MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
               "--max-position-embeddings", "32", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
               "--init-method-std", "0.0134", "--untie-embeddings-and-output-weights"]
LLAMA_TRAINING = ["--micro-batch-size", "1", "--global-batch-size", "4", "--train-samples", "40",
                  "--lr-decay-samples", "36", "--lr-warmup-samples", "8", "--lr", "0.00015", "--min-lr", "0.00001",
                  "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9",
                  "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16", "--calculate-per-token-loss",
                  "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5"]
LLAMA_PARALLEL = ["--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel"]
LLAMA_DDP = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
LLAMA_LOGGING = ["--log-interval", "1", "--save-interval", "5", "--log-throughput", "--ckpt-format", "torch_dist",
                 "--distributed-timeout-minutes", "60"]  # + --save, --load, --tensorboard-dir
# Its mock-data block (vocabulary 128256 -> 1000) and evaluation block (--eval-iters 32 --eval-interval 100 ->
# 2 and 5); + --data-cache-path.
LLAMA_DATA = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--split", "99,1,0",
              "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1"]
LLAMA_EVAL = ["--eval-iters", "2", "--eval-interval", "5"]
LLAMA_UNSUPPORTED = [
    ["--group-query-attention"], ["--num-query-groups", "8"], ["--kv-channels", "128"],
    ["--position-embedding-type", "rope"], ["--rotary-base", "1000000"], ["--swiglu"],
    ["--normalization", "RMSNorm"], ["--attention-backend", "fused"], ["--apply-layernorm-1p"],
    ["--disable-bias-linear"],
    ["--cross-entropy-loss-fusion"], ["--manual-gc"], ["--empty-unused-memory-level", "1"],
    ["--exit-duration-in-mins", "235"], ["--fp8-format", "hybrid"], ["--fp8-amax-history-len", "1024"],
    ["--fp8-amax-compute-algo", "max"], ["--fp8-param-gather"], ["--tiktoken-pattern", "v2"],
    ["--profile"], ["--profile-step-start", "4"], ["--profile-step-end", "6"],
]

# examples/gpt3/train_gpt3_175b_distributed.sh, scaled the same way (175B -> 2 layers of 32; 500000
# iterations -> 6; decay 430000 -> 5; global batch 1536 -> 4), --fp16 with --initial-loss-scale 4096
# added (Megatron-LM's default 2**32 spends the first ~30 iterations backing off, longer than this run).
GPT3_MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
              "--max-position-embeddings", "32", "--attention-backend", "auto"]
GPT3_TRAINING = ["--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "6", "--weight-decay", "0.1",
                 "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006", "--clip-grad", "1.0",
                 "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
                 "--lr-warmup-fraction", ".001", "--lr-decay-iters", "5", "--initial-loss-scale", "4096"]
GPT3_PARALLEL = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]
GPT3_LOGGING = ["--log-interval", "2", "--save-interval", "3"]  # + --save, --load, --tensorboard-dir


def _torchrun(world: int, args: list[str]) -> subprocess.CompletedProcess:
    out = subprocess.run([*TORCHRUN, f"--nproc_per_node={world}", SCRIPT, *args], capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S, env=ENV, cwd=ROOT)
    return out


def _read_json_log(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _parse(monkeypatch, flags: list[str], world: int = 2):
    """parse_args as under torchrun with ``world`` ranks, and what the flags configure (_run)."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    args = parse_args(flags)
    return args, _run(args)


def _run(args) -> SimpleNamespace:
    """The configs megatron_opt.megatron.arguments maps the flags to, the batch and run length the
    flags resolve to, and the shape of the script's model."""
    model = GPT(10, args)
    block = model.blocks[0]
    return SimpleNamespace(
        ddp_config=megatron_args.ddp_config_from_args(args),
        optimizer_config=megatron_args.optimizer_config_from_args(args),
        scheduler_kwargs=megatron_args.scheduler_kwargs_from_args(args),
        model_dtype=megatron_args.params_dtype_from_args(args), loss_mode=megatron_args.loss_mode_from_args(args),
        micro_batch_size=args.micro_batch_size, num_microbatches=args.num_microbatches,
        global_batch_size=args.global_batch_size, train_iters=args.train_iters, seq_length=args.seq_length,
        model={"layers": len(model.blocks), "hidden": model.tok.embedding_dim, "heads": block.heads,
               "max_positions": model.pos.num_embeddings, "ffn_hidden": block.fc1.out_features,
               "tie_embeddings": model.head is None})


def _expected_lrs(run, records: list[dict]) -> list[float]:
    """The lr after each logged step, by megatron_opt's scheduler advanced by the global batch per update."""
    group = {"params": [], "wd_mult": 1.0}
    holder = type("Groups", (), {"param_groups": [group]})()
    sched = mo.OptimizerParamScheduler(holder, **run.scheduler_kwargs)
    lrs = []
    for record in records:
        if record["success"]:
            sched.step(run.global_batch_size)
        lrs.append(group["lr"])
    return lrs


# ----------------------------------------------------------------------------- the launch-script blocks run
@pytest.mark.timeout(600)
def test_llama3_launch_block_runs_at_dp2(tmp_path, monkeypatch):
    ckpt, tb, log = tmp_path / "ckpt", tmp_path / "tb", tmp_path / "log.jsonl"
    flags = [*LLAMA_MODEL, *LLAMA_TRAINING, *LLAMA_PARALLEL, *LLAMA_DDP, *LLAMA_LOGGING, *LLAMA_DATA, *LLAMA_EVAL,
             "--data-cache-path", str(tmp_path / "cache"), "--save", str(ckpt), "--load", str(ckpt), "--log-json",
             str(log), "--log-num-zeros-in-grad"]
    if HAS_TENSORBOARD:
        flags += ["--tensorboard-dir", str(tb), "--log-timers-to-tensorboard"]
    out = _torchrun(2, flags)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert ("distributed optimizer, loss mode=per_token, global batch 4 = 1 x 2 micro-batches x DP 2, "
            "10 iterations") in out.stdout, out.stdout
    records = _read_json_log(log)
    # --train-samples 40 at a global batch of 4: 10 iterations; the clock counts samples.
    assert [r["iteration"] for r in records] == list(range(1, 11))
    assert [r["consumed_samples"] for r in records] == [4 * i for i in range(1, 11)]
    assert all(r["success"] and r["loss_scale"] == 1.0 and r["num_zeros"] is not None for r in records)
    _, run = _parse(monkeypatch, [*LLAMA_MODEL, *LLAMA_TRAINING, *LLAMA_DDP])
    assert [r["learning_rate"] for r in records] == _expected_lrs(run, records)
    # warmup over 8 samples (2 iterations), cosine decay to --min-lr at 36 samples (iteration 9)
    assert records[1]["learning_rate"] == 0.00015 and records[8]["learning_rate"] == 0.00001
    assert mo.checkpoint.latest_iteration(ckpt) == 10 and sorted(p.name for p in ckpt.glob("iter_*")) == [
        "iter_0000005", "iter_0000010"]
    lines = log_lines(out.stdout)
    assert [int(m["iteration"]) for m in lines] == list(range(1, 11)), out.stdout
    assert all(m["num_zeros"] is not None and m["tflops"] is not None for m in lines), out.stdout
    assert "data: mock data (megatron-core's MockGPTDataset), split '99,1,0'" in out.stdout, out.stdout
    # megatron-core 0.16's NullTokenizer adds its EOD to --vocab-size; 0.19's (Megatron-LM main's) is the last id of it
    from tests.support.megatron_lm_configs import installed_label
    null_vocab = 1001 if installed_label() == "core_v0.16.1" else 1000
    assert f"NullTokenizer vocabulary {null_vocab} padded to 1024" in out.stdout, out.stdout
    validations = [m["prefix"] for m in map(MEGATRON_VALIDATION_LINE.match, out.stdout.splitlines()) if m]
    # megatron-core builds mock data for every split, the test split included (as in Megatron-LM)
    assert validations == ["iteration 5", "iteration 10", "iteration 10 on validation set",
                           "iteration 10 on test set"], out.stdout
    if HAS_TENSORBOARD:
        _check_tensorboard(tb, records, run)

    # the same command again resumes from --load (at iteration 10 of 10: nothing left to train)
    out = _torchrun(2, flags)
    assert out.returncode == 0 and "resumed from iteration 10 (saved at DP=2, now DP=2)" in out.stdout, out.stdout


def _check_tensorboard(tb_dir, records: list[dict], run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("lm loss", "lm loss vs samples", "learning-rate", "learning-rate vs samples", "grad-norm",
                "grad-norm vs samples", "loss-scale", "loss-scale vs samples", "batch-size", "num-zeros",
                "iteration-time", "throughput"):
        assert tag in tags, (tag, sorted(tags))
    assert "skipped-train-samples" not in tags  # written only once an iteration was skipped (none here)

    def values(tag):
        return {e.step: e.value for e in acc.Scalars(tag)}

    as_f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731  (tensorboard stores float32)
    assert values("lm loss") == {r["iteration"]: as_f32(r["lm loss"]) for r in records}
    assert values("lm loss vs samples") == {r["consumed_samples"]: as_f32(r["lm loss"]) for r in records}
    assert values("learning-rate") == {r["iteration"]: as_f32(r["learning_rate"]) for r in records}
    assert values("grad-norm") == {r["iteration"]: as_f32(r["grad_norm"]) for r in records}
    assert values("num-zeros") == {r["iteration"]: as_f32(r["num_zeros"]) for r in records}
    assert values("batch-size") == {r["iteration"]: float(run.global_batch_size) for r in records}


@pytest.mark.timeout(600)
def test_gpt3_175b_launch_block_runs_at_dp2(tmp_path, monkeypatch):
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    flags = [*GPT3_MODEL, *GPT3_TRAINING, *GPT3_PARALLEL, *GPT3_LOGGING, "--save", str(ckpt), "--load", str(ckpt),
             "--log-json", str(log)]
    out = _torchrun(2, flags)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "non-distributed optimizer, loss mode=mean, global batch 4 = 1 x 2 micro-batches x DP 2" in out.stdout
    records = _read_json_log(log)
    assert [r["iteration"] for r in records] == list(range(1, 7))
    _, run = _parse(monkeypatch, [*GPT3_MODEL, *GPT3_TRAINING])
    assert [r["learning_rate"] for r in records] == _expected_lrs(run, records)
    assert records[-1]["learning_rate"] == 6.0e-6  # past --lr-decay-iters 5: --min-lr
    # fp16 with the dynamic loss scaler: the scale only halves on overflow, grows after 1000 clean steps
    assert all(r["loss_scale"] <= 4096 for r in records) and any(r["success"] for r in records)
    # --log-interval 2: lines at iterations 2, 4, 6 only
    assert [int(m["iteration"]) for m in log_lines(out.stdout)] == [2, 4, 6], out.stdout
    assert mo.checkpoint.latest_iteration(ckpt) == 6 and sorted(p.name for p in ckpt.glob("iter_*")) == [
        "iter_0000003", "iter_0000006"]


# ----------------------------------------------------------------------------- each flag's mapping
def _get(run, path: str):
    obj = run
    for part in path.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj


# (flags, {path in _run's namespace or "args.<dest>": expected value}), at DP=2
MAPPINGS = [
    (["--micro-batch-size", "3", "--global-batch-size", "24"],
     {"micro_batch_size": 3, "global_batch_size": 24, "num_microbatches": 4}),
    (["--micro-batch-size", "3"], {"global_batch_size": 6, "num_microbatches": 1}),  # Megatron: mbs x DP
    (["--micro-batch-size", "2", "--num-microbatches", "3"], {"global_batch_size": 12, "num_microbatches": 3}),
    (["--train-iters", "7", "--global-batch-size", "8"],
     {"train_iters": 7, "scheduler_kwargs.lr_decay_steps": 56, "scheduler_kwargs.wd_incr_steps": 56,
      "scheduler_kwargs.lr_warmup_steps": 8}),  # the demo's 7 // 6 = 1 warm-up iteration
    (["--train-samples", "100", "--global-batch-size", "8"],
     {"train_iters": 12, "scheduler_kwargs.lr_decay_steps": 100, "scheduler_kwargs.wd_incr_steps": 100,
      "scheduler_kwargs.lr_warmup_steps": 0}),
    (["--train-iters", "10", "--lr-decay-iters", "6", "--lr-warmup-iters", "2", "--global-batch-size", "8"],
     {"scheduler_kwargs.lr_decay_steps": 48, "scheduler_kwargs.lr_warmup_steps": 16,
      "scheduler_kwargs.wd_incr_steps": 80}),
    (["--train-samples", "100", "--lr-decay-samples", "90", "--lr-warmup-samples", "12"],
     {"scheduler_kwargs.lr_decay_steps": 90, "scheduler_kwargs.lr_warmup_steps": 12}),
    (["--train-iters", "10", "--lr-warmup-fraction", "0.25", "--global-batch-size", "8"],
     {"scheduler_kwargs.lr_warmup_steps": 20.0, "scheduler_kwargs.lr_decay_steps": 80}),
    (["--train-samples", "100", "--lr-decay-samples", "80", "--lr-warmup-fraction", "0.1"],
     {"scheduler_kwargs.lr_warmup_steps": 8.0}),
    (["--lr", "2e-4"], {"optimizer_config.lr": 2e-4, "scheduler_kwargs.max_lr": 2e-4}),
    (["--min-lr", "1e-5"], {"optimizer_config.min_lr": 1e-5, "scheduler_kwargs.min_lr": 1e-5}),
    (["--lr-warmup-init", "1e-4"], {"scheduler_kwargs.init_lr": 1e-4}),
    (["--lr-decay-style", "cosine"], {"scheduler_kwargs.lr_decay_style": "cosine"}),
    (["--lr-decay-style", "inverse-square-root"], {"scheduler_kwargs.lr_decay_style": "inverse-square-root"}),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "4", "--lr-wsd-decay-style", "linear",
      "--global-batch-size", "8"],
     {"scheduler_kwargs.wsd_decay_steps": 32, "scheduler_kwargs.lr_wsd_decay_style": "linear"}),
    (["--clip-grad", "0.5"], {"optimizer_config.clip_grad": 0.5}),
    (["--weight-decay", "0.2"], {"optimizer_config.weight_decay": 0.2, "scheduler_kwargs.start_wd": 0.2,
                                 "scheduler_kwargs.end_wd": 0.2, "scheduler_kwargs.wd_incr_style": "constant"}),
    (["--start-weight-decay", "0.01", "--end-weight-decay", "0.1", "--weight-decay-incr-style", "linear"],
     {"scheduler_kwargs.start_wd": 0.01, "scheduler_kwargs.end_wd": 0.1, "scheduler_kwargs.wd_incr_style": "linear"}),
    (["--start-weight-decay", "0.0", "--end-weight-decay", "0.1", "--weight-decay-incr-style", "cosine"],
     {"scheduler_kwargs.wd_incr_style": "cosine"}),
    (["--adam-beta1", "0.8"], {"optimizer_config.adam_beta1": 0.8}),
    (["--adam-beta2", "0.95"], {"optimizer_config.adam_beta2": 0.95}),
    (["--adam-eps", "1e-6"], {"optimizer_config.adam_eps": 1e-6}),
    (["--optimizer", "sgd", "--sgd-momentum", "0.8"], {"optimizer_config.optimizer": "sgd",
                                                       "optimizer_config.sgd_momentum": 0.8}),
    (["--optimizer", "lion"], {"optimizer_config.optimizer": "lion", "optimizer_config.lion_beta1": 0.95,
                               "optimizer_config.lion_beta2": 0.98}),
    (["--optimizer", "lion", "--lion-beta1", "0.9", "--lion-beta2", "0.99"],
     {"optimizer_config.lion_beta1": 0.9, "optimizer_config.lion_beta2": 0.99}),
    (["--bf16"], {"optimizer_config.bf16": True, "optimizer_config.fp16": False, "model_dtype": torch.bfloat16,
                  "optimizer_config.params_dtype": torch.bfloat16, "ddp_config.grad_reduce_in_fp32": True}),
    (["--bf16", "--grad-reduce-in-bf16"], {"ddp_config.grad_reduce_in_fp32": False}),
    (["--fp16"], {"optimizer_config.fp16": True, "model_dtype": torch.float16, "ddp_config.grad_reduce_in_fp32": False,
                  "optimizer_config.loss_scale": None}),
    (["--fp16", "--accumulate-allreduce-grads-in-fp32"], {"ddp_config.grad_reduce_in_fp32": True}),
    (["--fp16", "--loss-scale", "1024"], {"optimizer_config.loss_scale": 1024.0}),
    (["--bf16", "--loss-scale", "8"], {"optimizer_config.loss_scale": 8.0}),
    (["--loss-scale", "1024"], {"optimizer_config.loss_scale": None}),  # fp32: no scaler, as in Megatron-LM
    (["--fp16", "--initial-loss-scale", "4096", "--min-loss-scale", "2", "--loss-scale-window", "50",
      "--hysteresis", "3"],
     {"optimizer_config.initial_loss_scale": 4096.0, "optimizer_config.min_loss_scale": 2.0,
      "optimizer_config.loss_scale_window": 50.0, "optimizer_config.hysteresis": 3}),
    (["--use-distributed-optimizer"], {"optimizer_config.use_distributed_optimizer": True,
                                       "ddp_config.use_distributed_optimizer": True}),
    (["--overlap-grad-reduce"], {"ddp_config.overlap_grad_reduce": True}),
    (["--use-distributed-optimizer", "--overlap-param-gather"],
     {"ddp_config.overlap_param_gather": True, "optimizer_config.overlap_param_gather": True}),
    (["--ddp-bucket-size", "1000"], {"ddp_config.bucket_size": 1000}),
    (["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"],
     {"ddp_config.num_distributed_optimizer_instances": 2}),
    (["--calculate-per-token-loss"], {"loss_mode": "per_token"}),
    (["--log-num-zeros-in-grad"], {"optimizer_config.log_num_zeros_in_grad": True}),
    (["--verify-interval", "5", "--verify-action", "warn"],
     {"optimizer_config.verify_interval": 5, "optimizer_config.verify_action": "warn"}),
    (["--decoupled-lr", "5e-3", "--decoupled-min-lr", "5e-4"],
     {"optimizer_config.decoupled_lr": 5e-3, "optimizer_config.decoupled_min_lr": 5e-4}),
    (["--bf16", "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "fp16",
      "--main-params-dtype", "fp16", "--stochastic-rounding"],
     {"optimizer_config.use_precision_aware_optimizer": True, "optimizer_config.exp_avg_dtype": torch.bfloat16,
      "optimizer_config.exp_avg_sq_dtype": torch.float16, "optimizer_config.main_params_dtype": torch.float16,
      "optimizer_config.stochastic_rounding": True}),
    (["--bf16", "--use-precision-aware-optimizer", "--no-store-param-remainders"],
     {"optimizer_config.store_param_remainders": False}),
    (["--num-layers", "3", "--hidden-size", "48", "--num-attention-heads", "6", "--seq-length", "16",
      "--max-position-embeddings", "24", "--ffn-hidden-size", "100", "--init-method-std", "0.01",
      "--untie-embeddings-and-output-weights"],
     {"model.layers": 3, "model.hidden": 48, "model.heads": 6, "seq_length": 16, "model.max_positions": 24,
      "model.ffn_hidden": 100, "args.init_method_std": 0.01, "model.tie_embeddings": False}),
    (["--seq-length", "16"], {"model.max_positions": 16}),  # --max-position-embeddings defaults to it
    (["--override-opt-param-scheduler"], {"scheduler_kwargs.override_opt_param_scheduler": True,
                                          "scheduler_kwargs.use_checkpoint_opt_param_scheduler": False}),
    (["--log-interval", "5", "--seed", "7", "--distributed-timeout-minutes", "3", "--save", "a", "--load", "b",
      "--save-interval", "4", "--tensorboard-log-interval", "2"],
     {"args.log_interval": 5, "args.seed": 7, "args.distributed_timeout_minutes": 3, "args.save": "a",
      "args.load": "b", "args.save_interval": 4, "args.tensorboard_log_interval": 2}),
    # the script's old flags are aliases of Megatron-LM's
    (["--steps", "9", "--seq-len", "16", "--hidden", "48", "--layers", "3", "--heads", "6", "--warmup-steps", "2",
      "--bucket-size", "500", "--loss-mode", "per_token", "--micro-batch-size", "2"],
     {"train_iters": 9, "seq_length": 16, "model.hidden": 48, "model.layers": 3, "model.heads": 6,
      "scheduler_kwargs.lr_warmup_steps": 8, "ddp_config.bucket_size": 500, "loss_mode": "per_token"}),
]


@pytest.mark.parametrize("flags, expected", MAPPINGS, ids=[" ".join(f) for f, _ in MAPPINGS])
def test_flag_maps_to_config(monkeypatch, flags, expected):
    args, run = _parse(monkeypatch, flags)
    for path, value in expected.items():
        got = getattr(args, path[5:]) if path.startswith("args.") else _get(run, path)
        assert got == value and type(got) is type(value), (path, got, value)


def test_defaults_are_megatrons_except_the_demo_ones(monkeypatch):
    """No flags (the README command): Megatron-LM's defaults, except where it has none or a no-flag demo
    needs another (DEMO_DEFAULTS)."""
    args, run = _parse(monkeypatch, [])
    oc, dc, sk = run.optimizer_config, run.ddp_config, run.scheduler_kwargs
    megatron = [
        (oc.optimizer, "adam"), (oc.min_lr, 0.0), (oc.weight_decay, 0.01), (oc.clip_grad, 1.0), (oc.adam_beta1, 0.9),
        (oc.adam_beta2, 0.999), (oc.adam_eps, 1e-8), (oc.loss_scale, None), (oc.initial_loss_scale, 2.0**32),
        (oc.min_loss_scale, 1.0), (oc.loss_scale_window, 1000), (oc.hysteresis, 2), (oc.bf16, False),
        (oc.fp16, False), (oc.use_distributed_optimizer, False), (dc.use_distributed_optimizer, False),
        (dc.overlap_grad_reduce, False), (dc.overlap_param_gather, False), (dc.bucket_size, None),
        (dc.grad_reduce_in_fp32, False), (sk["lr_decay_style"], "linear"), (sk["init_lr"], 0.0),
        (oc.verify_interval, 0), (oc.verify_action, "raise"),
        (sk["wd_incr_style"], "constant"), (sk["start_wd"], 0.01), (run.loss_mode, "mean"),
        (run.num_microbatches, 1), (args.seed, 1234), (args.distributed_timeout_minutes, 10),
        (args.tensorboard_log_interval, 1), (args.init_method_std, 0.02), (run.model["tie_embeddings"], True),
        (args.ffn_hidden_size, None), (run.model["ffn_hidden"], 4 * 128), (run.model_dtype, torch.float32),
    ]
    for i, (got, want) in enumerate(megatron):
        assert got == want and type(got) is type(want), (i, got, want)
    demo = DEMO_DEFAULTS
    assert (oc.lr, run.train_iters, run.micro_batch_size, run.seq_length, args.log_interval) == (
        demo["lr"], demo["train_iters"], demo["micro_batch_size"], demo["seq_length"], demo["log_interval"])
    assert args.lr_warmup_iters == 5 and sk["lr_warmup_steps"] == 5 * run.global_batch_size
    assert run.global_batch_size == demo["micro_batch_size"] * 2


@pytest.mark.parametrize("iters, warmup", [(5, 0), (12, 2), (30, 5), (600, 100)])
def test_demo_warmup_scales_with_train_iters(monkeypatch, iters, warmup):
    """The demo's --lr-warmup-iters is a sixth of --train-iters, so `--train-iters 5` alone runs; a
    typed --lr-warmup-iters wins."""
    args, _ = _parse(monkeypatch, ["--train-iters", str(iters)])
    assert args.lr_warmup_iters == warmup
    args, _ = _parse(monkeypatch, ["--train-iters", str(iters), "--lr-warmup-iters", "1"])
    assert args.lr_warmup_iters == 1


# ----------------------------------------------------------------------------- micro-batches
@pytest.mark.parametrize("gbs, mbs, dp, expected", [(16, 2, 2, 4), (6, 3, 2, 1), (24, 1, 3, 8), (7, 7, 1, 1)])
def test_num_microbatches(gbs, mbs, dp, expected):
    assert megatron_args.num_microbatches(gbs, mbs, dp) == expected


@pytest.mark.parametrize("gbs, mbs, dp", [(10, 2, 4), (8, 3, 2), (4, 4, 2)])
def test_num_microbatches_error(gbs, mbs, dp):
    with pytest.raises(ValueError) as exc:
        megatron_args.num_microbatches(gbs, mbs, dp)
    assert (f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x data-parallel size {dp} "
            f"= {mbs * dp}") in str(exc.value)


def test_global_batch_not_divisible_is_a_parser_error(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse(monkeypatch, ["--micro-batch-size", "2", "--global-batch-size", "8"], world=3)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--global-batch-size 8 is not divisible by --micro-batch-size 2 x data-parallel size 3 = 6" in err, err
    _, run = _parse(monkeypatch, ["--micro-batch-size", "2", "--global-batch-size", "12"], world=3)
    assert run.num_microbatches == 2


def test_global_batch_error_under_torchrun():
    """The real command line: each rank exits 2 with the message, before any process group."""
    out = subprocess.run([*TORCHRUN, "--nproc_per_node=2", SCRIPT, "--micro-batch-size", "3", "--global-batch-size",
                          "8"], capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=ENV, cwd=ROOT)
    assert out.returncode != 0
    assert ("pretrain_gpt.py: error: --global-batch-size 8 is not divisible by --micro-batch-size 3 x data-parallel "
            "size 2 = 6") in out.stderr, out.stderr[-3000:]
    assert "exitcode:2" in out.stderr.replace(" ", ""), out.stderr[-3000:]
    assert "megatron_opt pretrain_gpt:" not in out.stdout  # the run never started


# ----------------------------------------------------------------------------- threads
TINY = ["--hidden-size", "32", "--num-layers", "1", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "2", "--train-iters", "2"]


@pytest.mark.parametrize("omp, expected", [(None, "1 intra-op thread per rank (default)"),
                                           ("2", "2 intra-op threads per rank (OMP_NUM_THREADS)")])
def test_intra_op_threads_per_rank(omp, expected):
    """One intra-op thread per rank unless OMP_NUM_THREADS is set (the user's setting wins); the
    header line says how many threads each rank runs (torch.get_num_threads()) and why."""
    env = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    out = subprocess.run([*TORCHRUN, "--nproc_per_node=1", SCRIPT, *TINY], capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    header = next(line for line in out.stdout.splitlines() if line.startswith("megatron_opt pretrain_gpt:"))
    assert header.endswith(expected), header


# ----------------------------------------------------------------------------- contradictions (Megatron-LM's asserts)
CONTRADICTIONS = [
    (["--train-iters", "10", "--train-samples", "100"], ["--train-iters and --train-samples are exclusive"]),
    (["--steps", "10", "--train-samples", "100"], ["--steps and --train-samples are exclusive"]),
    (["--train-iters", "10", "--lr-decay-samples", "50"], ["--lr-decay-samples does not go with --train-iters",
                                                           "use --lr-decay-iters"]),
    (["--lr-warmup-samples", "50"], ["--lr-warmup-samples does not go with --train-iters"]),
    (["--train-samples", "100", "--lr-decay-iters", "5"], ["--lr-decay-iters does not go with --train-samples",
                                                          "use --lr-decay-samples"]),
    (["--train-samples", "100", "--lr-warmup-iters", "5"], ["--lr-warmup-iters does not go with --train-samples"]),
    (["--train-samples", "100", "--warmup-steps", "5"], ["--warmup-steps does not go with --train-samples"]),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"],
     ["--lr-warmup-fraction and --lr-warmup-iters are exclusive"]),
    (["--train-samples", "100", "--lr-warmup-fraction", "0.1", "--lr-warmup-samples", "2"],
     ["--lr-warmup-fraction and --lr-warmup-samples are exclusive"]),
    (["--lr-warmup-fraction", "1.5"], ["--lr-warmup-fraction must be in [0, 1)"]),
    (["--train-iters", "10", "--lr-warmup-iters", "10"], ["--lr-warmup-iters 10 must be >= 0 and less than",
                                                           "--train-iters 10"]),
    (["--train-iters", "30", "--lr-decay-iters", "4"], ["--lr-warmup-iters 5 must be >= 0 and less than the LR "
                                                        "decay length --lr-decay-iters 4"]),
    (["--train-samples", "2", "--global-batch-size", "4", "--micro-batch-size", "2"],
     ["--train-samples 2 is less than one global batch"]),
    (["--start-weight-decay", "0.1"], ["--start-weight-decay needs --weight-decay-incr-style linear or cosine"]),
    (["--weight-decay-incr-style", "linear", "--start-weight-decay", "0.1"],
     ["--weight-decay-incr-style linear needs --start-weight-decay and --end-weight-decay"]),
    (["--weight-decay-incr-style", "linear", "--start-weight-decay", "0.2", "--end-weight-decay", "0.1"],
     ["need 0 <= --start-weight-decay <= --end-weight-decay"]),
    (["--lr-decay-style", "WSD"], ["--lr-decay-style WSD needs --lr-wsd-decay-iters"]),
    (["--overlap-param-gather"], ["--overlap-param-gather needs --use-distributed-optimizer"]),
    (["--grad-reduce-in-bf16"], ["--grad-reduce-in-bf16 needs --bf16"]),
    (["--loss-mode", "mean", "--calculate-per-token-loss"],
     ["--loss-mode mean contradicts --calculate-per-token-loss"]),
    (["--global-batch-size", "16", "--num-microbatches", "3", "--micro-batch-size", "2"],
     ["--global-batch-size 16 contradicts --num-microbatches 3"]),
    (["--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"], ["are exclusive"]),
    (["--fp16", "--loss-scale", "0"], ["--loss-scale must be a finite number > 0"]),
    (["--fp16", "--min-loss-scale", "8", "--initial-loss-scale", "4"],
     ["--initial-loss-scale must be a finite number >= --min-loss-scale 8, got 4"]),
    (["--num-attention-heads", "3"], ["--hidden-size 128 is not divisible by --num-attention-heads 3"]),
    (["--seq-length", "64", "--max-position-embeddings", "32"], ["--max-position-embeddings 32 must be >= "
                                                                  "--seq-length 64"]),
    (["--adam-beta2", "1.0"], ["--adam-beta2=1.0 is out of range"]),  # megatron_opt's own check, as a flag
    (["--hysteresis", "0"], ["--hysteresis=0 is out of range"]),
    (["--verify-interval", "-1"], ["--verify-interval=-1 is out of range"]),
    (["--train-iters", "0"], ["--train-iters must be a positive integer, got 0"]),
    (["--global-batch-size", "0"], ["--global-batch-size must be a positive integer, got 0"]),
    (["--log-interval", "0"], ["--log-interval must be a positive integer, got 0"]),
]


@pytest.mark.parametrize("flags, expected", CONTRADICTIONS, ids=[" ".join(f) for f, _ in CONTRADICTIONS])
def test_contradicting_flags_are_parser_errors(monkeypatch, capsys, flags, expected):
    with pytest.raises(SystemExit) as exc:
        _parse(monkeypatch, flags)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "pretrain_gpt.py: error:" in err
    for text in expected:
        assert text in err, err


# ----------------------------------------------------------------------------- unsupported flags
def test_unsupported_flags_are_listed_in_one_message(monkeypatch, capsys):
    # the example's flags in its order: the unsupported ones between the supported blocks
    third = len(LLAMA_UNSUPPORTED) // 3
    words = lambda flags: [word for flag in flags for word in flag]  # noqa: E731
    flags = [*LLAMA_MODEL, *words(LLAMA_UNSUPPORTED[:third]), *LLAMA_TRAINING,
             *words(LLAMA_UNSUPPORTED[third:2 * third]), *LLAMA_PARALLEL, *LLAMA_DDP,
             *words(LLAMA_UNSUPPORTED[2 * third:]), *LLAMA_LOGGING]
    flags += ["--tp-comm-overlap", "--decoder-first-pipeline-num-layers", "4", "--train-data-path", "x",
              "--reset-position-ids", "--full-validation", "--transformer-impl", "local",
              "--virtual-pipeline-model-parallel-size", "2", "--rampup-batch-size=2", "--hidden-dropout", "0.1"]
    with pytest.raises(SystemExit) as exc:
        _parse(monkeypatch, flags)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("pretrain_gpt.py: error:") == 1, err
    n = len(LLAMA_UNSUPPORTED) + 9
    assert f"{n} flags refused by pretrain_gpt.py (nothing was run)" in err, err
    assert "usage:" not in err  # no usage dump
    for flag in LLAMA_UNSUPPORTED:
        assert f"\n  {' '.join(flag)}: " in err, (flag, err)
    for text in ["  --fp8-format hybrid: not supported yet: fp8/fp4 training is not implemented",
                 "  --tp-comm-overlap: not supported yet: this model-parallel option is not implemented",
                 "  --decoder-first-pipeline-num-layers 4: not supported yet: this model-parallel option",
                 "  --virtual-pipeline-model-parallel-size 2: not supported yet: this model-parallel option",
                 "  --rampup-batch-size 2: not supported yet: the global batch size is constant",
                 "  --train-data-path x: not supported yet: this data or tokenizer option is not implemented "
                 "(supported: --data-path --split --mock-data",
                 "  --reset-position-ids: not supported yet: this data or tokenizer option",
                 "  --tiktoken-pattern v2: not supported yet: this data or tokenizer option",
                 "  --transformer-impl local: not supported yet: the model is this script's own GPT",
                 "  --swiglu: not supported yet: the model is this script's own GPT",
                 "  --num-query-groups 8: not supported yet: the model",
                 "  --hidden-dropout 0.1: not supported yet: the model",
                 "  --attention-backend fused: not supported yet: the model",
                 "  --full-validation: not supported yet: this evaluation option is not implemented (supported: "
                 "--eval-interval --eval-iters --skip-train)",
                 "  --profile: not supported yet: profiling is not implemented"]:
        assert text in err, (text, err)
    # the accepted no-op values are not listed as errors
    for text in ["--tensor-model-parallel-size 1:", "--sequence-parallel:", "--ckpt-format torch_dist:",
                 "--attention-dropout 0.0:"]:
        assert text not in err, (text, err)


@pytest.mark.parametrize("flags", [
    ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1",
     "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1", "--sequence-parallel"],
    ["--attention-dropout", "0", "--hidden-dropout", "0.0", "--attention-backend", "auto", "--ckpt-format",
     "torch_dist", "--eval-iters", "0", "--no-check-for-nan-in-loss-and-grad"],
    ["--ckpt-format", "torch_dcp"],
    ["--tensor-model-parallel-size=1", "--attention-dropout=0.0"],
])
def test_noop_values_are_accepted(monkeypatch, flags):
    args, run = _parse(monkeypatch, flags)
    assert run.train_iters == DEMO_DEFAULTS["train_iters"]


@pytest.mark.parametrize("flags, listed", [
    (["--tp-comm-overlap"], "--tp-comm-overlap: not supported yet: this model-parallel option"),
    (["--attention-dropout", "0.1"], "--attention-dropout 0.1: not supported yet: the model"),
    (["--ckpt-format", "torch"], "--ckpt-format torch: not supported yet: accepted only as --ckpt-format "
                                 "torch_dist|torch_dcp, a no-op here"),
    (["--data-args-path", "x"], "--data-args-path x: not supported yet: this data or tokenizer option"),
    (["--log-energy"], "--log-energy: not supported yet: this logging option is not implemented"),
    (["--manual-gc"], "--manual-gc: not supported yet: not implemented by megatron_opt or by this script"),
    (["--no-such-flag"], "unknown flag --no-such-flag\n"),
    (["--micro-batch-szie", "4"], "unknown flag --micro-batch-szie; did you mean --micro-batch-size?\n"),
    (["--log-intervall", "2"], "unknown flag --log-intervall; did you mean --log-interval?\n"),  # not "--log-*"
    (["--lr-warmup"], "unknown flag --lr-warmup; did you mean --lr-warmup-"),  # no abbreviations
])
def test_single_unsupported_flag(monkeypatch, capsys, flags, listed):
    """One refused flag: its one line. A Megatron-LM flag we do not implement says "not supported yet"
    with the reason; anything else is an unknown flag, with the closest flag we have (difflib)."""
    with pytest.raises(SystemExit) as exc:
        _parse(monkeypatch, flags)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pretrain_gpt.py: error: {listed}"), err
    assert "usage:" not in err and err.count("error:") == 1, err
    assert ("unknown flag" in listed) != ("accepted as no-ops here" in err), err


def test_unsupported_flags_exit_before_any_process_group():
    """Under torchrun: every rank exits 2 with the one message, and no process group was created."""
    out = subprocess.run([*TORCHRUN, "--nproc_per_node=2", SCRIPT, "--fp8-format", "hybrid", "--swiglu",
                          "--profile"], capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S, env=ENV, cwd=ROOT)
    assert out.returncode != 0
    assert "error: 3 flags refused by pretrain_gpt.py (nothing was run)" in out.stderr, out.stderr[-3000:]
    assert "exitcode:2" in out.stderr.replace(" ", ""), out.stderr[-3000:]
    assert "megatron_opt pretrain_gpt:" not in out.stdout  # the run never started


def test_unknown_flag_exit_codes_and_one_message():
    """The rank exits 2 and only rank 0 prints, without argparse's usage text. Plain python: the shell
    sees 2. torchrun: the shell sees torchrun's own 1 (it reports any failed rank as 1), and its failure
    report names the rank's exit code 2 (docs/usage.md says so)."""
    expected = "pretrain_gpt.py: error: unknown flag --micro-batch-szie; did you mean --micro-batch-size?\n"
    out = subprocess.run([sys.executable, SCRIPT, "--micro-batch-szie", "4"], capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S, env=ENV, cwd=ROOT)
    assert (out.returncode, out.stderr) == (2, expected), out.stderr
    out = _torchrun(2, ["--micro-batch-szie", "4"])
    assert out.returncode == 1, (out.returncode, out.stderr[-3000:])
    assert out.stderr.count("pretrain_gpt.py: error:") == 1 and expected in out.stderr, out.stderr[-3000:]
    assert "usage:" not in out.stderr and "exitcode:2" in out.stderr.replace(" ", ""), out.stderr[-3000:]


def test_short_run_with_demo_defaults():
    """`--train-iters 5` and nothing else runs (the demo's warmup scales down to 0 iterations)."""
    out = _torchrun(1, ["--train-iters", "5"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert [int(m["iteration"]) for m in log_lines(out.stdout)] == [1, 2, 3, 4, 5], out.stdout


# ----------------------------------------------------------------------------- tensorboard
def test_tensorboard_missing_is_a_clear_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` now raises ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(SystemExit) as exc:
        _parse(monkeypatch, ["--tensorboard-dir", str(tmp_path / "tb")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--tensorboard-dir needs the tensorboard package" in err and "pip install tensorboard" in err, err
    _parse(monkeypatch, [])  # the run without --tensorboard-dir never needs it


def test_tensorboard_missing_on_the_command_line(tmp_path):
    # Hide tensorboard from the script whether or not it is installed here; run it as python does.
    hide = ("import runpy, sys; sys.modules['tensorboard'] = None; sys.modules['torch.utils.tensorboard'] = None; "
            f"sys.argv = [{SCRIPT!r}, '--tensorboard-dir', {str(tmp_path / 'tb')!r}]; "
            f"runpy.run_path({SCRIPT!r}, run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                         env=ENV, cwd=ROOT)
    assert out.returncode == 2 and "pip install tensorboard" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed (pip install tensorboard)")
def test_tensorboard_flags_parse(monkeypatch, tmp_path):
    args, _ = _parse(monkeypatch, ["--tensorboard-dir", str(tmp_path / "tb"), "--tensorboard-log-interval", "3"])
    assert args.tensorboard_dir == str(tmp_path / "tb") and args.tensorboard_log_interval == 3
