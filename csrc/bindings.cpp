// Python bindings of the megatron_opt CUDA kernels (module megatron_opt._C). Pass 2 is one binding for
// every rule: each rule's kernel file registers itself by name (csrc/rules/, pass2_registry.h).
// Argument checks live in the launchers and, with friendlier messages, in megatron_opt/ops/ and each
// rule's op record, which are the supported entry points.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "launch.h"
#include "pass2_registry.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron_opt fused optimizer-step kernels (use megatron_opt.ops, not this module)";
  m.def("grad_stats", &megatron_opt::grad_stats_cuda, "pass 1: non-finite count, sum of squares, zero count",
        py::arg("ptrs"), py::arg("chunks"), py::arg("grad_code"), py::arg("inv_scale"), py::arg("stats"),
        py::arg("sumsq_ws"), py::arg("counts_ws"), py::arg("count_zeros"));
  m.def("advance_step", &megatron_opt::advance_step_cuda, "step += 1 unless found_inf != 0", py::arg("step"),
        py::arg("found_inf"));
  m.def("pass2", &megatron_opt::pass2_cuda, "pass 2 of the rule registered as op", py::arg("op"), py::arg("ptrs"),
        py::arg("chunks"), py::arg("grad_code"), py::arg("param_code"), py::arg("master_code"),
        py::arg("state0_code"), py::arg("state1_code"), py::arg("lr_wd"), py::arg("grad_scale"),
        py::arg("found_inf"), py::arg("step"), py::arg("stochastic"), py::arg("constants"));
  m.def("pass2_ops", &megatron_opt::registered_pass2, "the op names of the registered pass-2 kernels");
}
