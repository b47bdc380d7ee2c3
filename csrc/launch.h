// Host entry points of the megatron_opt CUDA kernels (implemented in the .cu files, bound in
// bindings.cpp). Every function checks its arguments, runs on the current CUDA stream of the
// tensors' device and never synchronises with the host.
//
// The step-plan tables (built once by megatron_opt/ops/step_plan.py, layout in common.cuh):
//   ptrs    int64 [nshard, 5]: raw addresses of grad, master, state0, state1, param_out (0 = absent)
//   chunks  int64 [nchunk, 4]: shard, start, end, meta (group id, in-norm bit, vector phase)
// dtype codes: 0 fp32, 1 bf16, 2 fp16, -1 absent (no param_out / no such state).
// master storage codes: 0 fp32, 2 fp16, 3 int16 remainder of a bf16 param_out (csrc/precision.cuh).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace megatron_opt {

// Pass 1: stats[0..2] += {non-finite count, inv_scale^2 * sum over in-norm pieces of grad^2, zero count}.
// sumsq_ws: float64 [>= nchunk]; counts_ws: int32 [>= 2 * nchunk] (per-chunk partials).
void grad_stats_cuda(const at::Tensor& ptrs, const at::Tensor& chunks, int64_t grad_code,
                     const at::Tensor& inv_scale, const at::Tensor& stats, const at::Tensor& sumsq_ws,
                     const at::Tensor& counts_ws, bool count_zeros);

// step += 1 unless found_inf != 0.
void advance_step_cuda(const at::Tensor& step, const std::optional<at::Tensor>& found_inf);

// Pass 2 over every chunk. lr_wd: float64 [ngroups, 2] device table (lr, weight decay) per param
// group; the grad is multiplied by float(grad_scale * clip_coef); nothing is written when found_inf != 0.
// AdamW takes precision-aware state: master_code (0 fp32, 2 fp16, 3 remainder: param_code must be 1),
// state codes (exp_avg, exp_avg_sq) in {(0,0), (1,1), (2,2), (1,0)}; stochastic: round bf16 moments
// stochastically with the hash of (element index, *step, slot) (precision.cuh).
void adamw_step_cuda(const at::Tensor& ptrs, const at::Tensor& chunks, int64_t grad_code, int64_t param_code,
                     int64_t master_code, int64_t state0_code, int64_t state1_code, const at::Tensor& lr_wd,
                     const at::Tensor& grad_scale, double clip_coef, const at::Tensor& step, double beta1,
                     double beta2, double eps, const std::optional<at::Tensor>& found_inf, bool stochastic);

// SGD and Lion: fp32 master and fp32 state only.

void sgd_step_cuda(const at::Tensor& ptrs, const at::Tensor& chunks, int64_t grad_code, int64_t param_code,
                   const at::Tensor& lr_wd, const at::Tensor& grad_scale, double clip_coef, double momentum,
                   bool nesterov, const std::optional<at::Tensor>& found_inf);

void lion_step_cuda(const at::Tensor& ptrs, const at::Tensor& chunks, int64_t grad_code, int64_t param_code,
                    const at::Tensor& lr_wd, const at::Tensor& grad_scale, double clip_coef, double beta1,
                    double beta2, const std::optional<at::Tensor>& found_inf);

}  // namespace megatron_opt
