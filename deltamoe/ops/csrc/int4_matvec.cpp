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
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define DELTAMOE_INT4_AVX512BF16 1
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

#ifdef DELTAMOE_INT4_AVX512BF16
// Where x holds bf16 values (the W4A16 contract) and the CPU has AVX512-BF16: `vdpbf16ps` takes
// 32 bf16 products per instruction, and the codes (below) are exact in bf16, so each product is
// exact in fp32 as the fp32 path's are; only the order of the fp32 sums differs. Two input positions
// k, k+1 of a block of 64 rows are 64 adjacent bytes (32 each); one byte permute (`vpermb`)
// gives 16 32-bit lanes, lane l holding row r's byte at k (bits 0-7) and
// at k+1 (bits 16-23); a shift and one bitwise select (`vpternlogd`) per nibble then make the
// bf16 pair (16 + u_k, 16 + u_k+1): 16 + u is 2^4 (1 + u/16), i.e. bf16 bits 0x4180 | u << 3, so
// the nibble only has to land on bits 3-6 under a constant (exact codes; the offset 16 + 8 leaves
// the loop with the zero point). `vdpbf16ps` multiplies those pairs with the pair (x_k, x_k+1).
// A 32-entry `vpermw` table of bf16(u) did the same at 1.07x the time here: on the AVX-512 Xeon
// measured, `vdpbf16ps` issues once per two cycles and competes with the shuffles for ports, so
// every decode uop moved off the shuffle port shows (shift and ternlog also run on port 0).
// The AMX tile unit (`tdpbf16ps`: a [1, 32] x [32, 16] step in 16 cycles, twice these dot products'
// rate) was tried on the same CPU and dropped: a tile loads only from memory, so the decoded codes
// went through 16 stores and a tile load per 16 rows x 32 positions, and that round trip cost what
// the tile unit saved (0.89-1.10x this path on one thread, by size).
//
// Output vector v (0..3) holds rows kDotRowOf(v, 0..15): 16 consecutive rows.
constexpr int kDotRowOf(int v, int l) { return (v % 2) * 32 + (v / 2) * 16 + l; }

void block_avx512bf16(const c10::BFloat16* xb, const float* xsum, const uint8_t* w, const c10::BFloat16* s,
                      const Layout& L, int64_t e, int64_t b, float* out) {
  constexpr int kStride = 32;  // bytes per input position (64 rows)
  // Byte 4l of lane l <- byte l (+16 for the second vector) of k; byte 4l + 2 <- the same of k+1
  // (bytes 4l + 1 and 4l + 3 take any byte: the select below masks them out).
  alignas(64) static const uint8_t spread[2][64] = {
      {0, 0, 32, 0, 1, 0, 33, 0, 2, 0, 34, 0, 3, 0, 35, 0, 4, 0, 36, 0, 5, 0, 37, 0, 6, 0, 38, 0, 7, 0, 39, 0,
       8, 0, 40, 0, 9, 0, 41, 0, 10, 0, 42, 0, 11, 0, 43, 0, 12, 0, 44, 0, 13, 0, 45, 0, 14, 0, 46, 0, 15, 0, 47, 0},
      {16, 0, 48, 0, 17, 0, 49, 0, 18, 0, 50, 0, 19, 0, 51, 0, 20, 0, 52, 0, 21, 0, 53, 0, 22, 0, 54, 0, 23, 0, 55, 0,
       24, 0, 56, 0, 25, 0, 57, 0, 26, 0, 58, 0, 27, 0, 59, 0, 28, 0, 60, 0, 29, 0, 61, 0, 30, 0, 62, 0, 31, 0, 63, 0}};
  const __m512i spread0 = _mm512_load_si512(spread[0]), spread1 = _mm512_load_si512(spread[1]);
  const __m512i nibble_bits = _mm512_set1_epi32(0x00780078), code_base = _mm512_set1_epi32(0x41804180);
  constexpr int kSelect = 0xEA;  // vpternlogd: (a & b) | c
  const int64_t groups = L.k / L.group;
  __m512 tot[4];
  for (int v = 0; v < 4; ++v) tot[v] = _mm512_setzero_ps();
  alignas(64) float sc[16];
  for (int64_t g = 0; g < groups; ++g) {
    // Two accumulator sets (even and odd position pairs) so the dot-product chains overlap.
    __m512 acc0[4], acc1[4];
    for (int v = 0; v < 4; ++v) acc0[v] = acc1[v] = _mm512_setzero_ps();
    const int64_t k0 = g * L.group;
    const uint8_t* p = w + k0 * kStride;
    const c10::BFloat16* xg = xb + k0;
    auto pair = [&](int64_t kk, __m512* acc) {
      const __m512i bytes = _mm512_loadu_si512(p + kk * kStride);  // positions kk and kk+1
      const __m512i lo = _mm512_permutexvar_epi8(spread0, bytes);  // rows 0-15 (low nibbles), 32-47 (high)
      const __m512i hi = _mm512_permutexvar_epi8(spread1, bytes);  // rows 16-31, 48-63
      int32_t xk;  // the bf16 pair (x_k, x_k+1) as one 32-bit lane
      std::memcpy(&xk, xg + kk, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(xk);
      auto codes = [&](__m512i shifted) {
        return (__m512bh)_mm512_ternarylogic_epi32(shifted, nibble_bits, code_base, kSelect);
      };
      acc[0] = _mm512_dpbf16_ps(acc[0], codes(_mm512_slli_epi32(lo, 3)), xv);  // low nibble: bits 0-3 -> 3-6
      acc[1] = _mm512_dpbf16_ps(acc[1], codes(_mm512_srli_epi32(lo, 1)), xv);  // high nibble: bits 4-7 -> 3-6
      acc[2] = _mm512_dpbf16_ps(acc[2], codes(_mm512_slli_epi32(hi, 3)), xv);
      acc[3] = _mm512_dpbf16_ps(acc[3], codes(_mm512_srli_epi32(hi, 1)), xv);
    };
    int64_t kk = 0;
    for (; kk + 4 <= L.group; kk += 4) {
      pair(kk, acc0);
      pair(kk + 2, acc1);
    }
    for (; kk < L.group; kk += 2) pair(kk, acc0);
    const __m512 offset = _mm512_set1_ps(24.f * xsum[g]);  // codes 16 + u, u = q + 8
    for (int v = 0; v < 4; ++v) {
      __m512 scale;
      if (L.s_row == 2) {  // (scale, zero) bf16 pairs of consecutive rows: a pair's dword << 16 is the scale
        const c10::BFloat16* s0 = s + e * L.s_expert + g * L.s_group + (b * L.block + kDotRowOf(v, 0)) * 2;
        scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(s0), 16));  // 16 rows
      } else {
        for (int l = 0; l < 16; ++l) sc[l] = scale_of(s, L, e, g, b * L.block + kDotRowOf(v, l));
        scale = _mm512_load_ps(sc);
      }
      const __m512 a = _mm512_sub_ps(_mm512_add_ps(acc0[v], acc1[v]), offset);
      tot[v] = _mm512_fmadd_ps(a, scale, tot[v]);
    }
  }
  alignas(64) float lanes[16];
  for (int v = 0; v < 4; ++v) {
    _mm512_store_ps(lanes, tot[v]);
    for (int l = 0; l < 16; ++l) out[kDotRowOf(v, l)] = lanes[l];
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
  // bf16 x (the W4A16 contract: the model's callers pass it) takes the bf16 dot-product path
  // where it is built, read where it lies; fp32 x the fp32 path.
  const c10::BFloat16* xh = nullptr;
#ifdef DELTAMOE_INT4_AVX512BF16
  if (vector && block == 64 && xc.scalar_type() == at::kBFloat16) xh = xc.data_ptr<c10::BFloat16>();
#endif
  // A plain pointer for the worker threads: inside the lambda a thread_local name would be the
  // worker's own (empty) buffer, not this thread's.
  const float* xs = xsum.data();
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
      float* dst = whole ? out : tail.data();
#ifdef DELTAMOE_INT4_AVX512BF16
      if (xh)
        block_avx512bf16(xh + xr * k, xs + xr * groups, wb, sp, L, id[r], b, dst);
      else
#endif
        fn(xp + xr * k, xs + xr * groups, wb, sp, L, id[r], b, dst);
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
