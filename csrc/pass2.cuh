// The pass-2 (optimizer update) kernel every elementwise rule shares (csrc/rules/<rule>.cu), and its
// generic host side: argument checks, dtype dispatch and the registration of a rule's launcher by name.
//
// One launch covers every chunk of a step plan (see common.cuh), one block per chunk. A rule supplies
// its per-element math; this file walks the chunk (scalar head, 16-byte vector body, scalar tail),
// reads the per-step scalars from device memory and writes piece elements only: padding gaps between
// pieces are never touched.
//   * storage is a template parameter (precision.cuh): the master as fp32, fp16 or an int16 remainder
//     of the bf16 param_out (which is then read too), each state slot fp32 / bf16 / fp16. Each element
//     is widened to fp32, updated, and rounded once on store (nearest even, or stochastically for bf16
//     slots when the launch passes the device step for the hash): one pass, no fp32 copies. The vector
//     body moves packs of VEC elements of every array in its own storage type. A rule with
//     kPrecisionAware = false (SGD, Lion) is instantiated for fp32 master and state only
//     (run_pass2_fp32), one with kPrecisionAware = true (AdamW) for every master storage and the
//     state pairs of supported_state_pair (run_pass2_master).
//   * lr and weight decay come from a float64 device table [ngroups, 2] (lr, wd) that the optimizer
//     updates in place, so a captured CUDA graph replays the current values.
//   * grad_scale is the step's one gradient multiplier (unscale factor / loss scale, times the clip
//     coefficient), a device scalar the optimizer computed: the kernel reads it as is.
//   * if found_inf is given and nonzero (NaN counts as nonzero) every block returns before touching
//     memory, so all state is left bitwise unchanged.
// The fp32 arithmetic of each rule mirrors the reference's sequence of torch ops, each rounded once
// (explicit __f*_rn intrinsics keep nvcc from fusing them), so results track the rule's reference op.
#pragma once

#include "common.cuh"
#include "pass2_registry.h"
#include "precision.cuh"

#include <optional>
#include <utility>
#include <vector>

namespace megatron_opt {

constexpr int kPass2Unroll = 2;  // vector packs in flight per thread

// Rule interface (see LionRule in rules/lion.cu, AdamwRule in rules/adamw.cuh):
//   static constexpr int kStates;                  // state arrays (0, 1 or 2)
//   static constexpr bool kPrecisionAware;         // 16-bit state / fp16 and remainder masters (else fp32 only)
//   struct Args;                                   // per-launch constants, passed by value
//   struct Seg;                                    // per-chunk constants
//   static Args make_args(const Pass2Call&, at::Device);  // host: the constants from the call (and checks)
//   static __device__ Seg seg(const Args&, double lr, double wd, float grad_scale);
//   static __device__ void math(float g, float& w, float& s0, float& s1, const Args&, const Seg&);
// The kernel's other template parameters say how values are stored (precision.cuh): GT the grad,
// PT param_out (kParamOut: whether there is one), MP the master storage, T0 / T1 the state slots.
// Every element is loaded (widened to fp32), updated by Rule::math in fp32 and rounded once on store.
template <typename Rule, typename GT, typename PT, typename MP, bool kParamOut, typename T0, typename T1>
struct Pass2Elem {
  using GS = typename GT::S;
  using PS = typename PT::S;
  using MS = typename MP::S;
  using S0 = typename T0::S;
  using S1 = typename T1::S;
  static_assert(!MP::kReadsParam || kParamOut, "this master storage needs param_out");

  // One element, scalar loads and stores.
  static __device__ __forceinline__ void one(const GS* grad, MS* w, S0* s0, S1* s1, PS* po, int64_t i,
                                             const typename Rule::Args& a, const typename Rule::Seg& k,
                                             const StochasticArgs& sr) {
    PS pv{};
    if constexpr (MP::kReadsParam) pv = po[i];
    float wv = MP::load(w[i], pv);
    float v0 = 0.0f, v1 = 0.0f;
    if constexpr (Rule::kStates > 0) v0 = T0::to_float(s0[i]);
    if constexpr (Rule::kStates > 1) v1 = T1::to_float(s1[i]);
    Rule::math(GT::to_float(grad[i]), wv, v0, v1, a, k);
    if constexpr (Rule::kStates > 0) s0[i] = store_state<T0>(v0, sr.on, sr.base0, i);
    if constexpr (Rule::kStates > 1) s1[i] = store_state<T1>(v1, sr.on, sr.base1, i);
    MS mv;
    MP::template store<PT, kParamOut>(wv, mv, pv);
    w[i] = mv;
    if constexpr (kParamOut) po[i] = pv;
  }
};

template <typename Rule, typename GT, typename PT, typename MP, bool kParamOut, typename T0, typename T1>
__global__ void __launch_bounds__(kThreads)
    pass2_kernel(const int64_t* __restrict__ ptrs, const int64_t* __restrict__ chunks,
                 const double* __restrict__ lr_wd, int ngroups, const float* __restrict__ grad_scale_ptr,
                 const float* __restrict__ found_inf_ptr, const int64_t* __restrict__ sr_step,
                 const typename Rule::Args a) {
  using E = Pass2Elem<Rule, GT, PT, MP, kParamOut, T0, T1>;
  using GS = typename E::GS;
  using PS = typename E::PS;
  using MS = typename E::MS;
  using S0 = typename E::S0;
  using S1 = typename E::S1;
  constexpr int VEC = 16 / static_cast<int>(sizeof(GS));
  if (found_inf_ptr != nullptr && *found_inf_ptr != 0.0f) return;  // skipped step: write nothing
  const Chunk c = load_chunk(chunks, blockIdx.x);
  const int64_t* row = ptrs + kPtrCols * c.shard;
  const GS* grad = reinterpret_cast<const GS*>(row[0]);
  MS* w = reinterpret_cast<MS*>(row[1]);
  S0* s0 = reinterpret_cast<S0*>(row[2]);
  S1* s1 = reinterpret_cast<S1*>(row[3]);
  PS* po = reinterpret_cast<PS*>(row[4]);
  const int gid = c.group < 0 ? 0 : (c.group >= ngroups ? ngroups - 1 : c.group);  // validated on the host
  const typename Rule::Seg k = Rule::seg(a, lr_wd[2 * gid], lr_wd[2 * gid + 1], *grad_scale_ptr);
  const StochasticArgs sr = stochastic_args(sr_step);  // sr_step == nullptr: nearest rounding

  if (c.phase < 0) {
    for (int64_t i = c.start + threadIdx.x; i < c.end; i += kThreads) {
      E::one(grad, w, s0, s1, po, i, a, k, sr);
    }
    return;
  }
  const Split sp = split_range<VEC>(c.start, c.end, c.phase);
  if (static_cast<int64_t>(threadIdx.x) < sp.head_end - c.start) {
    E::one(grad, w, s0, s1, po, c.start + threadIdx.x, a, k, sr);
  }
  if (static_cast<int64_t>(threadIdx.x) < c.end - sp.body_end) {
    E::one(grad, w, s0, s1, po, sp.body_end + threadIdx.x, a, k, sr);
  }
  for (int64_t base = 0; base < sp.nvec; base += static_cast<int64_t>(kThreads) * kPass2Unroll) {
    Pack<GS, VEC> gp[kPass2Unroll];
    Pack<MS, VEC> wp[kPass2Unroll];
    Pack<S0, VEC> p0[kPass2Unroll];
    Pack<S1, VEC> p1[kPass2Unroll];
    Pack<PS, VEC> pp[kPass2Unroll];
#pragma unroll
    for (int u = 0; u < kPass2Unroll; ++u) {
      const int64_t v = base + static_cast<int64_t>(u) * kThreads + threadIdx.x;
      if (v < sp.nvec) {
        const int64_t i = sp.head_end + v * VEC;
        gp[u] = load_pack<GS, VEC>(grad + i);
        wp[u] = load_pack<MS, VEC>(w + i);
        if constexpr (Rule::kStates > 0) p0[u] = load_pack<S0, VEC>(s0 + i);
        if constexpr (Rule::kStates > 1) p1[u] = load_pack<S1, VEC>(s1 + i);
        if constexpr (MP::kReadsParam) pp[u] = load_pack<PS, VEC>(po + i);
      }
    }
#pragma unroll
    for (int u = 0; u < kPass2Unroll; ++u) {
      const int64_t v = base + static_cast<int64_t>(u) * kThreads + threadIdx.x;
      if (v < sp.nvec) {
        const int64_t i = sp.head_end + v * VEC;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          float wv;
          if constexpr (MP::kReadsParam) {
            wv = MP::load(wp[u].e[j], pp[u].e[j]);
          } else {
            wv = MP::load(wp[u].e[j], PS{});
          }
          float v0 = 0.0f, v1 = 0.0f;
          if constexpr (Rule::kStates > 0) v0 = T0::to_float(p0[u].e[j]);
          if constexpr (Rule::kStates > 1) v1 = T1::to_float(p1[u].e[j]);
          Rule::math(GT::to_float(gp[u].e[j]), wv, v0, v1, a, k);
          if constexpr (Rule::kStates > 0) p0[u].e[j] = store_state<T0>(v0, sr.on, sr.base0, i + j);
          if constexpr (Rule::kStates > 1) p1[u].e[j] = store_state<T1>(v1, sr.on, sr.base1, i + j);
          MP::template store<PT, kParamOut>(wv, wp[u].e[j], pp[u].e[j]);
        }
        store_pack<MS, VEC>(w + i, wp[u]);
        if constexpr (Rule::kStates > 0) store_pack<S0, VEC>(s0 + i, p0[u]);
        if constexpr (Rule::kStates > 1) store_pack<S1, VEC>(s1 + i, p1[u]);
        if constexpr (kParamOut) store_pack<PS, VEC>(po + i, pp[u]);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Host side: argument checks and dtype dispatch
// ------------------------------------------------------------------------------------------------
// The rule's constants, checked for their count.
inline const std::vector<double>& rule_constants(const Pass2Call& c, size_t n, const char* names) {
  TORCH_CHECK(c.constants.size() == n, c.op, ": takes ", n, " constants (", names, "), got ", c.constants.size());
  return c.constants;
}

inline at::Device check_pass2(const char* op, const Pass2Call& p) {
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

// Launch geometry and device pointers of one pass-2 launch; sr_step is the device step when bf16 state
// is rounded stochastically, else nullptr.
template <typename Rule, typename GT, typename PT, typename MP, bool kParamOut, typename T0, typename T1>
void launch_pass2(const Pass2Call& p, const typename Rule::Args& a, const int64_t* sr_step) {
  const unsigned grid = static_cast<unsigned>(p.chunks.size(0));
  const float* fi = p.found_inf.has_value() ? p.found_inf->template data_ptr<float>() : nullptr;
  pass2_kernel<Rule, GT, PT, MP, kParamOut, T0, T1><<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      p.ptrs.template data_ptr<int64_t>(), p.chunks.template data_ptr<int64_t>(), p.lr_wd.template data_ptr<double>(),
      static_cast<int>(p.lr_wd.size(0)), p.grad_scale.template data_ptr<float>(), fi, sr_step, a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
struct Tag {
  using type = T;
};

// Calls f(Tag<GT>{}) for a float dtype code (grad and param_out codes).
template <typename F>
void with_float_code(const char* op, const char* what, int64_t code, F&& f) {
  switch (code) {
    case kCodeF32:
      f(Tag<F32>{});
      break;
    case kCodeBF16:
      f(Tag<BF16>{});
      break;
    case kCodeF16:
      f(Tag<F16>{});
      break;
    default:
      TORCH_CHECK(false, op, ": unknown ", what, " dtype code ", code, " (0 float32, 1 bfloat16, 2 float16)");
  }
}

// Calls f(Tag<PT>{}, bool_constant<kParamOut>{}) for a param_out code (-1: none). A remainder master
// only ever gets bf16 (the launcher checked).
template <typename MP, typename F>
void with_param_code(const char* op, int64_t param_code, F&& f) {
  if constexpr (MP::kReadsParam) {
    TORCH_CHECK(param_code == kCodeBF16, op, ": an int16 remainder master needs a bfloat16 param_out (code 1), got code ",
                param_code);
    f(Tag<BF16>{}, std::true_type{});
  } else if (param_code == kCodeNone) {
    f(Tag<F32>{}, std::false_type{});
  } else {
    with_float_code(op, "param_out", param_code, [&](auto pt) { f(pt, std::true_type{}); });
  }
}

// Rules with fp32 master and fp32 state only (SGD, Lion): launches Rule's pass 2 for the plan's grad /
// param_out dtype codes (device guard and checks done by run_rule).
template <typename Rule>
void run_pass2_fp32(const char* op, const Pass2Call& p, const typename Rule::Args& a) {
  with_float_code(op, "grad", p.grad_code, [&](auto gt) {
    with_param_code<MasterF32>(op, p.param_code, [&](auto pt, auto has_po) {
      using GT = typename decltype(gt)::type;
      using PT = typename decltype(pt)::type;
      launch_pass2<Rule, GT, PT, MasterF32, decltype(has_po)::value, F32, F32>(p, a, nullptr);
    });
  });
}

// The state-slot pairs the precision-aware kernels are instantiated for (state0 code, state1 code);
// ops/cuda.py runs the reference for any other pair.
inline bool supported_state_pair(int64_t s0, int64_t s1) {
  return (s0 == kCodeF32 && s1 == kCodeF32) || (s0 == kCodeBF16 && s1 == kCodeBF16) ||
         (s0 == kCodeF16 && s1 == kCodeF16) || (s0 == kCodeBF16 && s1 == kCodeF32);
}

// Precision-aware pass 2 for one master storage MP (device guard and code checks done by run_rule):
// dispatches grad, param_out and the (supported) state pair, then launches. A rule may instantiate it
// in separate files, one per master storage, so that the build compiles them in parallel (AdamW does).
template <typename Rule, typename MP>
void run_pass2_master(const char* op, const Pass2Call& p, const typename Rule::Args& a, const int64_t* sr_step) {
  const int64_t s0_code = p.state0_code, s1_code = p.state1_code;
  with_float_code(op, "grad", p.grad_code, [&](auto gt) {
    with_param_code<MP>(op, p.param_code, [&](auto pt, auto has_po) {
      using GT = typename decltype(gt)::type;
      using PT = typename decltype(pt)::type;
      constexpr bool kPO = decltype(has_po)::value;
      if (s0_code == kCodeF32 && s1_code == kCodeF32) {
        launch_pass2<Rule, GT, PT, MP, kPO, F32, F32>(p, a, sr_step);
      } else if (s0_code == kCodeBF16 && s1_code == kCodeBF16) {
        launch_pass2<Rule, GT, PT, MP, kPO, BF16, BF16>(p, a, sr_step);
      } else if (s0_code == kCodeF16 && s1_code == kCodeF16) {
        launch_pass2<Rule, GT, PT, MP, kPO, F16, F16>(p, a, sr_step);
      } else if (s0_code == kCodeBF16 && s1_code == kCodeF32) {
        launch_pass2<Rule, GT, PT, MP, kPO, BF16, F32>(p, a, sr_step);
      } else {
        TORCH_CHECK(false, op, ": no kernel for state dtype codes (", s0_code, ", ", s1_code, ")");
      }
    });
  });
}

// The dtype codes alone (no tensor needed): checked first, so the messages are the same on any device.
inline void check_precision_aware_codes(const Pass2Call& c) {
  const auto is_float_code = [](int64_t code) { return code == kCodeF32 || code == kCodeBF16 || code == kCodeF16; };
  TORCH_CHECK(is_float_code(c.grad_code), c.op, ": unknown grad dtype code ", c.grad_code,
              " (0 float32, 1 bfloat16, 2 float16)");
  TORCH_CHECK(c.param_code == kCodeNone || is_float_code(c.param_code), c.op, ": unknown param_out dtype code ",
              c.param_code, " (-1 none, 0 float32, 1 bfloat16, 2 float16)");
  TORCH_CHECK(c.master_code == kCodeF32 || c.master_code == kCodeF16 || c.master_code == kCodeRem, c.op,
              ": unknown master storage code ", c.master_code,
              " (0 float32, 2 float16, 3 int16 remainder of a bfloat16 param)");
  TORCH_CHECK(c.master_code != kCodeRem || c.param_code == kCodeBF16, c.op,
              ": an int16 remainder master needs a bfloat16 param_out (code 1), got param_out code ", c.param_code);
  TORCH_CHECK(is_float_code(c.state0_code) && is_float_code(c.state1_code), c.op, ": unknown state dtype codes (",
              c.state0_code, ", ", c.state1_code, "): two states, each 0 float32, 1 bfloat16 or 2 float16");
  TORCH_CHECK(supported_state_pair(c.state0_code, c.state1_code), c.op, ": no kernel for state dtype codes (",
              c.state0_code, ", ", c.state1_code, "); the kernels take (state0, state1) = (0, 0), (1, 1), (2, 2) or "
              "(1, 0) (the rule's op runs the reference for other pairs)");
}

inline void check_fp32_codes(const Pass2Call& c) {
  TORCH_CHECK(c.master_code == kCodeF32 && (c.state0_code == kCodeF32 || c.state0_code == kCodeNone) &&
                  (c.state1_code == kCodeF32 || c.state1_code == kCodeNone),
              c.op, ": takes float32 master and state only (master code ", c.master_code, ", state codes ",
              c.state0_code, ", ", c.state1_code, ")");
}

// Dispatches the master storage. A rule that instantiates run_pass2_master<Rule, MP> in another file
// declares it there as extern template before registering (rules/adamw.cu).
template <typename Rule>
void run_pass2_precision_aware(const Pass2Call& c, const typename Rule::Args& a) {
  // Stochastic rounding applies to bf16 slots only; on fp32 / fp16 slots the flag changes nothing.
  const int64_t* sr_step = c.stochastic ? c.step->template data_ptr<int64_t>() : nullptr;
  switch (c.master_code) {
    case kCodeF32:
      run_pass2_master<Rule, MasterF32>(c.op, c, a, sr_step);
      break;
    case kCodeF16:
      run_pass2_master<Rule, MasterF16>(c.op, c, a, sr_step);
      break;
    default:  // kCodeRem (checked)
      run_pass2_master<Rule, MasterRem>(c.op, c, a, sr_step);
      break;
  }
}

// The launcher of an elementwise rule (what MEGATRON_OPT_REGISTER_RULE registers): code checks,
// argument checks, the rule's constants, the launch.
template <typename Rule>
void run_rule(const Pass2Call& c) {
  if constexpr (Rule::kPrecisionAware) {
    check_precision_aware_codes(c);
  } else {
    check_fp32_codes(c);
  }
  const at::Device device = check_pass2(c.op, c);
  TORCH_CHECK(!c.stochastic || Rule::kPrecisionAware, c.op, ": stochastic rounding needs a precision-aware rule");
  TORCH_CHECK(!c.stochastic || c.step.has_value(), c.op, ": stochastic rounding hashes the step: pass step");
  const typename Rule::Args a = Rule::make_args(c, device);
  if (c.chunks.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(device);
  if constexpr (Rule::kPrecisionAware) {
    run_pass2_precision_aware<Rule>(c, a);
  } else {
    run_pass2_fp32<Rule>(c.op, c, a);
  }
}

}  // namespace megatron_opt

// Registers the generic launcher of the elementwise rule RULE (the Rule interface above) as OP.
#define MEGATRON_OPT_REGISTER_RULE(OP, RULE) MEGATRON_OPT_REGISTER_PASS2(OP, &::megatron_opt::run_rule<RULE>)
