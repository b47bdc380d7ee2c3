// Helpers shared by the pass-2 (optimizer update) kernels: adamw.cu, sgd.cu, lion.cu.
//
// Every pass-2 kernel walks the pieces of one flat shard exactly like the others (see common.cuh):
// only piece elements are touched, padding gaps between pieces are never written. Per-step scalars
// (grad_scale, step, found_inf) are read from device memory; if found_inf is given and nonzero (NaN
// counts as nonzero), every block returns before touching memory, so all state is left bitwise
// unchanged. lr and weight decay are per param group: up to kMaxInlineGroups groups travel by
// value in the kernel arguments (no copy to the device, CUDA-graph capturable), more are uploaded
// to a small float64 device tensor.
//
// The fp32 arithmetic of each kernel mirrors the reference's sequence of torch ops, each rounded
// once (explicit __f*_rn intrinsics keep nvcc from fusing them), so results track ops.reference.
#pragma once

#include "common.cuh"

#include <optional>
#include <utility>
#include <vector>

namespace megatron_opt {

// ------------------------------------------------------------------------------------------------
// Per-group lr / weight decay
// ------------------------------------------------------------------------------------------------
constexpr int kMaxInlineGroups = 64;

struct GroupParams {
  double lr[kMaxInlineGroups];
  double wd[kMaxInlineGroups];
};

struct GroupSource {
  GroupParams inline_params;
  const double* device_params;  // [ngroups, 2] (lr, wd) or nullptr when inline
  int ngroups;
};

__device__ __forceinline__ void group_lr_wd(const GroupSource& src, const int32_t* group, int64_t s, double& lr,
                                            double& wd) {
  int gid = group[s];
  gid = gid < 0 ? 0 : (gid >= src.ngroups ? src.ngroups - 1 : gid);  // the Python wrapper validates ids
  if (src.device_params != nullptr) {
    lr = src.device_params[2 * gid];
    wd = src.device_params[2 * gid + 1];
  } else {
    lr = src.inline_params.lr[gid];
    wd = src.inline_params.wd[gid];
  }
}

// Fills `src` (inline when it fits); `holder` keeps an uploaded table alive until after the launch.
inline void prepare_groups(const std::vector<double>& lr, const std::vector<double>& wd, const at::Device& device,
                           GroupSource& src, at::Tensor& holder) {
  TORCH_CHECK(!lr.empty(), "lr must have one entry per param group");
  TORCH_CHECK(lr.size() == wd.size(), "lr and weight_decay must have the same length, got ", lr.size(), " and ",
              wd.size());
  TORCH_CHECK(lr.size() <= static_cast<size_t>(INT32_MAX), "too many param groups");
  src.ngroups = static_cast<int>(lr.size());
  src.device_params = nullptr;
  for (int i = 0; i < kMaxInlineGroups; ++i) {
    src.inline_params.lr[i] = i < src.ngroups ? lr[i] : 0.0;
    src.inline_params.wd[i] = i < src.ngroups ? wd[i] : 0.0;
  }
  if (src.ngroups > kMaxInlineGroups) {
    at::Tensor host = at::empty({2 * static_cast<int64_t>(src.ngroups)}, at::TensorOptions().dtype(at::kDouble));
    double* h = host.data_ptr<double>();
    for (int i = 0; i < src.ngroups; ++i) {
      h[2 * i] = lr[i];
      h[2 * i + 1] = wd[i];
    }
    holder = host.to(device);  // synchronous copy from pageable memory (not capturable)
    src.device_params = holder.data_ptr<double>();
  }
}

// ------------------------------------------------------------------------------------------------
// Host side: dtype dispatch and argument checks
// ------------------------------------------------------------------------------------------------
// Runs L<GT, PT>::run(args...) for the runtime grad / param_out dtypes. Without a param_out the
// fp32 instantiation is used with a null pointer (the kernels test it at run time).
template <template <typename, typename> class L, typename GT, typename... Args>
void dispatch_param(std::optional<at::ScalarType> param_t, const char* op, Args&&... args) {
  if (!param_t.has_value()) {
    L<GT, F32>::run(std::forward<Args>(args)...);
    return;
  }
  switch (*param_t) {
    case at::kFloat:
      L<GT, F32>::run(std::forward<Args>(args)...);
      break;
    case at::kBFloat16:
      L<GT, BF16>::run(std::forward<Args>(args)...);
      break;
    case at::kHalf:
      L<GT, F16>::run(std::forward<Args>(args)...);
      break;
    default:
      TORCH_CHECK(false, op, ": param_out must be float32, bfloat16 or float16, got ", *param_t);
  }
}

template <template <typename, typename> class L, typename... Args>
void dispatch_grad_param(at::ScalarType grad_t, std::optional<at::ScalarType> param_t, const char* op,
                         Args&&... args) {
  switch (grad_t) {
    case at::kFloat:
      dispatch_param<L, F32>(param_t, op, std::forward<Args>(args)...);
      break;
    case at::kBFloat16:
      dispatch_param<L, BF16>(param_t, op, std::forward<Args>(args)...);
      break;
    case at::kHalf:
      dispatch_param<L, F16>(param_t, op, std::forward<Args>(args)...);
      break;
    default:
      TORCH_CHECK(false, op, ": grad must be float32, bfloat16 or float16, got ", grad_t);
  }
}

inline void check_state(const at::Tensor& t, const char* name, const at::Device& device, int64_t span_end) {
  check_cuda_tensor(t, name, device);
  check_dtype(t, name, at::kFloat);
  check_flat(t, name, span_end);
}

// The checks every pass-2 op shares: grad, master, optional param_out, the piece table, grad_scale
// and the optional found_inf.
inline void check_common(const char* op, const at::Tensor& grad, const at::Tensor& master,
                         const std::optional<at::Tensor>& param_out, const at::Tensor& bounds,
                         const at::Tensor& group, int64_t span_start, int64_t span_end, const at::Tensor& grad_scale,
                         const std::optional<at::Tensor>& found_inf) {
  TORCH_CHECK(grad.is_cuda(), op, ": grad must be a CUDA tensor");
  const at::Device device = grad.device();
  check_cuda_tensor(grad, "grad", device);
  TORCH_CHECK(is_grad_dtype(grad.scalar_type()), op, ": grad must be float32, bfloat16 or float16, got ",
              grad.scalar_type());
  TORCH_CHECK(0 <= span_start && span_start <= span_end, op, ": bad span [", span_start, ", ", span_end, ")");
  check_flat(grad, "grad", span_end);
  check_state(master, "master", device, span_end);
  if (param_out.has_value()) {
    check_cuda_tensor(*param_out, "param_out", device);
    TORCH_CHECK(is_grad_dtype(param_out->scalar_type()), op,
                ": param_out must be float32, bfloat16 or float16, got ", param_out->scalar_type());
    check_flat(*param_out, "param_out", span_end);
  }
  check_table(bounds, group, "group", at::kInt, device);
  check_scalar(grad_scale, "grad_scale", device, at::kFloat);
  if (found_inf.has_value()) check_scalar(*found_inf, "found_inf", device, at::kFloat);
}

inline std::optional<at::ScalarType> param_dtype(const std::optional<at::Tensor>& param_out) {
  std::optional<at::ScalarType> pt;
  if (param_out.has_value()) pt = param_out->scalar_type();
  return pt;
}

}  // namespace megatron_opt
