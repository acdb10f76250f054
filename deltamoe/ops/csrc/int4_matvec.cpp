// One-row INT4 (W4A16) matmuls that read torch's CPU int4 operand where it lies.
//
// torch's `_convert_weight_to_int4pack_for_cpu` stores a weight [N, K] in blocks of B output
// rows, each block K-major: for every input position k, B/2 bytes, byte j holding the unsigned
// code (q + 8) of row j in its low nibble and of row j + B/2 in its high nibble. Its scales
// sit beside zeros as bf16 pairs [K/g, N, 2]. `ops/int4_experts.py` (`kernel_codes`) is the
// readable form of that layout, and `ops/int4_matvec.py` holds the reference this is tested
// against.
//
// Why a kernel of our own: at one row, torch's kernel spends its time unpacking nibbles, not
// reading bytes. Here a 4-byte word of a block row holds 8 codes (rows 4d..4d+3 and
// 4d+B/2..4d+3+B/2); broadcast to 8 lanes, one variable shift and one mask give all 8 codes,
// converted and multiplied with x[k] in 3 more instructions. The code offset leaves the loop:
// per group, sum_k x_k s (u_k - 8) = s (sum_k x_k u_k - 8 sum_k x_k).
//
// The expert form reads a stack of such operands (one per expert) through strides, so a
// decode step's k experts are read where they lie: no gathered copy.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DELTAMOE_INT4_AVX2 1
#endif

namespace {

struct Layout {
  int64_t rows;            // valid output rows (N; the operand may hold more, padded)
  int64_t block;           // B: output rows per block
  int64_t group;           // input positions per scale
  int64_t k;               // input width
  int64_t w_expert;        // bytes between experts' operands
  int64_t w_block;         // bytes between blocks of one operand
  int64_t s_expert;        // bf16 elements between experts' scales
  int64_t s_group;         // bf16 elements between groups
  int64_t s_row;           // bf16 elements between rows
};

inline float bf16_at(const c10::BFloat16* p) { return static_cast<float>(*p); }

// The scale of `row` in group `g` of expert `e`.
inline float scale_of(const c10::BFloat16* s, const Layout& L, int64_t e, int64_t g, int64_t row) {
  return bf16_at(s + e * L.s_expert + g * L.s_group + row * L.s_row);
}

// Lane l of word d holds row 4d + l/2 (+ B/2 when l is odd).
inline int64_t lane_row(int64_t d, int64_t lane, int64_t block) {
  return 4 * d + lane / 2 + (lane % 2) * (block / 2);
}

// Plain C++: the same arithmetic in the same order of groups (tests compare both builds'
// paths with the reference).
void block_scalar(const float* x, const float* xsum, const uint8_t* w, const c10::BFloat16* s, const Layout& L,
                  int64_t e, int64_t b, float* out) {
  const int64_t half = L.block / 2, groups = L.k / L.group;
  std::vector<float> tot(L.block, 0.f), acc(L.block);
  for (int64_t g = 0; g < groups; ++g) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t kk = g * L.group; kk < (g + 1) * L.group; ++kk) {
      const uint8_t* p = w + kk * half;
      for (int64_t j = 0; j < half; ++j) {
        acc[j] += float(p[j] & 15) * x[kk];
        acc[j + half] += float(p[j] >> 4) * x[kk];
      }
    }
    for (int64_t r = 0; r < L.block; ++r)
      tot[r] += scale_of(s, L, e, g, b * L.block + r) * (acc[r] - 8.f * xsum[g]);
  }
  std::memcpy(out, tot.data(), L.block * sizeof(float));
}

#ifdef DELTAMOE_INT4_AVX2
// NW words (8 rows each) per input position: B = 8 NW. Two input positions per iteration,
// each with its own accumulators, so the FMA chains overlap.
template <int NW>
void block_avx2(const float* x, const float* xsum, const uint8_t* w, const c10::BFloat16* s, const Layout& L,
                int64_t e, int64_t b, float* out) {
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i mask = _mm256_set1_epi32(15);
  const int64_t groups = L.k / L.group, stride = 4 * NW;  // bytes per input position
  __m256 tot[NW];
  for (int d = 0; d < NW; ++d) tot[d] = _mm256_setzero_ps();
  alignas(32) float sc[8];
  for (int64_t g = 0; g < groups; ++g) {
    __m256 acc0[NW], acc1[NW];
    for (int d = 0; d < NW; ++d) acc0[d] = acc1[d] = _mm256_setzero_ps();
    const int64_t k0 = g * L.group;
    const uint8_t* p = w + k0 * stride;
    for (int64_t kk = 0; kk < L.group; kk += 2, p += 2 * stride) {
      const __m256 xa = _mm256_broadcast_ss(x + k0 + kk), xb = _mm256_broadcast_ss(x + k0 + kk + 1);
      for (int d = 0; d < NW; ++d) {
        int32_t wa, wb;
        std::memcpy(&wa, p + 4 * d, 4);
        std::memcpy(&wb, p + stride + 4 * d, 4);
        const __m256i ca = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(wa), shifts), mask);
        const __m256i cb = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(wb), shifts), mask);
        acc0[d] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ca), xa, acc0[d]);
        acc1[d] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(cb), xb, acc1[d]);
      }
    }
    const __m256 offset = _mm256_set1_ps(8.f * xsum[g]);
    for (int d = 0; d < NW; ++d) {
      for (int l = 0; l < 8; ++l) sc[l] = scale_of(s, L, e, g, b * L.block + lane_row(d, l, L.block));
      const __m256 a = _mm256_sub_ps(_mm256_add_ps(acc0[d], acc1[d]), offset);
      tot[d] = _mm256_fmadd_ps(a, _mm256_load_ps(sc), tot[d]);
    }
  }
  alignas(32) float lanes[8];
  for (int d = 0; d < NW; ++d) {
    _mm256_store_ps(lanes, tot[d]);
    for (int l = 0; l < 8; ++l) out[lane_row(d, l, L.block)] = lanes[l];
  }
}
#endif

using BlockFn = void (*)(const float*, const float*, const uint8_t*, const c10::BFloat16*, const Layout&, int64_t,
                         int64_t, float*);

BlockFn pick(int64_t block, bool vector) {
#ifdef DELTAMOE_INT4_AVX2
  if (vector && block == 32) return block_avx2<4>;
  if (vector && block == 64) return block_avx2<8>;
#endif
  (void)vector;
  return block_scalar;
}

void check(bool ok, const std::string& what) { TORCH_CHECK(ok, "deltamoe::int4_matvec: ", what); }

// x [R or 1, K] (fp32 or bf16; one row is shared by all R selections), w u8 (a stack of
// operands, read through w_strides = {expert, block} in bytes), s bf16 (read through
// s_strides = {expert, group, row} in elements), experts int64 [R] -> fp32 [R, rows].
at::Tensor int4_matvec(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, const at::Tensor& experts,
                       int64_t rows, int64_t block, int64_t group, at::IntArrayRef w_strides,
                       at::IntArrayRef s_strides, bool vector) {
  check(x.dim() == 2, "x: expected [R, K], got " + std::to_string(x.dim()) + " dims");
  check(w.scalar_type() == at::kByte && w.is_contiguous(), "w: expected a contiguous uint8 tensor");
  check(s.scalar_type() == at::kBFloat16 && s.is_contiguous(), "s: expected a contiguous bfloat16 tensor");
  check(experts.scalar_type() == at::kLong && experts.dim() == 1, "experts: expected int64 [R]");
  check(w_strides.size() == 2 && s_strides.size() == 3, "strides: expected 2 for w and 3 for s");
  check(block % 16 == 0 && block > 0, "block: expected a positive multiple of 16");
  const int64_t k = x.size(1), r_out = experts.size(0);
  check(group > 0 && k % group == 0 && group % 2 == 0, "group: expected an even divisor of K");
  check(x.size(0) == 1 || x.size(0) == r_out, "x: expected 1 row or one per expert selection");
  const Layout L{rows, block, group, k, w_strides[0], w_strides[1], s_strides[0], s_strides[1], s_strides[2]};
  const int64_t nblocks = (rows + block - 1) / block, groups = k / group;
  // Bounds: the last byte and scale any selection reads must lie inside w and s.
  const auto ids = experts.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  int64_t max_e = 0;
  for (int64_t r = 0; r < r_out; ++r) {
    check(id[r] >= 0, "experts: negative index");
    max_e = std::max(max_e, id[r]);
  }
  check(max_e * L.w_expert + (nblocks - 1) * L.w_block + k * block / 2 <= w.numel(), "w: too small for its strides");
  check(max_e * L.s_expert + (groups - 1) * L.s_group + (nblocks * block - 1) * L.s_row < s.numel(),
        "s: too small for its strides");

  // x as fp32 in a buffer this thread keeps (no tensor allocated per call: a decode step makes
  // ~100 of these calls), with its group sums.
  const int64_t x_rows = x.size(0);
  thread_local std::vector<float> xbuf, xsum;
  xbuf.resize(x_rows * k);
  xsum.resize(x_rows * groups);
  const auto xc = x.contiguous();
  if (xc.scalar_type() == at::kFloat) {
    std::memcpy(xbuf.data(), xc.data_ptr<float>(), x_rows * k * sizeof(float));
  } else if (xc.scalar_type() == at::kBFloat16) {
    const c10::BFloat16* xb = xc.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < x_rows * k; ++i) xbuf[i] = static_cast<float>(xb[i]);
  } else {
    check(false, "x: expected float32 or bfloat16");
  }
  const float* xp = xbuf.data();
  for (int64_t r = 0; r < x_rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float t = 0.f;
      for (int64_t i = 0; i < group; ++i) t += xp[r * k + g * group + i];
      xsum[r * groups + g] = t;
    }
  auto y = at::empty({r_out, rows}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const c10::BFloat16* sp = s.data_ptr<c10::BFloat16>();
  const BlockFn fn = pick(block, vector);
  // Threads only for calls with work enough to pay a parallel region's start (~tens of us of
  // codes per chunk): most of a small model's calls are one thread's work.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / (block * k));
  at::parallel_for(0, r_out * nblocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> tail(block);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / nblocks, b = i % nblocks, xr = x_rows == 1 ? 0 : r;
      const uint8_t* wb = wp + id[r] * L.w_expert + b * L.w_block;
      float* out = yp + r * rows + b * block;
      const bool whole = (b + 1) * block <= rows;
      fn(xp + xr * k, xsum.data() + xr * groups, wb, sp, L, id[r], b, whole ? out : tail.data());
      if (!whole) std::memcpy(out, tail.data(), (rows - b * block) * sizeof(float));
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(deltamoe_int4, m) {
  m.def("matvec(Tensor x, Tensor w, Tensor s, Tensor experts, int rows, int block, int group, int[] w_strides, "
        "int[] s_strides, bool vector) -> Tensor");
}

TORCH_LIBRARY_IMPL(deltamoe_int4, CPU, m) { m.impl("matvec", &int4_matvec); }
