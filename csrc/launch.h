// Host entry points of the megatron_opt CUDA kernels (bound in bindings.cpp). Every function checks its
// arguments, runs on the current CUDA stream of the tensors' device and never synchronises with the host.
//
// The step-plan tables (built once by megatron_opt/ops/step_plan.py, layout in common.cuh):
//   ptrs    int64 [nshard, 5]: raw addresses of grad, master, state0, state1, param_out (0 = absent)
//   chunks  int64 [nchunk, 4]: shard, start, end, meta (group id, in-norm bit, vector phase)
// dtype codes: 0 fp32, 1 bf16, 2 fp16, -1 absent (no param_out / no such state).
// master storage codes: 0 fp32, 2 fp16, 3 int16 remainder of a bf16 param_out (csrc/precision.cuh).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

namespace megatron_opt {

// Pass 1: stats[0..2] += {non-finite count, inv_scale^2 * sum over in-norm pieces of grad^2, zero count}.
// sumsq_ws: float64 [>= nchunk]; counts_ws: int32 [>= 2 * nchunk] (per-chunk partials).
void grad_stats_cuda(const at::Tensor& ptrs, const at::Tensor& chunks, int64_t grad_code,
                     const at::Tensor& inv_scale, const at::Tensor& stats, const at::Tensor& sumsq_ws,
                     const at::Tensor& counts_ws, bool count_zeros);

// step += 1 unless found_inf != 0.
void advance_step_cuda(const at::Tensor& step, const std::optional<at::Tensor>& found_inf);

// Pass 2 of the rule whose kernel file registered itself as ``op`` (csrc/rules/), over every chunk.
// lr_wd: float64 [ngroups, 2] device table (lr, weight decay) per param group; the grad is multiplied by
// grad_scale; nothing is written when found_inf != 0. master_code and the state codes: the plan's
// storage (fp32-only rules take 0 and 0 / -1); step: the device update counter, for rules that read it;
// stochastic: round bf16 state stochastically with the hash of (element index, *step, slot)
// (precision.cuh); constants: the rule's constants, in the order its Args reads them.
void pass2_cuda(const std::string& op, const at::Tensor& ptrs, const at::Tensor& chunks, int64_t grad_code,
                int64_t param_code, int64_t master_code, int64_t state0_code, int64_t state1_code,
                const at::Tensor& lr_wd, const at::Tensor& grad_scale, const std::optional<at::Tensor>& found_inf,
                const std::optional<at::Tensor>& step, bool stochastic, const std::vector<double>& constants);

}  // namespace megatron_opt
