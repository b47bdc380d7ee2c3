// Precision-aware optimizer state, per element (the spec: megatron_opt/ops/precision.py).
//
// Master storages (a policy type, a template parameter of the pass-2 kernel):
//   MasterF32  the fp32 master itself (param_out, if any, = the master rounded to nearest even);
//   MasterF16  an fp16 master, widened for the update and rounded to nearest even on store;
//              param_out = the stored fp16 value rounded to the param dtype (as a later copy from
//              the master gives);
//   MasterRem  Megatron-LM's store_param_remainders: the int16 remainder of a bf16 param. The fp32
//              master is joined from (param bits, remainder) and split back after the update:
//                join:  high = p - (r < 0),  u = high << 16 | (r & 0xffff)        (uint32, wrapping)
//                split: r = u & 0xffff,       p = (u >> 16) + (int16(r) < 0)      (mod 2^16)
//              exactly the integer recipe of precision.py: join(split(u)) == u for every u.
// State slots (F32 / BF16 / F16 traits of common.cuh): widened exactly, updated in fp32, rounded once
// on store: nearest even, or, for bf16 slots when asked, stochastically:
//   bits(x) + hash16(i, step, slot), truncated to the high half (finite x only; inf and NaN round
//   to nearest as torch's .to(bfloat16) does).
// hash16 = lowbias32(i * 0x9E3779B1 + step * 0x85EBCA77 + slot * 0xC2B2AE3D) & 0xffff, all in wrapping
// uint32 arithmetic (identical to the reference's int64 arithmetic masked to 32 bits); i is the element
// index in the shard tensor, step the update's 1-based step (device int64, cast to uint32), slot 0 for
// exp_avg and 1 for exp_avg_sq.
#pragma once

#include "common.cuh"

#include <type_traits>

namespace megatron_opt {

// ---------------------------------------------------------------------------------------------
// Master storage policies
// ---------------------------------------------------------------------------------------------
struct MasterF32 {
  using S = float;
  static constexpr bool kReadsParam = false;  // the update needs param_out's old value as input
  template <typename PS>
  static __device__ __forceinline__ float load(S m, PS) {
    return m;
  }
  template <typename PT, bool kParamOut>
  static __device__ __forceinline__ void store(float w, S& m, typename PT::S& p) {
    m = w;
    if constexpr (kParamOut) p = PT::from_float(w);
  }
};

struct MasterF16 {
  using S = uint16_t;
  static constexpr bool kReadsParam = false;
  template <typename PS>
  static __device__ __forceinline__ float load(S m, PS) {
    return F16::to_float(m);
  }
  template <typename PT, bool kParamOut>
  static __device__ __forceinline__ void store(float w, S& m, typename PT::S& p) {
    m = F16::from_float(w);
    if constexpr (kParamOut) {
      if constexpr (std::is_same_v<PT, F16>) {
        p = m;
      } else {
        p = PT::from_float(F16::to_float(m));  // fp16 -> fp32 is exact, then one rounding
      }
    }
  }
};

struct MasterRem {
  using S = uint16_t;  // the int16 remainder's bits
  static constexpr bool kReadsParam = true;
  static __device__ __forceinline__ float join(uint16_t param, uint16_t rem) {
    const uint32_t high = static_cast<uint32_t>(param) - ((rem & 0x8000u) ? 1u : 0u);
    return __uint_as_float((high << 16) | static_cast<uint32_t>(rem));
  }
  static __device__ __forceinline__ void split(float w, uint16_t& param, uint16_t& rem) {
    const uint32_t u = __float_as_uint(w);
    rem = static_cast<uint16_t>(u & 0xffffu);
    param = static_cast<uint16_t>((u >> 16) + ((u & 0x8000u) ? 1u : 0u));  // mod 2^16 by the cast
  }
  template <typename PS>
  static __device__ __forceinline__ float load(S m, PS p) {
    return join(p, m);
  }
  template <typename PT, bool kParamOut>
  static __device__ __forceinline__ void store(float w, S& m, typename PT::S& p) {
    static_assert(std::is_same_v<PT, BF16> && kParamOut, "a remainder master needs a bf16 param_out");
    split(w, p, m);
  }
};

// ---------------------------------------------------------------------------------------------
// Stochastic rounding of bf16 state
// ---------------------------------------------------------------------------------------------
constexpr uint32_t kHashIndex = 0x9E3779B1u, kHashStep = 0x85EBCA77u, kHashSlot = 0xC2B2AE3Du;

// Per launch: whether to round bf16 slots stochastically, and step * kHashStep + slot * kHashSlot.
struct StochasticArgs {
  bool on;
  uint32_t base0, base1;
};

__device__ __forceinline__ StochasticArgs stochastic_args(const int64_t* step) {
  StochasticArgs s;
  s.on = step != nullptr;
  const uint32_t t = s.on ? static_cast<uint32_t>(static_cast<uint64_t>(*step)) : 0u;
  s.base0 = t * kHashStep;
  s.base1 = s.base0 + kHashSlot;
  return s;
}

// lowbias32 of (index * kHashIndex + base), low 16 bits
__device__ __forceinline__ uint32_t hash16(int64_t index, uint32_t base) {
  uint32_t x = static_cast<uint32_t>(static_cast<uint64_t>(index)) * kHashIndex + base;
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x & 0xffffu;
}

__device__ __forceinline__ uint16_t bf16_round_stochastic(float x, uint32_t r16) {
  if (!is_finite_f(x)) return BF16::from_float(x);
  return static_cast<uint16_t>((__float_as_uint(x) + r16) >> 16);  // no wrap: finite bits < 0xff800000
}

// fp32 value -> state slot storage: itself, nearest even, or stochastic (bf16 slots only).
template <typename T>
__device__ __forceinline__ typename T::S store_state(float x, bool stochastic, uint32_t base, int64_t index) {
  if constexpr (std::is_same_v<T, BF16>) {
    if (stochastic) return bf16_round_stochastic(x, hash16(index, base));
  }
  return T::from_float(x);
}

}  // namespace megatron_opt
