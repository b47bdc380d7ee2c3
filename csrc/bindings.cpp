// Python bindings of the megatron_opt CUDA kernels (module megatron_opt._C).
// Argument checks live in the launchers (csrc/*.cu) and, with friendlier messages, in
// megatron_opt/ops/cuda.py, which is the supported entry point.
#include <torch/extension.h>

#include "launch.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron_opt fused optimizer-step kernels (use megatron_opt.ops, not this module)";
  m.def("grad_stats", &megatron_opt::grad_stats_cuda, "pass 1: non-finite count, sum of squares, zero count",
        py::arg("grad"), py::arg("bounds"), py::arg("in_norm"), py::arg("span_start"), py::arg("span_end"),
        py::arg("inv_scale"), py::arg("stats"), py::arg("count_zeros"));
  m.def("advance_step", &megatron_opt::advance_step_cuda, "step += 1 unless found_inf != 0", py::arg("step"),
        py::arg("found_inf"));
  m.def("adamw_step", &megatron_opt::adamw_step_cuda, "pass 2: AdamW", py::arg("grad"), py::arg("master"),
        py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("param_out"), py::arg("bounds"), py::arg("group"),
        py::arg("span_start"), py::arg("span_end"), py::arg("lr"), py::arg("weight_decay"), py::arg("grad_scale"),
        py::arg("step"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("found_inf"));
  m.def("sgd_step", &megatron_opt::sgd_step_cuda, "pass 2: SGD with momentum", py::arg("grad"), py::arg("master"),
        py::arg("momentum_buffer"), py::arg("param_out"), py::arg("bounds"), py::arg("group"), py::arg("span_start"),
        py::arg("span_end"), py::arg("lr"), py::arg("weight_decay"), py::arg("grad_scale"), py::arg("momentum"),
        py::arg("nesterov"), py::arg("found_inf"));
  m.def("lion_step", &megatron_opt::lion_step_cuda, "pass 2: Lion", py::arg("grad"), py::arg("master"),
        py::arg("exp_avg"), py::arg("param_out"), py::arg("bounds"), py::arg("group"), py::arg("span_start"),
        py::arg("span_end"), py::arg("lr"), py::arg("weight_decay"), py::arg("grad_scale"), py::arg("beta1"),
        py::arg("beta2"), py::arg("found_inf"));
}
