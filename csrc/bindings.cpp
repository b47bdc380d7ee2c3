// Python bindings of the megatron_opt CUDA kernels (module megatron_opt._C).
// Argument checks live in the launchers (csrc/*.cu) and, with friendlier messages, in
// megatron_opt/ops/step_plan.py and megatron_opt/ops/cuda.py, which are the supported entry points.
#include <torch/extension.h>

#include "launch.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron_opt fused optimizer-step kernels (use megatron_opt.ops, not this module)";
  m.def("grad_stats", &megatron_opt::grad_stats_cuda, "pass 1: non-finite count, sum of squares, zero count",
        py::arg("ptrs"), py::arg("chunks"), py::arg("grad_code"), py::arg("inv_scale"), py::arg("stats"),
        py::arg("sumsq_ws"), py::arg("counts_ws"), py::arg("count_zeros"));
  m.def("advance_step", &megatron_opt::advance_step_cuda, "step += 1 unless found_inf != 0", py::arg("step"),
        py::arg("found_inf"));
  m.def("adamw_step", &megatron_opt::adamw_step_cuda, "pass 2: AdamW (precision-aware master and moments)",
        py::arg("ptrs"), py::arg("chunks"), py::arg("grad_code"), py::arg("param_code"), py::arg("master_code"),
        py::arg("state0_code"), py::arg("state1_code"), py::arg("lr_wd"), py::arg("grad_scale"),
        py::arg("clip_coef"), py::arg("step"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("found_inf"), py::arg("stochastic"));
  m.def("sgd_step", &megatron_opt::sgd_step_cuda, "pass 2: SGD with momentum", py::arg("ptrs"), py::arg("chunks"),
        py::arg("grad_code"), py::arg("param_code"), py::arg("lr_wd"), py::arg("grad_scale"), py::arg("clip_coef"),
        py::arg("momentum"), py::arg("nesterov"), py::arg("found_inf"));
  m.def("lion_step", &megatron_opt::lion_step_cuda, "pass 2: Lion", py::arg("ptrs"), py::arg("chunks"),
        py::arg("grad_code"), py::arg("param_code"), py::arg("lr_wd"), py::arg("grad_scale"), py::arg("clip_coef"),
        py::arg("beta1"), py::arg("beta2"), py::arg("found_inf"));
}
