// Host entry points of the megatron_opt CUDA kernels (implemented in the .cu files, bound in
// bindings.cpp). Every function checks its arguments, runs on the current CUDA stream of the
// tensors' device and never synchronises with the host.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace megatron_opt {

// stats[0..2] += {non-finite count, sum over in-norm pieces of (grad*inv_scale)^2, zero count}.
// bounds: int64 [npiece, 2]; in_norm: uint8 [npiece]; [span_start, span_end) = first start, last end.
void grad_stats_cuda(const at::Tensor& grad, const at::Tensor& bounds, const at::Tensor& in_norm,
                     int64_t span_start, int64_t span_end, const at::Tensor& inv_scale, const at::Tensor& stats,
                     bool count_zeros);

// step += 1 unless found_inf != 0.
void advance_step_cuda(const at::Tensor& step, const std::optional<at::Tensor>& found_inf);

// One AdamW step (torch.optim.AdamW formula) over the pieces; lr/weight_decay per group id.
void adamw_step_cuda(const at::Tensor& grad, const at::Tensor& master, const at::Tensor& exp_avg,
                     const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out,
                     const at::Tensor& bounds, const at::Tensor& group, int64_t span_start, int64_t span_end,
                     const std::vector<double>& lr, const std::vector<double>& weight_decay,
                     const at::Tensor& grad_scale, const at::Tensor& step, double beta1, double beta2, double eps,
                     const std::optional<at::Tensor>& found_inf);

// One SGD step (torch.optim.SGD formula, dampening 0) over the pieces.
void sgd_step_cuda(const at::Tensor& grad, const at::Tensor& master, const std::optional<at::Tensor>& momentum_buffer,
                   const std::optional<at::Tensor>& param_out, const at::Tensor& bounds, const at::Tensor& group,
                   int64_t span_start, int64_t span_end, const std::vector<double>& lr,
                   const std::vector<double>& weight_decay, const at::Tensor& grad_scale, double momentum,
                   bool nesterov, const std::optional<at::Tensor>& found_inf);

// One Lion step (decoupled weight decay) over the pieces; lr/weight_decay per group id.
void lion_step_cuda(const at::Tensor& grad, const at::Tensor& master, const at::Tensor& exp_avg,
                    const std::optional<at::Tensor>& param_out, const at::Tensor& bounds, const at::Tensor& group,
                    int64_t span_start, int64_t span_end, const std::vector<double>& lr,
                    const std::vector<double>& weight_decay, const at::Tensor& grad_scale, double beta1, double beta2,
                    const std::optional<at::Tensor>& found_inf);

}  // namespace megatron_opt
