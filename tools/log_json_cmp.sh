#!/usr/bin/env bash
# Is the main job bitwise unchanged since a revision? Runs it four ways from a checkout of REV and from this
# tree (no flags; docs/pretrain.md's Megatron-LM flags example; TP2 with sequence parallelism; PP2 bf16 with the
# distributed optimizer and evaluation) and compares their --log-json files with cmp.
#   usage: bash tools/log_json_cmp.sh REV [TORCHRUN]      (TORCHRUN defaults to .venv/bin/torchrun)
# Needs megatron-core in that environment for the TP2/PP2 runs. Exit status 0: all four identical.
set -euo pipefail
cd "$(dirname "$0")/.."
REV="$1"; TORCHRUN="$(realpath "${2:-.venv/bin/torchrun}")"; HERE="$PWD"
WORK="$(mktemp -d)"; trap 'git -C "$HERE" worktree remove --force "$WORK/base" >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
git worktree add -q --detach "$WORK/base" "$REV"

runs() {  # $1 = source tree, $2 = output folder
    local tree="$1" out="$2" script="$1/scripts/pretrain_gpt.py"; mkdir -p "$out"; cd "$out"
    export PYTHONPATH="$tree" OMP_NUM_THREADS=1
    "$TORCHRUN" --standalone --nproc_per_node=2 "$script" --log-json noflag.jsonl > noflag.out 2>&1
    "$TORCHRUN" --standalone --nproc_per_node=2 "$script" \
        --num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \
        --micro-batch-size 2 --global-batch-size 16 --train-iters 50 --lr 6.0e-4 --min-lr 6.0e-5 \
        --lr-decay-style cosine --lr-warmup-fraction .05 --lr-decay-iters 45 --weight-decay 0.1 \
        --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16 --use-distributed-optimizer \
        --overlap-grad-reduce --overlap-param-gather --calculate-per-token-loss --log-interval 5 \
        --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --save ckpt --save-interval 25 \
        --log-json mlm.jsonl > mlm.out 2>&1
    "$TORCHRUN" --standalone --nproc_per_node=2 "$script" --tensor-model-parallel-size 2 --sequence-parallel \
        --train-iters 4 --log-json tp2.jsonl > tp2.out 2>&1
    "$TORCHRUN" --standalone --nproc_per_node=2 "$script" --pipeline-model-parallel-size 2 \
        --use-distributed-optimizer --bf16 --train-iters 4 --eval-interval 2 --eval-iters 1 \
        --log-json pp2.jsonl > pp2.out 2>&1
    cd "$HERE"
}
runs "$WORK/base" "$WORK/before" || { echo "a run from $REV failed: $WORK/before/*.out"; exit 1; }
runs "$HERE" "$WORK/after" || { echo "a run from this tree failed: $WORK/after/*.out"; exit 1; }
status=0
for f in noflag mlm tp2 pp2; do
    if cmp "$WORK/before/$f.jsonl" "$WORK/after/$f.jsonl"; then echo "$f.jsonl identical"; else status=1; fi
done
exit $status
