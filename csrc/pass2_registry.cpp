// The registry of pass-2 launchers by op name (pass2_registry.h) and the one pass-2 binding.
#include "pass2_registry.h"

#include <map>
#include <sstream>

#include "launch.h"

namespace megatron_opt {
namespace {

// Filled while the extension loads (each rule file's registration runs then), read-only afterwards.
std::map<std::string, Pass2Launcher>& launchers() {
  static std::map<std::string, Pass2Launcher> by_name;
  return by_name;
}

}  // namespace

bool register_pass2(const char* op, Pass2Launcher launcher) {
  const bool fresh = launchers().emplace(op, launcher).second;
  TORCH_CHECK(fresh, "megatron_opt: two pass-2 kernels registered as '", op, "'");
  return fresh;
}

std::vector<std::string> registered_pass2() {
  std::vector<std::string> names;
  for (const auto& entry : launchers()) names.push_back(entry.first);
  return names;
}

Pass2Launcher find_pass2(const std::string& op) {
  const auto it = launchers().find(op);
  if (it == launchers().end()) {
    std::ostringstream known;
    for (const auto& name : registered_pass2()) known << " " << name;
    TORCH_CHECK(false, "no pass-2 kernel registered as '", op, "' (registered:", known.str(), ")");
  }
  return it->second;
}

void pass2_cuda(const std::string& op, const at::Tensor& ptrs, const at::Tensor& chunks, int64_t grad_code,
                int64_t param_code, int64_t master_code, int64_t state0_code, int64_t state1_code,
                const at::Tensor& lr_wd, const at::Tensor& grad_scale, const std::optional<at::Tensor>& found_inf,
                const std::optional<at::Tensor>& step, bool stochastic, const std::vector<double>& constants) {
  const Pass2Launcher launch = find_pass2(op);
  launch(Pass2Call{op.c_str(), ptrs, chunks, grad_code, param_code, master_code, state0_code, state1_code, lr_wd,
                   grad_scale, found_inf, step, stochastic, constants});
}

}  // namespace megatron_opt
