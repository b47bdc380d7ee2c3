// Host-only check of the work partition used by every kernel in csrc/ (no GPU needed).
//
// It runs the real helpers from common.cuh (plan_partition, block_range_of,
// first_piece_ending_after, split_range) and replays, on the CPU, the same loop skeleton the
// kernels use (blocks -> pieces -> scalar head / vector body with UNROLL / scalar tail, for every
// thread id), then checks that every piece element is visited exactly once, that no padding or
// out-of-span element is visited, and that every vector access starts on a vector boundary.
//
// Not part of the extension (setup.py only globs csrc/*.cu). Build and run from the repo root
// (about 40 s to build, 1 s to run; no GPU needed):
//   PY=/work/venv/bin/python
//   /usr/local/cuda/bin/nvcc -std=c++20 -O2 --expt-relaxed-constexpr -I csrc \
//     $($PY -c "import torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths()))") \
//     -I$($PY -c "import nvidia, os; print(os.path.join(nvidia.__path__[0], 'cu13', 'include'))") \
//     csrc/tests/check_partition.cu -o /tmp/check_partition && /tmp/check_partition
#include "common.cuh"

#include <cstdio>
#include <random>
#include <vector>

using namespace megatron_opt;

namespace {

struct Table {
  std::vector<int64_t> bounds;  // [npiece, 2]
  int64_t numel = 0;
  int64_t npiece() const { return static_cast<int64_t>(bounds.size() / 2); }
};

int g_failures = 0;

void fail(const char* what, int64_t x, int64_t y) {
  if (g_failures < 20) std::printf("FAIL: %s (%lld, %lld)\n", what, static_cast<long long>(x), static_cast<long long>(y));
  ++g_failures;
}

Table random_table(std::mt19937_64& rng, int64_t numel_max) {
  Table t;
  std::uniform_int_distribution<int64_t> len(1, std::max<int64_t>(1, numel_max / 4));
  std::uniform_int_distribution<int> coin(0, 3);
  std::uniform_int_distribution<int64_t> gap(1, 70);
  int64_t pos = coin(rng) == 0 ? gap(rng) : 0;
  const int64_t target = std::uniform_int_distribution<int64_t>(1, numel_max)(rng);
  while (pos < target) {
    const int64_t e = std::min<int64_t>(target, pos + (coin(rng) == 0 ? std::uniform_int_distribution<int64_t>(1, 9)(rng) : len(rng)));
    t.bounds.push_back(pos);
    t.bounds.push_back(e);
    pos = e + (coin(rng) == 0 ? 0 : gap(rng));
  }
  t.numel = pos + (coin(rng) == 0 ? gap(rng) : 0);
  if (t.bounds.empty()) {
    t.bounds = {0, 1};
    t.numel = 1;
  }
  // merge touching pieces is not required: pieces may touch (no gap).
  return t;
}

// kind 0: piece walk (grad_stats, adamw, sgd); kind 1: flat span (copy_grads_to_main).
template <int VEC, int UNROLL>
void replay(const Table& t, int kind, int phase, int64_t max_grid, int64_t min_per_block) {
  const int64_t A = t.bounds.front(), B = t.bounds.back();
  const LaunchPlan p = plan_partition(A, B, phase, VEC, max_grid, min_per_block);
  if (p.grid < 1 || p.grid > max_grid) fail("grid out of range", p.grid, max_grid);
  if (p.vec_ok && (p.aligned_base + p.phase) % VEC != 0) fail("aligned_base not on a vector boundary", p.aligned_base, p.phase);
  if (static_cast<int64_t>(p.grid) * p.chunk < B - p.aligned_base) fail("blocks do not cover the span", p.grid, p.chunk);

  std::vector<int> hits(static_cast<size_t>(t.numel), 0);
  auto touch = [&](int64_t i) {
    if (i < 0 || i >= t.numel) {
      fail("index outside the shard", i, t.numel);
      return;
    }
    ++hits[static_cast<size_t>(i)];
  };
  auto piece = [&](int64_t a, int64_t e) {
    if (!p.vec_ok) {
      for (int tid = 0; tid < kThreads; ++tid)
        for (int64_t i = a + tid; i < e; i += kThreads) touch(i);
      return;
    }
    const Split sp = split_range<VEC>(a, e, p.phase);
    if (sp.head_end < a || sp.head_end > e || sp.head_end - a >= VEC) fail("bad head", a, sp.head_end);
    if (sp.body_end > e || e - sp.body_end >= VEC) fail("bad tail", sp.body_end, e);
    if (sp.nvec < 0) fail("negative nvec", a, e);
    for (int tid = 0; tid < kThreads; ++tid) {
      if (static_cast<int64_t>(tid) < sp.head_end - a) touch(a + tid);
      if (static_cast<int64_t>(tid) < e - sp.body_end) touch(sp.body_end + tid);
      for (int64_t base = 0; base < sp.nvec; base += static_cast<int64_t>(kThreads) * UNROLL) {
        for (int u = 0; u < UNROLL; ++u) {
          const int64_t v = base + static_cast<int64_t>(u) * kThreads + tid;
          if (v < sp.nvec) {
            const int64_t i0 = sp.head_end + v * VEC;
            if ((i0 + p.phase) % VEC != 0) fail("misaligned vector", i0, p.phase);
            for (int j = 0; j < VEC; ++j) touch(i0 + j);
          }
        }
      }
    }
  };
  for (int64_t b = 0; b < p.grid; ++b) {
    const BlockRange r = block_range_of(b, A, B, p.aligned_base, p.chunk);
    if (r.lo >= r.hi) continue;
    if (p.vec_ok && r.lo != A && (r.lo + p.phase) % VEC != 0) fail("block start not on a vector boundary", r.lo, b);
    if (kind == 1) {
      piece(r.lo, r.hi);
      continue;
    }
    for (int64_t s = first_piece_ending_after(t.bounds.data(), t.npiece(), r.lo); s < t.npiece(); ++s) {
      const int64_t ss = t.bounds[2 * s];
      if (ss >= r.hi) break;
      piece(std::max(ss, r.lo), std::min(t.bounds[2 * s + 1], r.hi));
    }
  }
  // expected coverage
  std::vector<int> want(static_cast<size_t>(t.numel), 0);
  if (kind == 1) {
    for (int64_t i = A; i < B; ++i) want[static_cast<size_t>(i)] = 1;
  } else {
    for (int64_t s = 0; s < t.npiece(); ++s)
      for (int64_t i = t.bounds[2 * s]; i < t.bounds[2 * s + 1]; ++i) want[static_cast<size_t>(i)] = 1;
  }
  for (int64_t i = 0; i < t.numel; ++i)
    if (hits[static_cast<size_t>(i)] != want[static_cast<size_t>(i)]) fail("element visited wrong number of times", i, hits[static_cast<size_t>(i)]);
}

// Large (> 2^31) spans: check the block/piece/split level with interval arithmetic only.
template <int VEC>
void replay_large(std::mt19937_64& rng) {
  Table t;
  int64_t pos = std::uniform_int_distribution<int64_t>(0, 100)(rng);
  for (int k = 0; k < 7; ++k) {
    const int64_t len = std::uniform_int_distribution<int64_t>(1, int64_t(1) << 31)(rng);
    t.bounds.push_back(pos);
    t.bounds.push_back(pos + len);
    pos += len + std::uniform_int_distribution<int64_t>(0, 200)(rng);
  }
  t.numel = pos;
  const int phase = std::uniform_int_distribution<int>(0, VEC - 1)(rng);
  const LaunchPlan p = plan_partition(t.bounds.front(), t.bounds.back(), phase, VEC, 132 * 8, int64_t(kThreads) * VEC * 4);
  int64_t covered = 0, expect = 0, prev_end = -1;
  for (int64_t s = 0; s < t.npiece(); ++s) expect += t.bounds[2 * s + 1] - t.bounds[2 * s];
  for (int64_t b = 0; b < p.grid; ++b) {
    const BlockRange r = block_range_of(b, t.bounds.front(), t.bounds.back(), p.aligned_base, p.chunk);
    if (r.lo >= r.hi) continue;
    for (int64_t s = first_piece_ending_after(t.bounds.data(), t.npiece(), r.lo); s < t.npiece(); ++s) {
      const int64_t ss = t.bounds[2 * s];
      if (ss >= r.hi) break;
      const int64_t a = std::max(ss, r.lo), e = std::min(t.bounds[2 * s + 1], r.hi);
      if (a <= prev_end - 1) fail("large: pieces overlap", a, prev_end);
      prev_end = e;
      const Split sp = split_range<VEC>(a, e, p.phase);
      if ((sp.head_end + phase) % VEC != 0 && sp.nvec > 0) fail("large: misaligned body", sp.head_end, phase);
      covered += (sp.head_end - a) + sp.nvec * VEC + (e - sp.body_end);
    }
  }
  if (covered != expect) fail("large: coverage mismatch", covered, expect);
}

}  // namespace

int main() {
  std::mt19937_64 rng(12345);
  int cases = 0;
  for (int it = 0; it < 3000; ++it) {
    const int64_t numel_max = (it % 10 == 0) ? 70000 : (it % 3 == 0 ? 40 : 3000);
    const Table t = random_table(rng, numel_max);
    const int64_t max_grid = std::uniform_int_distribution<int64_t>(1, 40)(rng);
    const int64_t mpb = std::uniform_int_distribution<int64_t>(1, 4096)(rng);
    for (int kind = 0; kind < 2; ++kind) {
      const int ph8 = std::uniform_int_distribution<int>(-1, 7)(rng);
      const int ph4 = std::uniform_int_distribution<int>(-1, 3)(rng);
      replay<8, 4>(t, kind, ph8, max_grid, mpb);  // grad_stats, 16-bit grads
      replay<4, 4>(t, kind, ph4, max_grid, mpb);  // grad_stats, fp32 grads
      replay<8, 1>(t, kind, ph8, max_grid, mpb);  // adamw / sgd, 16-bit grads
      replay<4, 1>(t, kind, ph4, max_grid, mpb);  // adamw / sgd, fp32 grads
      replay<8, 2>(t, kind, ph8, max_grid, mpb);  // copy, 16-bit grads
      cases += 5;
    }
  }
  for (int it = 0; it < 200; ++it) {
    replay_large<8>(rng);
    replay_large<4>(rng);
    cases += 2;
  }
  std::printf("%d partition cases, %d failures\n", cases, g_failures);
  return g_failures == 0 ? 0 : 1;
}
