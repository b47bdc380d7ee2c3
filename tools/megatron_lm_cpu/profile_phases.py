"""Where one Megatron-LM iteration's time goes, from a py-spy profile of its ranks.

    py-spy record --subprocesses --format raw -r 100 -o PROFILE -- python -m torch.distributed.run ... run.py ...
    python tools/megatron_lm_cpu/profile_phases.py PROFILE [PROFILE ...]

Reads py-spy's raw (collapsed) stacks, keeps the samples inside Megatron-LM's ``train_step``, and puts
each in the first phase (top of the stack down) whose marker one of its frames holds: the forward and
backward compute, the gradient reduction, and the optimizer's parts (statistics / grad norm and clip,
update, param all-gather). Prints each phase's share of the train_step samples, per profile side by side.
"""
from __future__ import annotations

import collections
import sys

# (phase, markers): a sample belongs to the first phase one of whose markers is in one of its frames,
# the phases tried in this order (so a hook inside the backward counts as the backward).
PHASES = (
    ("grad reduction (in backward hooks)", ("launch_ready", "register_grad_ready", "start_grad_sync (megatron/core")),
    ("backward compute", ("backward_step",)),
    ("forward compute", ("forward_step",)),
    ("grad reduction (finish)", ("finalize_model_grads", "finish_grad_sync")),
    ("optimizer: statistics, grad norm, clip", ("prepare_grads", "_decide", "get_grad_norm", "clip_grad",
                                               "count_zeros", "_unscale_main_grads_and_check_for_nan")),
    ("optimizer: param all-gather", ("start_param_sync", "_start_param_sync", "finish_param_sync")),
    ("optimizer: update", ("apply_update", "_apply_updates", "finish_update", "inner_step", "_fused_adamw",
                           "adam", "Adam", "step_with_ready_grads", "_copy_main_params_to_model_params",
                           "_copy_model_grads_to_main_grads")),
    ("optimizer: other", ("optimizer.py", "distrib_optimizer.py", "megatron_optimizer.py")),
)


def phases(path: str) -> tuple[int, collections.Counter]:
    total, counts = 0, collections.Counter()
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            if not any(fr.startswith("train_step ") for fr in frames):
                continue
            total += int(n)
            for phase, markers in PHASES:
                if any(m in fr for fr in frames for m in markers):
                    counts[phase] += int(n)
                    break
            else:
                counts["other"] += int(n)
    return total, counts


def main(paths: list[str]) -> None:
    results = [phases(p) for p in paths]
    names = [p for p, _ in PHASES] + ["other"]
    print("| phase | " + " | ".join(paths) + " |")
    print("|---|" + "---|" * len(paths))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{c[name] / t:.1%}" if t else "-" for t, c in results) + " |")
    print("| samples in train_step | " + " | ".join(str(t) for t, _ in results) + " |")


if __name__ == "__main__":
    main(sys.argv[1:] or sys.exit(__doc__))
