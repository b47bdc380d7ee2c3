"""Run Megatron-LM's own, unmodified pretrain_gpt.py on CPU (gloo), optionally with megatron_opt.

    OMP_NUM_THREADS=1 CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --standalone --nproc_per_node=2 \
        tools/megatron_lm_cpu/run.py MEGATRON_LM_DIR [--megatron-opt] [--precise-log] [--gpu] \
        -- --distributed-backend gloo --transformer-impl local ... (pretrain_gpt.py's arguments)

MEGATRON_LM_DIR is a Megatron-LM source tree holding at least ``megatron/``, ``pretrain_gpt.py``,
``gpt_builders.py`` and ``model_provider.py`` (from a clone: ``git archive REV megatron pretrain_gpt.py
gpt_builders.py model_provider.py | tar -x -C DIR``). In order: MEGATRON_LM_DIR goes first on sys.path
(its megatron/ wins over an installed megatron-core); the installed wheel's build of the dataset helpers
is used if the tree has none (and a build the tree has is used without Megatron-LM's make step);
cpu_shim.install() (torch.cuda, megatron-core), unless --gpu (a real GPU: no shim at all); with
--megatron-opt the one line ``import megatron_opt.megatron; megatron_opt.megatron.install()``, before
megatron.training is imported, where the README puts it; cpu_shim.install_training() (not with --gpu);
with --precise-log a full-precision copy of each log line's numbers (``PRECISE {json}``; with --gpu also
the peak allocated GPU memory); then pretrain_gpt.py runs as __main__ with the
arguments after ``--``. compare.py runs the matrix.
"""
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def use_installed_dataset_helpers(mlm_dir: str) -> None:
    """Megatron-LM compiles megatron/core/datasets/helpers.cpp at start-up with make and pybind11
    (not installed here). When the tree has no build of it but the installed megatron-core wheel has one
    of the identical helpers.cpp, load the wheel's build as megatron.core.datasets.helpers_cpp and make
    compile_helpers a no-op; otherwise leave Megatron-LM's own compile step alone."""
    import importlib.machinery
    import importlib.metadata
    import importlib.util
    import sysconfig
    ours = os.path.join(mlm_dir, "megatron", "core", "datasets")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    if os.path.exists(os.path.join(ours, "helpers_cpp" + suffix)):
        # built already (tools/gpu_carry.sh copies a build in): make would need python3-config and pybind11
        import megatron.core.datasets.utils as dataset_utils
        dataset_utils.compile_helpers = lambda: None
        return
    try:
        wheel = str(importlib.metadata.distribution("megatron-core").locate_file("megatron/core/datasets"))
    except importlib.metadata.PackageNotFoundError:
        return
    built = os.path.join(wheel, "helpers_cpp" + suffix)
    with open(os.path.join(ours, "helpers.cpp"), "rb") as a, open(os.path.join(wheel, "helpers.cpp"), "rb") as b:
        if not os.path.exists(built) or a.read() != b.read():
            return
    name = "megatron.core.datasets.helpers_cpp"
    spec = importlib.util.spec_from_file_location(name, built,
                                                  loader=importlib.machinery.ExtensionFileLoader(name, built))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    import megatron.core.datasets.utils as dataset_utils
    dataset_utils.compile_helpers = lambda: None


def log_precisely(gpu_memory: bool) -> None:
    """Megatron-LM's log line rounds the grad norm to 3 decimals and the loss to 7 digits. Wrap its
    training_log to also print, on the rank that prints the log line (the last), one line
    ``PRECISE {json}`` with the iteration's losses, grad norm, zero count and loss scale in full
    precision (with gpu_memory, also ``torch.cuda.max_memory_allocated()`` in MiB). Reads the values only."""
    import json
    import torch
    import megatron.training.training as training
    original = training.training_log

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                     skipped_iter, grad_norm, params_norm, num_zeros_in_grad, *args, **kwargs):
        if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
            record = {"iteration": iteration, "loss_scale": float(loss_scale), "skipped": int(skipped_iter),
                      "grad_norm": None if grad_norm is None else float(grad_norm),
                      "num_zeros": None if num_zeros_in_grad is None else float(num_zeros_in_grad),
                      "losses": {k: float(v) for k, v in loss_dict.items()}}
            if gpu_memory:
                record["max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
            print("PRECISE " + json.dumps(record), flush=True)
        return original(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                        skipped_iter, grad_norm, params_norm, num_zeros_in_grad, *args, **kwargs)

    training.training_log = training_log


def main(argv):
    if "--" not in argv:
        sys.exit(__doc__)
    ours, theirs = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    use_megatron_opt = "--megatron-opt" in ours
    precise_log = "--precise-log" in ours
    gpu = "--gpu" in ours
    paths = [a for a in ours if a not in ("--megatron-opt", "--precise-log", "--gpu")]
    if len(paths) != 1:
        sys.exit(__doc__)
    mlm_dir = os.path.abspath(paths[0])
    missing = [f for f in ("megatron", "pretrain_gpt.py", "gpt_builders.py", "model_provider.py")
               if not os.path.exists(os.path.join(mlm_dir, f))]
    if missing:
        sys.exit(f"run.py: {mlm_dir} is not a Megatron-LM tree (no {', '.join(missing)}); extract one with "
                 f"git archive REV megatron pretrain_gpt.py gpt_builders.py model_provider.py | tar -x -C DIR")
    sys.path[:0] = [mlm_dir]
    sys.path.insert(1, HERE)
    use_installed_dataset_helpers(mlm_dir)
    if not gpu:
        import cpu_shim
        cuda_to_cpu = cpu_shim.install()  # noqa: F841  (entered for the rest of the process)
    if use_megatron_opt:
        import megatron_opt.megatron; megatron_opt.megatron.install()  # noqa: E702  (the one line)
    if not gpu:
        cpu_shim.install_training()
    if precise_log:
        log_precisely(gpu_memory=gpu)
    script = os.path.join(mlm_dir, "pretrain_gpt.py")
    sys.argv = [script] + theirs
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
