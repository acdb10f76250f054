// Chunked KDA forward for inference on the CPU, one fused pass per (batch, head).
//
// The same steps as `chunk_kda` in ops/kda.py (read its notes first: the factorised scores, the
// UT transform, the state pass), in the same order of operations, but each (batch, head) walks
// its chunks start to end with every intermediate in a few per-thread buffers (L1/L2 resident),
// instead of torch ops over whole groups of chunks, whose tensors leave the cache between ops.
// Threads split the (batch, head) pairs (`at::parallel_for`; one pair runs on one thread); every
// product is one call of oneDNN's batch-reduce gemm micro-kernel through torch's
// `at::native::cpublas::brgemm` (which falls back to torch's gemm where oneDNN has none): it packs
// nothing, where a BLAS sgemm call packs both operands of these small products every time.
//
// Per chunk of n tokens (C at most), with H_i = g_1 + ... + g_i, r = H_{n-1} / 2, e_i = H_i - r:
//   qh = scale q e^{e}, kh = k e^{e}, kf = k e^{-e}            (q, k l2-normalised if asked)
//   M = tril([qh kf^T]),  L = tril_{-1}(kh kf^T) Diag(beta)    (one gemm for both)
//   Tb = (I + L)^-1 Diag(beta)                                 (forward substitution)
//   u = Tb v,  w = (Tb kh) e^{g_0 + r},  qd = qh e^{g_0 + r},  kd = kf e^{r}
//   [w; qd] S -> delta = u - w S,  o = qd S + M delta,  S = S e^{g_0 + 2r} + kd^T delta
// All in fp32. The contract is `chunk_kda`'s: only the order of fp32 sums differs.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>
#include <math.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

// The vector variants of expf from glibc's libmvec (linked with -lmvec): the loops below marked
// `omp simd` call 16 (AVX-512) or 8 (AVX2) exps at a time instead of one.
#pragma omp declare simd notinbranch
extern "C" float expf(float);

namespace {

// Row-major C[m, n] (+)= A[m, k] B[k, n] through oneDNN's batch-reduce gemm micro-kernel.
void gemm_nn(int m, int n, int k, const float* a, int lda, const float* b, int ldb, bool accumulate, float* c,
             int ldc) {
  if (m == 0 || n == 0) return;
  at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, accumulate, a, b, c, false);
}

// Per-thread working memory for one (batch, head): chunk-sized tiles, row-major.
struct Tiles {
  std::vector<float> q_k;       // [2C, K]: rows 0..n-1 qh, n..2n-1 kh
  std::vector<float> kf;        // [K, C]: kf^T, then kd^T in place
  std::vector<float> exponent;  // [C, K]: e_i
  std::vector<float> scores;    // [2C, C]: rows 0..n-1 M, n..2n-1 L
  std::vector<float> solve;     // [C, C]: Tb
  std::vector<float> u;         // [C, V]: u, then delta in place
  std::vector<float> w_qd;      // [2C, K]: rows 0..n-1 w, n..2n-1 qd
  std::vector<float> products;  // [2C, V]: [w; qd] S
  std::vector<float> factors;   // [4, K]: e^{g_0 + r}, e^{r}, e^{g_0 + 2r}, r
  std::vector<float> row;       // [K]
  Tiles(int C, int K, int V)
      : q_k(2 * C * K), kf(C * K), exponent(C * K), scores(2 * C * C), solve(C * C), u(C * V), w_qd(2 * C * K),
        products(2 * C * V), factors(4 * K), row(K) {}
};

struct Shapes {
  int64_t B, T, H, K, V;
};

// x * factor (l2-normalised first if asked) into `out`, one row of K.
inline void scaled_row(const float* x, float* out, int K, float factor, bool l2norm, float eps) {
  float f = factor;
  if (l2norm) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int d = 0; d < K; ++d) sum += x[d] * x[d];
    f = factor / sqrtf(sum + eps);
  }
#pragma omp simd
  for (int d = 0; d < K; ++d) out[d] = x[d] * f;
}

// The rows of the next chunk's tokens [t, t + rows) of pair (b, h), fetched while this chunk
// computes. In the [B, T, H, *] layout a head's consecutive tokens are H rows apart (4 KiB at H = 8,
// K = 128): every row is in a page of its own, where the hardware prefetchers do not follow, so
// without this each chunk would wait on memory for its q, k, v, g rows and its output rows.
struct NextRows {
  const float *q, *k, *v, *g;
  float* out;
  int64_t first, count, row_k, row_v, head_rows;  // first row (in head rows), tokens, strides
  void fetch(int64_t lo, int64_t hi) const {  // tokens [lo, hi) of the count
    for (int64_t i = lo; i < std::min(hi, count); ++i) {
      const int64_t rk = (first + i * head_rows) * row_k, rv = (first + i * head_rows) * row_v;
      for (int64_t c = 0; c < row_k; c += 16) {
        __builtin_prefetch(q + rk + c, 0, 2);
        __builtin_prefetch(k + rk + c, 0, 2);
        __builtin_prefetch(g + rk + c, 0, 2);
      }
      for (int64_t c = 0; c < row_v; c += 16) {
        __builtin_prefetch(v + rv + c, 0, 2);
        __builtin_prefetch(out + rv + c, 1, 2);
      }
    }
  }
};

#ifdef __AVX512F__
// row -= sum_{m<i} l_row[m] solve[m] over NB vectors of 16, the row held in registers, in two
// running sums (even and odd m) so that consecutive updates do not wait on each other's FMA.
template <int NB>
inline void substitute_row(float* row, const float* solve, int ld, const float* l_row, int i) {
  __m512 even[NB], odd[NB];
  for (int x = 0; x < NB; ++x) {
    even[x] = _mm512_loadu_ps(row + 16 * x);
    odd[x] = _mm512_setzero_ps();
  }
  int m = 0;
  for (; m + 1 < i; m += 2) {
    const __m512 f0 = _mm512_set1_ps(l_row[m]), f1 = _mm512_set1_ps(l_row[m + 1]);
    const float* s0 = solve + static_cast<int64_t>(m) * ld;
    const float* s1 = s0 + ld;
    for (int x = 0; x < NB; ++x) {
      even[x] = _mm512_fnmadd_ps(f0, _mm512_loadu_ps(s0 + 16 * x), even[x]);
      odd[x] = _mm512_fnmadd_ps(f1, _mm512_loadu_ps(s1 + 16 * x), odd[x]);
    }
  }
  if (m < i) {
    const __m512 f0 = _mm512_set1_ps(l_row[m]);
    const float* s0 = solve + static_cast<int64_t>(m) * ld;
    for (int x = 0; x < NB; ++x) even[x] = _mm512_fnmadd_ps(f0, _mm512_loadu_ps(s0 + 16 * x), even[x]);
  }
  for (int x = 0; x < NB; ++x) _mm512_storeu_ps(row + 16 * x, _mm512_add_ps(even[x], odd[x]));
}
#endif

// dst = a + b over one row of n. dst is an output row the kernel never reads back, written with
// streaming stores where AVX-512 and its alignment allow: no read of the line before the write,
// and the output (as large as v) does not evict the inputs the next chunks read. (The caller
// ends with a store fence.)
inline void store_sum(float* dst, const float* a, const float* b, int n) {
  int d = 0;
#ifdef __AVX512F__
  if (reinterpret_cast<uintptr_t>(dst) % 64 == 0) {
    for (; d + 16 <= n; d += 16) {
      _mm512_stream_ps(dst + d, _mm512_add_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d)));
    }
  }
#endif
  for (; d < n; ++d) dst[d] = a[d] + b[d];
}

// One chunk of n tokens starting at token t0 of pair (b, h); its `state` [K, V] is updated in place.
void chunk_step(const float* q, const float* k, const float* v, const float* g, const float* beta, float* out,
                float* state, const Shapes& s, int64_t b, int64_t h, int64_t t0, int n, int C, float scale,
                bool l2norm, float eps, Tiles& t, const NextRows& next) {
  const int K = static_cast<int>(s.K), V = static_cast<int>(s.V);
  const int64_t row_k = s.H * s.K, row_v = s.H * s.V;  // strides of one token in [B, T, H, *]
  const int64_t first = (b * s.T + t0) * s.H + h;       // the chunk's first row (in units of a head row)
  float* qh = t.q_k.data();
  float* kh = t.q_k.data() + static_cast<int64_t>(n) * K;
  float* kf = t.kf.data();
  float* e = t.exponent.data();
  float* start = t.factors.data();      // e^{g_0 + r}
  float* to_end = start + K;            // e^{r}
  float* decay = start + 2 * K;         // e^{g_0 + 2r}
  float* half = start + 3 * K;          // r

  // Normalised rows and running decay sums H_i (H_0 = 0: g_0 never enters a difference).
  for (int i = 0; i < n; ++i) {
    scaled_row(q + (first + i * s.H) * K, qh + i * K, K, scale, l2norm, eps);
    scaled_row(k + (first + i * s.H) * K, kh + i * K, K, 1.0f, l2norm, eps);
    const float* gi = g + (first + i * s.H) * K;
    float* ei = e + i * K;
    if (i == 0) {
      std::fill(ei, ei + K, 0.0f);
    } else {
      const float* prev = ei - K;
#pragma omp simd
      for (int d = 0; d < K; ++d) ei[d] = prev[d] + gi[d];
    }
  }
  const float* g0 = g + first * K;
  const float* last = e + (n - 1) * K;
#pragma omp simd
  for (int d = 0; d < K; ++d) {
    half[d] = 0.5f * last[d];
    start[d] = expf(g0[d] + half[d]);
    to_end[d] = expf(half[d]);
    decay[d] = expf(g0[d] + 2.0f * half[d]);
  }
  // e_i = H_i - r; kf = k e^{-e}, then qh, kh times e^{e} (both factors within e^{+-span/2}).
  float* kf_row = t.row.data();
  for (int i = 0; i < n; ++i) {
    float* ei = e + i * K;
    float* qi = qh + i * K;
    float* ki = kh + i * K;
    float* down = kf_row;  // e^{-e} of row i, then kf^T column i
#pragma omp simd
    for (int d = 0; d < K; ++d) {
      const float x = ei[d] - half[d];
      const float up = expf(x);
      down[d] = ki[d] * expf(-x);
      qi[d] *= up;
      ki[d] *= up;
    }
    for (int d = 0; d < K; ++d) kf[d * C + i] = down[d];
  }

  // [qh; kh] kf^T -> M (lower with the diagonal), L (strictly lower, rows times beta).
  float* scores = t.scores.data();
  gemm_nn(2 * n, n, K, qh, K, kf, C, false, scores, C);
  const int64_t quarter = (next.count + 3) / 4;
  next.fetch(0, quarter);
  const float* beta_row = beta + first;  // beta [B, T, H]: token i of the pair at first + i H
  for (int i = 0; i < n; ++i) {
    float* m_row = scores + i * C;
    std::fill(m_row + i + 1, m_row + n, 0.0f);
    float* l_row = scores + (n + i) * C;
    const float bi = beta_row[i * s.H];
    for (int j = 0; j < i; ++j) l_row[j] *= bi;
  }
  // Tb = (I + L)^-1 Diag(beta): row i of the inverse is e_i - sum_{m<i} L[i, m] row m. Rows are
  // zero past their diagonal, so each update runs over whole vectors of 16 (zeros included).
  float* solve = t.solve.data();
  for (int i = 0; i < n; ++i) {
    float* row = solve + i * C;
    const int width = std::min(C, (i + 16) & ~15);  // covers columns 0..i
    std::fill(row, row + C, 0.0f);
    row[i] = 1.0f;
    const float* l_row = scores + (n + i) * C;
#ifdef __AVX512F__
    if (C % 16 == 0) {
      switch (width / 16) {
        case 1: substitute_row<1>(row, solve, C, l_row, i); continue;
        case 2: substitute_row<2>(row, solve, C, l_row, i); continue;
        case 3: substitute_row<3>(row, solve, C, l_row, i); continue;
        case 4: substitute_row<4>(row, solve, C, l_row, i); continue;
        default: break;
      }
    }
#endif
    for (int m = 0; m < i; ++m) {
      const float f = l_row[m];
      const float* src = solve + m * C;
#pragma omp simd
      for (int j = 0; j < width; ++j) row[j] -= f * src[j];
    }
  }
  for (int i = 0; i < n; ++i) {
    float* row = solve + i * C;
    for (int j = 0; j <= i; ++j) row[j] *= beta_row[j * s.H];
  }

  // u = Tb v (v read in place), w = (Tb kh) e^{g_0 + r}, qd = qh e^{g_0 + r}, kd = kf e^{r}.
  float* u = t.u.data();
  float* w = t.w_qd.data();
  float* qd = w + static_cast<int64_t>(n) * K;
  gemm_nn(n, V, n, solve, C, v + first * V, static_cast<int>(row_v), false, u, V);
  gemm_nn(n, K, n, solve, C, kh, K, false, w, K);
  next.fetch(quarter, 2 * quarter);
  for (int i = 0; i < n; ++i) {
    float* wi = w + i * K;
    float* di = qd + i * K;
    const float* qi = qh + i * K;
#pragma omp simd
    for (int d = 0; d < K; ++d) {
      wi[d] *= start[d];
      di[d] = qi[d] * start[d];
    }
  }
  for (int d = 0; d < K; ++d) {
    float* fd = kf + d * C;
    const float f = to_end[d];
#pragma omp simd
    for (int i = 0; i < n; ++i) fd[i] *= f;
  }

  // The state pass: [w; qd] S; delta = u - w S; o = qd S + M delta; S = S e^{g_0 + 2r} + kd^T delta.
  float* products = t.products.data();
  gemm_nn(2 * n, V, K, w, K, state, V, false, products, V);
  next.fetch(2 * quarter, 3 * quarter);
  for (int i = 0; i < n; ++i) {
    float* ui = u + i * V;
    const float* ws = products + i * V;
#pragma omp simd
    for (int d = 0; d < V; ++d) ui[d] -= ws[d];
  }
  // M delta into the rows w S held; o = qd S + M delta goes out once, past the cache.
  gemm_nn(n, V, n, scores, C, u, V, false, products, V);
  float* o = out + first * V;
  for (int i = 0; i < n; ++i) {
    store_sum(o + i * row_v, products + (n + i) * V, products + i * V, V);
  }
  next.fetch(3 * quarter, next.count);
  for (int d = 0; d < K; ++d) {
    float* sd = state + static_cast<int64_t>(d) * V;
    const float f = decay[d];
#pragma omp simd
    for (int j = 0; j < V; ++j) sd[j] *= f;
  }
  gemm_nn(K, V, n, kf, C, u, V, true, state, V);
}

// q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H] fp32 contiguous; state [B*H, K, V] fp32
// contiguous, read as the state entering token 0 and overwritten with the state after the last.
// `segments`: (first token, end token, chunk length) triples covering [0, T) in order, each run
// cut into chunks of its own length (`chunk_kda`'s groups, each with its `_pick_chunk_size`).
// Returns o [B, T, H, V] fp32.
at::Tensor chunk_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& g, const at::Tensor& beta, at::Tensor state,
                            at::IntArrayRef segments, double scale, bool l2norm, double eps) {
  for (const at::Tensor* x : {&q, &k, &v, &g, &beta, const_cast<const at::Tensor*>(&state)}) {
    TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == at::kFloat && x->is_contiguous(),
                "kda chunk kernel: expected contiguous fp32 CPU tensors");
  }
  TORCH_CHECK(q.dim() == 4 && v.dim() == 4 && beta.dim() == 3, "kda chunk kernel: expected q [B, T, H, K]");
  const Shapes s{q.size(0), q.size(1), q.size(2), q.size(3), v.size(3)};
  TORCH_CHECK(k.sizes() == q.sizes() && g.sizes() == q.sizes(), "kda chunk kernel: k, g must match q");
  TORCH_CHECK(v.size(0) == s.B && v.size(1) == s.T && v.size(2) == s.H, "kda chunk kernel: v [B, T, H, V]");
  TORCH_CHECK(beta.size(0) == s.B && beta.size(1) == s.T && beta.size(2) == s.H, "kda chunk kernel: beta [B, T, H]");
  TORCH_CHECK(state.numel() == s.B * s.H * s.K * s.V, "kda chunk kernel: state [B*H, K, V]");
  TORCH_CHECK(segments.size() % 3 == 0, "kda chunk kernel: segments are (start, end, chunk) triples");
  int64_t covered = 0, longest = 1;
  for (size_t i = 0; i < segments.size(); i += 3) {
    TORCH_CHECK(segments[i] == covered && segments[i + 1] > segments[i] && segments[i + 1] <= s.T,
                "kda chunk kernel: segments must cover [0, T) in order");
    TORCH_CHECK(segments[i + 2] >= 1 && segments[i + 2] <= 256, "kda chunk kernel: chunk length in [1, 256]");
    covered = segments[i + 1];
    longest = std::max(longest, segments[i + 2]);
  }
  TORCH_CHECK(covered == s.T, "kda chunk kernel: segments must end at T");
  auto out = at::empty({s.B, s.T, s.H, s.V}, v.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* sp = state.data_ptr<float>();
  const std::vector<int64_t> runs(segments.begin(), segments.end());
  // A thread takes a run of consecutive pairs (heads of one sequence, mostly) and walks them
  // chunk-major: the rows of one token for its heads lie side by side in memory, so one chunk of
  // all its heads reads whole pages, where one head at a time would read 1 / H of every page.
  // Each pair's state is updated in place in `state`.
  at::parallel_for(0, s.B * s.H, 1, [&](int64_t begin, int64_t end) {
    Tiles tiles(static_cast<int>(longest), static_cast<int>(s.K), static_cast<int>(s.V));
    for (size_t r = 0; r < runs.size(); r += 3) {
      const int64_t run_end = runs[r + 1], C = runs[r + 2];
      for (int64_t t0 = runs[r]; t0 < run_end; t0 += C) {
        const int n = static_cast<int>(std::min<int64_t>(C, run_end - t0));
        for (int64_t pair = begin; pair < end; ++pair) {
          const int64_t b = pair / s.H, h = pair % s.H;
          // The next step: the next pair's same tokens, else the first pair's next chunk (at most
          // `longest` tokens).
          const bool last_pair = pair + 1 == end;
          const int64_t next_pair = last_pair ? begin : pair + 1, next_t = last_pair ? t0 + n : t0;
          const NextRows next{qp, kp, vp, gp, op, (next_pair / s.H * s.T + next_t) * s.H + next_pair % s.H,
                              std::max<int64_t>(0, std::min(longest, s.T - next_t)), s.K, s.V, s.H};
          chunk_step(qp, kp, vp, gp, bp, op, sp + pair * s.K * s.V, s, b, h, t0, n, static_cast<int>(longest),
                     static_cast<float>(scale), l2norm, static_cast<float>(eps), tiles, next);
        }
      }
    }
    _mm_sfence();  // the streaming stores of the output are visible before the call returns
    at::native::cpublas::brgemm_release(false);  // (a no-op unless a micro-kernel configured AMX tiles)
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(deltamoe_kda, m) {
  m.def("chunk_forward(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, int[] segments, "
        "float scale, bool l2norm, float eps) -> Tensor");
  m.impl("chunk_forward", c10::DispatchKey::CPU, &chunk_forward);
}
