// The pass-2 kernels by name: what a launch receives (Pass2Call) and the registry a rule's kernel file
// adds its launcher to (MEGATRON_OPT_REGISTER_PASS2 / MEGATRON_OPT_REGISTER_RULE in pass2.cuh), so that
// one binding (pass2_cuda, launch.h) serves every rule and no shared file lists the rules.
// Host-only (no device code): included by pass2.cuh, the registry and the bindings.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace megatron_opt {

// One pass-2 launch as the binding receives it (csrc/launch.h, pass2_cuda): the plan tables, the dtype
// codes, the per-step device tensors and the rule's constants (doubles, in the order its make_args reads).
struct Pass2Call {
  const char* op;  // the registered name, also the prefix of every message
  const at::Tensor& ptrs;
  const at::Tensor& chunks;
  int64_t grad_code, param_code, master_code, state0_code, state1_code;
  const at::Tensor& lr_wd;
  const at::Tensor& grad_scale;
  const std::optional<at::Tensor>& found_inf;
  const std::optional<at::Tensor>& step;  // the device update counter, for rules that read it
  bool stochastic;                        // round bf16 state stochastically (precision-aware rules)
  const std::vector<double>& constants;
};

// ------------------------------------------------------------------------------------------------
// Registration: a rule's kernel file registers its launcher under the op name its Python op record
// uses (UpdateArgs.op); the one binding pass2_cuda finds it by that name (pass2_registry.cpp).
// ------------------------------------------------------------------------------------------------
using Pass2Launcher = void (*)(const Pass2Call&);

bool register_pass2(const char* op, Pass2Launcher launcher);
// The launcher registered as ``op`` (an error naming the registered ones if none).
Pass2Launcher find_pass2(const std::string& op);
// The registered op names, sorted.
std::vector<std::string> registered_pass2();

#define MEGATRON_OPT_CONCAT_INNER(a, b) a##b
#define MEGATRON_OPT_CONCAT(a, b) MEGATRON_OPT_CONCAT_INNER(a, b)
// Registers LAUNCHER (void(const Pass2Call&)) as the pass-2 kernel named OP, when the extension loads.
#define MEGATRON_OPT_REGISTER_PASS2(OP, LAUNCHER)                                               \
  namespace {                                                                                  \
  const bool MEGATRON_OPT_CONCAT(registered_pass2_, __LINE__) =                                \
      ::megatron_opt::register_pass2(OP, LAUNCHER);                                            \
  }

}  // namespace megatron_opt
