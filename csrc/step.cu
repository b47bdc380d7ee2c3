// advance_step: step += 1 unless found_inf != 0 (NaN counts as nonzero), entirely on the device.
#include "common.cuh"
#include "launch.h"

namespace megatron_opt {
namespace {

__global__ void advance_step_kernel(int64_t* step, const float* found_inf) {
  if (found_inf == nullptr || *found_inf == 0.0f) *step += 1;
}

}  // namespace

void advance_step_cuda(const at::Tensor& step, const std::optional<at::Tensor>& found_inf) {
  TORCH_CHECK(step.is_cuda(), "advance_step: step must be a CUDA tensor");
  const at::Device device = step.device();
  check_scalar(step, "step", device, at::kLong);
  if (found_inf.has_value()) check_scalar(*found_inf, "found_inf", device, at::kFloat);
  const c10::cuda::CUDAGuard guard(device);
  const float* fi = found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr;
  advance_step_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(step.data_ptr<int64_t>(), fi);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace megatron_opt
