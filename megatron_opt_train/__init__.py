"""megatron_opt_train, the main job: pretrain a small GPT with megatron_opt under torchrun: CPU/gloo without
a GPU, CUDA/NCCL with one.

    torchrun --standalone --nproc_per_node=2 scripts/pretrain_gpt.py
    torchrun --standalone --nproc_per_node=2 scripts/pretrain_gpt.py --train-iters 30 --save ckpt --save-interval 10
    torchrun --standalone --nproc_per_node=3 scripts/pretrain_gpt.py --train-iters 40 --load ckpt --save ckpt  # DP 2->3
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT scripts/pretrain_gpt.py ...
    torchrun --standalone --nproc_per_node=2 -m megatron_opt_train ...      # the same, as a module

Flags: Megatron-LM's, with Megatron-LM's meaning (megatron_opt.megatron.arguments, docs/usage.md), so
the optimizer, schedule, precision, batch, logging and checkpoint block of a Megatron-LM launch script
runs with only the entry point changed. Model parallelism (--tensor-model-parallel-size, --sequence-parallel,
--pipeline-model-parallel-size, --num-layers-per-virtual-pipeline-stage, --expert-model-parallel-size with
--num-experts) trains megatron-core's GPTModel through its schedule (megatron_opt_train/runners/megatron_core.py).
Megatron-LM's data, tokenizer and evaluation blocks run through megatron-core's data code
(megatron_opt_train/components/data.py, evaluation.py; docs/pretrain.md). Flags for what megatron_opt or this
script does not have (fp8, other model architectures, ...: "not supported yet: <reason>") and unknown flags
("unknown flag --x; did you mean --y?") are all named in one error (exit code 2; torchrun itself then exits
1), printed by rank 0 without the usage text, before any process group exists; no-op values
(--attention-dropout 0, ...) are accepted.

Defaults are Megatron-LM's, except where it has none or a run with no flags should stay a short demo
(DEMO_DEFAULTS): --lr 3e-3, --train-iters 30, --micro-batch-size 4, --seq-length 64, --hidden-size 128,
--num-layers 2, --num-attention-heads 4, --lr-warmup-iters a sixth of --train-iters (5 at 30, 0 at 5;
Megatron-LM: 0), --log-interval 1 (Megatron-LM: 100), --eval-iters 10 (Megatron-LM: 100).
This script's older flags are aliases (LEGACY_ALIASES): --steps, --seq-len, --hidden, --layers, --heads,
--warmup-steps, --bucket-size; with megatron_opt's --num-microbatches N and --loss-mode per_token|mean.

The model is Megatron-LM's default GPT without dropout: learned absolute positions, pre-LayerNorm
blocks with multi-head causal attention and a GELU MLP, biases, and an output layer tied to the input
embedding (megatron_opt_train/components/model.py). Without a data flag the data is character-level text from the
docstrings of Python's standard library (nothing is downloaded), cut into documents of random length
and padded with ignored labels, so micro-batches carry different numbers of supervised tokens and the
per-token loss normalisation matters. Every --log-interval iterations rank 0 prints Megatron-LM's log
line (megatron_opt_train/components/metrics.py), and validation lines at --eval-interval and after training;
--log-json FILE appends the exact values of every iteration.

Checkpoints (megatron_opt.checkpoint): --save DIR every --save-interval iterations and at the end;
--load DIR resumes model, optimizer, schedule, loss scale, iteration, RNG and data position (at any
data-parallel size, and with model parallelism at any TP/PP layout; RNG, and the built-in corpus'
position, only at the same size); --exit-interval N saves and exits. --load and --save never lose a
run (megatron_opt_train/components/resume.py): a missing --load is said, a --save over newer iterations is refused,
a changed schedule or batch is warned about.

Divergence: as Megatron-LM (--check-for-nan-in-loss-and-grad, on by default), a non-finite loss, or
non-finite gradients outside the fp16 dynamic scaler's backoff, stops every rank (exit code 4, a
message on stderr, no checkpoint of that state); --no-check-for-nan-in-loss-and-grad trains on, and
the final "done" line then counts the non-finite iterations. Threads: one intra-op thread per rank
unless OMP_NUM_THREADS is set (the header line says which).

Hangs: every collective gives up after --distributed-timeout-minutes (default 10), and a watchdog ends
a rank whose iteration (all of it but evaluation and saves) runs longer than max(--watchdog-min-seconds,
--watchdog-multiple x the median iteration time) (exit code 3, with a message on stderr;
--watchdog-multiple 0 turns it off).
"""
# The layout (docs/pretrain.md): train.py, the Trainer and main(); flags.py, the command line; runners/,
# the two ways to build and step the model behind one interface; components/, the rest.
