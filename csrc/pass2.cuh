// The pass-2 (optimizer update) kernel shared by adamw.cu, sgd.cu and lion.cu.
//
// One launch covers every chunk of a step plan (see common.cuh), one block per chunk. A rule supplies
// its per-element math; this file walks the chunk (scalar head, 16-byte vector body, scalar tail),
// reads the per-step scalars from device memory and writes piece elements only: padding gaps between
// pieces are never touched.
//   * lr and weight decay come from a float64 device table [ngroups, 2] (lr, wd) that the optimizer
//     updates in place, so a captured CUDA graph replays the current values.
//   * grad_scale (inv loss scale times DP pre-scale) is a device scalar; clip_coef multiplies it
//     (one fp32 rounding, as the reference's grad_scale * clip_coef).
//   * if found_inf is given and nonzero (NaN counts as nonzero) every block returns before touching
//     memory, so all state is left bitwise unchanged.
// The fp32 arithmetic of each rule mirrors the reference's sequence of torch ops, each rounded once
// (explicit __f*_rn intrinsics keep nvcc from fusing them), so results track ops.reference.
#pragma once

#include "common.cuh"

#include <optional>
#include <utility>

namespace megatron_opt {

constexpr int kPass2Unroll = 2;  // vector packs in flight per thread

// Rule interface (see AdamwRule in adamw.cu):
//   static constexpr int kStates;                  // fp32 state arrays (0, 1 or 2)
//   struct Args;                                   // per-launch constants, passed by value
//   struct Seg;                                    // per-chunk constants
//   static __device__ Seg seg(const Args&, double lr, double wd, float grad_scale);
//   static __device__ void math(float g, float& w, float& s0, float& s1, const Args&, const Seg&);
template <typename Rule, typename GT, typename PT, bool kParamOut>
__device__ __forceinline__ void update_one(const typename GT::S* grad, float* w, float* s0, float* s1,
                                           typename PT::S* po, int64_t i, const typename Rule::Args& a,
                                           const typename Rule::Seg& k) {
  float wv = w[i];
  float v0 = Rule::kStates > 0 ? s0[i] : 0.0f;
  float v1 = Rule::kStates > 1 ? s1[i] : 0.0f;
  Rule::math(GT::to_float(grad[i]), wv, v0, v1, a, k);
  w[i] = wv;
  if constexpr (Rule::kStates > 0) s0[i] = v0;
  if constexpr (Rule::kStates > 1) s1[i] = v1;
  if constexpr (kParamOut) po[i] = PT::from_float(wv);
}

template <typename Rule, typename GT, typename PT, bool kParamOut>
__global__ void __launch_bounds__(kThreads)
    pass2_kernel(const int64_t* __restrict__ ptrs, const int64_t* __restrict__ chunks,
                 const double* __restrict__ lr_wd, int ngroups, const float* __restrict__ grad_scale_ptr,
                 float clip_coef, const float* __restrict__ found_inf_ptr, const typename Rule::Args a) {
  using GS = typename GT::S;
  using PS = typename PT::S;
  constexpr int VEC = 16 / static_cast<int>(sizeof(GS));
  if (found_inf_ptr != nullptr && *found_inf_ptr != 0.0f) return;  // skipped step: write nothing
  const Chunk c = load_chunk(chunks, blockIdx.x);
  const int64_t* row = ptrs + kPtrCols * c.shard;
  const GS* grad = reinterpret_cast<const GS*>(row[0]);
  float* w = reinterpret_cast<float*>(row[1]);
  float* s0 = reinterpret_cast<float*>(row[2]);
  float* s1 = reinterpret_cast<float*>(row[3]);
  PS* po = reinterpret_cast<PS*>(row[4]);
  const int gid = c.group < 0 ? 0 : (c.group >= ngroups ? ngroups - 1 : c.group);  // validated on the host
  const typename Rule::Seg k =
      Rule::seg(a, lr_wd[2 * gid], lr_wd[2 * gid + 1], __fmul_rn(*grad_scale_ptr, clip_coef));

  if (c.phase < 0) {
    for (int64_t i = c.start + threadIdx.x; i < c.end; i += kThreads) {
      update_one<Rule, GT, PT, kParamOut>(grad, w, s0, s1, po, i, a, k);
    }
    return;
  }
  const Split sp = split_range<VEC>(c.start, c.end, c.phase);
  if (static_cast<int64_t>(threadIdx.x) < sp.head_end - c.start) {
    update_one<Rule, GT, PT, kParamOut>(grad, w, s0, s1, po, c.start + threadIdx.x, a, k);
  }
  if (static_cast<int64_t>(threadIdx.x) < c.end - sp.body_end) {
    update_one<Rule, GT, PT, kParamOut>(grad, w, s0, s1, po, sp.body_end + threadIdx.x, a, k);
  }
  for (int64_t base = 0; base < sp.nvec; base += static_cast<int64_t>(kThreads) * kPass2Unroll) {
    Pack<GS, VEC> gp[kPass2Unroll];
    Pack<float, VEC> wp[kPass2Unroll], p0[kPass2Unroll], p1[kPass2Unroll];
#pragma unroll
    for (int u = 0; u < kPass2Unroll; ++u) {
      const int64_t v = base + static_cast<int64_t>(u) * kThreads + threadIdx.x;
      if (v < sp.nvec) {
        const int64_t i = sp.head_end + v * VEC;
        gp[u] = load_pack<GS, VEC>(grad + i);
        wp[u] = load_pack<float, VEC>(w + i);
        if constexpr (Rule::kStates > 0) p0[u] = load_pack<float, VEC>(s0 + i);
        if constexpr (Rule::kStates > 1) p1[u] = load_pack<float, VEC>(s1 + i);
      }
    }
#pragma unroll
    for (int u = 0; u < kPass2Unroll; ++u) {
      const int64_t v = base + static_cast<int64_t>(u) * kThreads + threadIdx.x;
      if (v < sp.nvec) {
        const int64_t i = sp.head_end + v * VEC;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          float v0 = Rule::kStates > 0 ? p0[u].e[j] : 0.0f;
          float v1 = Rule::kStates > 1 ? p1[u].e[j] : 0.0f;
          Rule::math(GT::to_float(gp[u].e[j]), wp[u].e[j], v0, v1, a, k);
          if constexpr (Rule::kStates > 0) p0[u].e[j] = v0;
          if constexpr (Rule::kStates > 1) p1[u].e[j] = v1;
        }
        store_pack<float, VEC>(w + i, wp[u]);
        if constexpr (Rule::kStates > 0) store_pack<float, VEC>(s0 + i, p0[u]);
        if constexpr (Rule::kStates > 1) store_pack<float, VEC>(s1 + i, p1[u]);
        if constexpr (kParamOut) {
          Pack<PS, VEC> pp;
#pragma unroll
          for (int j = 0; j < VEC; ++j) pp.e[j] = PT::from_float(wp[u].e[j]);
          store_pack<PS, VEC>(po + i, pp);
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Host side: argument checks and dtype dispatch
// ------------------------------------------------------------------------------------------------
struct Pass2Args {
  const at::Tensor& ptrs;
  const at::Tensor& chunks;
  const at::Tensor& lr_wd;
  const at::Tensor& grad_scale;
  double clip_coef;
  const std::optional<at::Tensor>& found_inf;
};

inline at::Device check_pass2(const char* op, const Pass2Args& p) {
  TORCH_CHECK(p.grad_scale.is_cuda(), op, ": grad_scale must be a CUDA tensor");
  const at::Device device = p.grad_scale.device();
  check_plan_tables(p.ptrs, p.chunks, device);
  check_cuda_tensor(p.lr_wd, "lr_wd", device);
  check_dtype(p.lr_wd, "lr_wd", at::kDouble);
  TORCH_CHECK(p.lr_wd.dim() == 2 && p.lr_wd.size(1) == 2 && p.lr_wd.size(0) >= 1,
              op, ": lr_wd must have shape [ngroups, 2]");
  TORCH_CHECK(p.lr_wd.size(0) <= INT32_MAX, op, ": too many param groups");
  check_scalar(p.grad_scale, "grad_scale", device, at::kFloat);
  if (p.found_inf.has_value()) check_scalar(*p.found_inf, "found_inf", device, at::kFloat);
  return device;
}

template <typename Rule, typename GT, typename PT, bool kParamOut>
void launch_pass2(const Pass2Args& p, const typename Rule::Args& a) {
  const unsigned grid = static_cast<unsigned>(p.chunks.size(0));
  const float* fi = p.found_inf.has_value() ? p.found_inf->template data_ptr<float>() : nullptr;
  pass2_kernel<Rule, GT, PT, kParamOut><<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      p.ptrs.template data_ptr<int64_t>(), p.chunks.template data_ptr<int64_t>(), p.lr_wd.template data_ptr<double>(),
      static_cast<int>(p.lr_wd.size(0)), p.grad_scale.template data_ptr<float>(), static_cast<float>(p.clip_coef),
      fi, a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Rule, typename GT>
void dispatch_param_code(const char* op, int64_t param_code, const Pass2Args& p, const typename Rule::Args& a) {
  switch (param_code) {
    case kCodeNone:
      launch_pass2<Rule, GT, F32, false>(p, a);
      break;
    case kCodeF32:
      launch_pass2<Rule, GT, F32, true>(p, a);
      break;
    case kCodeBF16:
      launch_pass2<Rule, GT, BF16, true>(p, a);
      break;
    case kCodeF16:
      launch_pass2<Rule, GT, F16, true>(p, a);
      break;
    default:
      TORCH_CHECK(false, op, ": unknown param_out dtype code ", param_code);
  }
}

// Checks, then launches Rule's pass 2 for the plan's grad / param_out dtype codes.
template <typename Rule>
void run_pass2(const char* op, int64_t grad_code, int64_t param_code, const Pass2Args& p,
               const typename Rule::Args& a) {
  const at::Device device = check_pass2(op, p);
  if (p.chunks.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(device);
  switch (grad_code) {
    case kCodeF32:
      dispatch_param_code<Rule, F32>(op, param_code, p, a);
      break;
    case kCodeBF16:
      dispatch_param_code<Rule, BF16>(op, param_code, p, a);
      break;
    case kCodeF16:
      dispatch_param_code<Rule, F16>(op, param_code, p, a);
      break;
    default:
      TORCH_CHECK(false, op, ": unknown grad dtype code ", grad_code);
  }
}

}  // namespace megatron_opt
