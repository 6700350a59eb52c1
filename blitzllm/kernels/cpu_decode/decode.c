/* The glue of a CPU decode layer around its matmuls (kernels/cpu_decode/ops.py builds and
   loads this file; runner/cpu_graph.py calls it): the residual add + RMSNorm, and one call for
   q / k RMSNorm, rotary, the paged KV-cache write and attention over the cache rows; fp32, and
   a bf16 form of each around torch's bf16 GEMMs. Each is a
   handful of torch ops of a few microseconds' work on a decode row but 10-30 us of dispatch
   each; here one call. Plain C vectorized by the compiler, AVX-512 intrinsics in the bf16 forms. */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* res[b] = x[b] + res[b] (in place); out[b] = rmsnorm(res[b]) * w */
void blitz_add_rms_norm(const float* x, float* res, const float* w, float* out, int B, int H, float eps) {
  for (int b = 0; b < B; b++) {
    float* r = res + (size_t)b * H;
    const float* xb = x + (size_t)b * H;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < H; i++) {
      r[i] += xb[i];
      ss += r[i] * r[i];
    }
    const float inv = 1.0f / sqrtf(ss / H + eps);
    float* o = out + (size_t)b * H;
    for (int i = 0; i < H; i++) o[i] = w[i] * (r[i] * inv);
  }
}

static void head_rms_norm(float* v, const float* w, int D, float eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int i = 0; i < D; i++) ss += v[i] * v[i];
  const float inv = 1.0f / sqrtf(ss / D + eps);
  for (int i = 0; i < D; i++) v[i] = w[i] * (v[i] * inv);
}

/* rotate-half rotary; sin carries the sign of its first half (layers/rotary.py's tables) */
static void rope(float* v, const float* cos, const float* sin, int D) {
  float t[1024];
  const int half = D / 2;
  for (int i = 0; i < D; i++) t[i] = v[i] * cos[i] + v[(i + half) % D] * sin[i];
  for (int i = 0; i < D; i++) v[i] = t[i];
}

/* qkv [B, (Hq + 2 Hkv) D] (modified in place: normed and rotated q and k); k_cache / v_cache
   [rows, Hkv, D]: row slots[b] gets the new k / v, then row b attends to cache rows
   gidx[b, 0 .. lens[b]) (its own new row included); out [B, Hq D]. */
int blitz_decode_attention(float* qkv, const float* q_norm, const float* k_norm, float qk_eps,
                           const float* cos, const float* sin, float* k_cache, float* v_cache,
                           const int64_t* slots, const int64_t* gidx, const int64_t* lens, int L, int B, int Hq,
                           int Hkv, int D, float scale, float* out, float* scratch, int nthreads) {
  if (D > 1024 || D % 2) return 1;
  const int W = (Hq + 2 * Hkv) * D;
  for (int b = 0; b < B; b++) {
    float* row = qkv + (size_t)b * W;
    for (int h = 0; h < Hq + Hkv; h++) {
      float* v = row + (size_t)h * D;
      if (q_norm) head_rms_norm(v, h < Hq ? q_norm : k_norm, D, qk_eps);
      rope(v, cos + (size_t)b * D, sin + (size_t)b * D, D);
    }
    for (int h = 0; h < Hkv; h++)
      for (int i = 0; i < D; i++) {
        k_cache[((size_t)slots[b] * Hkv + h) * D + i] = row[(size_t)(Hq + h) * D + i];
        v_cache[((size_t)slots[b] * Hkv + h) * D + i] = row[(size_t)(Hq + Hkv + h) * D + i];
      }
  }
  const int group = Hq / Hkv;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int bh = 0; bh < B * Hq; bh++) {
    const int b = bh / Hq, h = bh % Hq, kvh = h / group, n = (int)lens[b];
    const float* q = qkv + (size_t)b * W + (size_t)h * D;
    float* p = scratch + (size_t)bh * L;
    float mx = -INFINITY;
    for (int l = 0; l < n; l++) {
      const float* k = k_cache + ((size_t)gidx[(size_t)b * L + l] * Hkv + kvh) * D;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int i = 0; i < D; i++) s += q[i] * k[i];
      p[l] = s * scale;
      if (p[l] > mx) mx = p[l];
    }
    float sum = 0.0f;
    for (int l = 0; l < n; l++) {
      p[l] = expf(p[l] - mx);
      sum += p[l];
    }
    float* o = out + (size_t)b * Hq * D + (size_t)h * D;
    for (int i = 0; i < D; i++) o[i] = 0.0f;
    for (int l = 0; l < n; l++) {
      const float* v = v_cache + ((size_t)gidx[(size_t)b * L + l] * Hkv + kvh) * D;
      const float pl = p[l] / sum;
      for (int i = 0; i < D; i++) o[i] += pl * v[i];
    }
  }
  return 0;
}

/* ---- the bf16 glue: the model's bf16 roundings around torch's bf16 GEMMs ------------------- */
/* Under --dtype bfloat16 a step's matmuls stay torch's (the CPU's bf16 / AMX units); these take
   and give bf16 tensors and round where the model's bf16 forward rounds (kernels/norm's
   reference_rms_norm: the normed values, then the weight's product; rotary in fp32, rounded),
   computing in fp32 between. */
static inline float bf(uint16_t h) {
  union { uint32_t u; float f; } c = {(uint32_t)h << 16};
  return c.f;
}

static inline uint16_t to_bf(float f) { /* round to nearest even; NaN stays NaN */
  union { float f; uint32_t u; } c = {f};
  if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40);
  return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

static inline float rbf(float f) { return bf(to_bf(f)); }

/* 16 bf16 values widened to fp32 (exactly: the bf16 bits are an fp32's upper half) */
static inline __m512 load_bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

/* q . k over D (a multiple of 16), q fp32, k bf16 */
static inline float dot_bf16(const float* q, const uint16_t* k, int D) {
  __m512 acc = _mm512_setzero_ps();
  for (int i = 0; i < D; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load_bf16x16(k + i), acc);
  return _mm512_reduce_add_ps(acc);
}

/* o += p v over D (a multiple of 16), v bf16 */
static inline void axpy_bf16(float* o, float p, const uint16_t* v, int D) {
  const __m512 pv = _mm512_set1_ps(p);
  for (int i = 0; i < D; i += 16)
    _mm512_storeu_ps(o + i, _mm512_fmadd_ps(pv, load_bf16x16(v + i), _mm512_loadu_ps(o + i)));
}

/* fp32 -> bf16 bits in the low half of each lane: round to nearest even, NaN kept quiet */
static inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
}

static inline __m512 round_bf16x16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }

static inline void store_bf16x16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(bf16_bits(v)));
}

/* r[b] = bf16(x[b] + res[b]) (r: res_out, which may be res); out[b] = bf16(w * bf16(rmsnorm(r[b]))) */
void blitz_add_rms_norm_bf16(const uint16_t* x, const uint16_t* res, uint16_t* res_out, const uint16_t* w,
                             uint16_t* out, int B, int H, float eps) {
  const int H16 = H - H % 16;
#pragma omp parallel for schedule(static) if (B >= 64)
  for (int b = 0; b < B; b++) {
    const uint16_t* ri = res + (size_t)b * H;
    uint16_t* r = res_out + (size_t)b * H;
    const uint16_t* xb = x + (size_t)b * H;
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < H16; i += 16) {
      const __m512 v = round_bf16x16(_mm512_add_ps(load_bf16x16(ri + i), load_bf16x16(xb + i)));
      store_bf16x16(r + i, v);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    float ss = _mm512_reduce_add_ps(acc);
    for (int i = H16; i < H; i++) {
      r[i] = to_bf(bf(ri[i]) + bf(xb[i]));
      ss += bf(r[i]) * bf(r[i]);
    }
    const float inv = 1.0f / sqrtf(ss / H + eps);
    const __m512 vinv = _mm512_set1_ps(inv);
    uint16_t* o = out + (size_t)b * H;
    for (int i = 0; i < H16; i += 16)
      store_bf16x16(o + i, _mm512_mul_ps(load_bf16x16(w + i), round_bf16x16(_mm512_mul_ps(load_bf16x16(r + i), vinv))));
    for (int i = H16; i < H; i++) o[i] = to_bf(bf(w[i]) * rbf(bf(r[i]) * inv));
  }
}

/* blitz_decode_attention on bf16 tensors: qkv [B, (Hq + 2 Hkv) D], the caches [rows, Hkv, D]
   and out [B, Hq D] bf16; norms bf16; cos / sin fp32. q / k normed (rounded as the norm above),
   rotated in fp32 and rounded; scores, softmax and the weighted sum of values in fp32. */
int blitz_decode_attention_bf16(uint16_t* qkv, const uint16_t* q_norm, const uint16_t* k_norm, float qk_eps,
                                const float* cos, const float* sin, uint16_t* k_cache, uint16_t* v_cache,
                                const int64_t* slots, const int64_t* gidx, const int64_t* lens, int L, int B, int Hq,
                                int Hkv, int D, float scale, uint16_t* out, float* scratch, int nthreads) {
  if (D > 1024 || D % 16) return 1;
  const int W = (Hq + 2 * Hkv) * D, half = D / 2;
  float* qf = scratch; /* [B, Hq, D]: the rotated queries, as fp32 */
  float* p_all = scratch + (size_t)B * Hq * D;
  for (int b = 0; b < B; b++) {
    uint16_t* row = qkv + (size_t)b * W;
    const float *c = cos + (size_t)b * D, *s = sin + (size_t)b * D;
    for (int h = 0; h < Hq + Hkv; h++) {
      uint16_t* v = row + (size_t)h * D;
      float t[1024], r[1024];
      for (int i = 0; i < D; i++) t[i] = bf(v[i]);
      if (q_norm) {
        const uint16_t* w = h < Hq ? q_norm : k_norm;
        float ss = 0.0f;
        for (int i = 0; i < D; i++) ss += t[i] * t[i];
        const float inv = 1.0f / sqrtf(ss / D + qk_eps);
        for (int i = 0; i < D; i++) t[i] = rbf(bf(w[i]) * rbf(t[i] * inv));
      }
      for (int i = 0; i < D; i++) r[i] = rbf(t[i] * c[i] + t[(i + half) % D] * s[i]);
      if (h < Hq)
        for (int i = 0; i < D; i++) qf[((size_t)b * Hq + h) * D + i] = r[i];
      else
        for (int i = 0; i < D; i++) k_cache[((size_t)slots[b] * Hkv + (h - Hq)) * D + i] = to_bf(r[i]);
    }
    for (int h = 0; h < Hkv; h++)
      for (int i = 0; i < D; i++)
        v_cache[((size_t)slots[b] * Hkv + h) * D + i] = row[(size_t)(Hq + Hkv + h) * D + i];
  }
  const int group = Hq / Hkv;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int bh = 0; bh < B * Hq; bh++) {
    const int b = bh / Hq, h = bh % Hq, kvh = h / group, n = (int)lens[b];
    const float* q = qf + (size_t)bh * D;
    float* p = p_all + (size_t)bh * L;
    float mx = -INFINITY;
    for (int l = 0; l < n; l++) {
      p[l] = dot_bf16(q, k_cache + ((size_t)gidx[(size_t)b * L + l] * Hkv + kvh) * D, D) * scale;
      if (p[l] > mx) mx = p[l];
    }
    float sum = 0.0f;
    for (int l = 0; l < n; l++) {
      p[l] = expf(p[l] - mx);
      sum += p[l];
    }
    float o[1024];
    for (int i = 0; i < D; i++) o[i] = 0.0f;
    for (int l = 0; l < n; l++)
      axpy_bf16(o, p[l] / sum, v_cache + ((size_t)gidx[(size_t)b * L + l] * Hkv + kvh) * D, D);
    uint16_t* ob = out + (size_t)b * Hq * D + (size_t)h * D;
    for (int i = 0; i < D; i++) ob[i] = to_bf(o[i]);
  }
  return 0;
}

/* ---- a whole decode step of a dense pre-norm decoder, one call ---------------------------- */

/* one linear: our qgemm.c's kernels (passed in: the two libraries build apart) */
typedef int (*q4_gemm_fn)(const float*, const void*, const void*, const void*, float*, int, int, int, int);
typedef int (*q8_gemm_fn)(const float*, const void*, const void*, float*, int, int, int, int);
typedef int (*dense_gemm_fn)(const float*, const void*, float*, int, int, int, int, int);

enum { Q4 = 0, Q8 = 1, BF16 = 2, F32 = 3 };
typedef struct {
  const void* codes; /* or a dense weight [N, K] (BF16, F32) */
  const void* d;
  const void* m;
  int N, K, kind;
} Linear;

typedef struct {
  const float *ln1, *ln2, *qkv_bias, *q_norm, *k_norm;
  Linear qkv, o, gate_up, down;
  float *k_cache, *v_cache;
} Layer;

typedef struct {
  int hq, hkv, d, inter, nthreads;
  float eps, qk_eps, scale;
  q4_gemm_fn q4;
  q8_gemm_fn q8;
  dense_gemm_fn dense;
} Dims;

static int linear(const Dims* dm, const Linear* l, const float* x, float* y, int B) {
  if (l->kind >= BF16) return dm->dense(x, l->codes, y, B, l->N, l->K, l->kind == F32, dm->nthreads);
  return l->kind == Q4 ? dm->q4(x, l->codes, l->d, l->m, y, B, l->N, l->K, dm->nthreads)
                       : dm->q8(x, l->codes, l->d, y, B, l->N, l->K, dm->nthreads);
}

/* x, res [B, H]: the last layer's output and the residual stream (updated in place; the caller
   adds x and applies the final norm). scratch: at least B * (2 H + W + 2 I + Hq L) floats, W the
   qkv width, I the intermediate size. */
int blitz_decode_layers(const Layer* layers, int n_layers, const Dims* dm, float* x, float* res, int B, int H,
                        const float* cos, const float* sin, const int64_t* slots, const int64_t* gidx,
                        const int64_t* lens, int L, float* scratch) {
  const int W = (dm->hq + 2 * dm->hkv) * dm->d, I = dm->inter;
  float *h = scratch, *qkv = h + (size_t)B * H, *o = qkv + (size_t)B * W, *gu = o + (size_t)B * H,
        *att = gu + (size_t)B * 2 * I;
  int rc = 0;
  for (int li = 0; li < n_layers && !rc; li++) {
    const Layer* ly = &layers[li];
    blitz_add_rms_norm(x, res, ly->ln1, h, B, H, dm->eps);
    rc |= linear(dm, &ly->qkv, h, qkv, B);
    if (ly->qkv_bias)
      for (int b = 0; b < B; b++)
        for (int i = 0; i < W; i++) qkv[(size_t)b * W + i] += ly->qkv_bias[i];
    rc |= blitz_decode_attention(qkv, ly->q_norm, ly->k_norm, dm->qk_eps, cos, sin, ly->k_cache, ly->v_cache, slots,
                                 gidx, lens, L, B, dm->hq, dm->hkv, dm->d, dm->scale, o, att, dm->nthreads);
    rc |= linear(dm, &ly->o, o, x, B);
    blitz_add_rms_norm(x, res, ly->ln2, h, B, H, dm->eps);
    rc |= linear(dm, &ly->gate_up, h, gu, B);
    for (int b = 0; b < B; b++) { /* silu(gate) * up, into gate's half */
      float* g = gu + (size_t)b * 2 * I;
      for (int i = 0; i < I; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * g[I + i];
    }
    /* the down projection reads rows of 2 I floats: its first I columns */
    for (int b = 0; b < B; b++)
      if (b) for (int i = 0; i < I; i++) gu[(size_t)b * I + i] = gu[(size_t)b * 2 * I + i];
    rc |= linear(dm, &ly->down, gu, x, B);
  }
  return rc;
}

/* ---- a batch-1 bf16 decode step, one call (--dtype bfloat16) ------------------------------- */

/* kernels/cpu_gemm's blitz_gemv_bf16 (passed in: it builds with AVX512-BF16, apart) */
typedef void (*gemv_bf16_fn)(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int, int, int);

typedef struct {
  const uint16_t *ln1, *ln2, *qkv_bias, *q_norm, *k_norm;
  const uint16_t *qkv, *o, *gate_up, *down; /* weights [N, K] */
  uint16_t *k_cache, *v_cache;
} LayerBf16;

/* The layer-by-layer bf16 form (runner/cpu_graph.py _run_bf16) for one row without Python between
   the ops, rounding where it rounds: x, res [H] bf16 (the last layer's output and the residual
   stream, in place); buf: at least H + W + Hq D + 3 I bf16; scratch: Hq (L + D) floats. */
int blitz_decode_layers_bf16(const LayerBf16* layers, int n_layers, const Dims* dm, const void* gemv_fn,
                             uint16_t* x, uint16_t* res, int H, const float* cos, const float* sin,
                             const int64_t* slots, const int64_t* gidx, const int64_t* lens, int L, uint16_t* buf,
                             float* scratch) {
  const gemv_bf16_fn gemv = (gemv_bf16_fn)gemv_fn;
  const int hq = dm->hq, HD = hq * dm->d, W = (hq + 2 * dm->hkv) * dm->d, I = dm->inter, nt = dm->nthreads;
  uint16_t *h = buf, *qkv = h + H, *o = qkv + W, *gu = o + HD, *a = gu + 2 * I;
  int rc = 0;
  for (int li = 0; li < n_layers && !rc; li++) {
    const LayerBf16* ly = &layers[li];
    blitz_add_rms_norm_bf16(x, res, res, ly->ln1, h, 1, H, dm->eps);
    gemv(h, ly->qkv, ly->qkv_bias, qkv, W, H, nt);
    rc |= blitz_decode_attention_bf16(qkv, ly->q_norm, ly->k_norm, dm->qk_eps, cos, sin, ly->k_cache, ly->v_cache,
                                      slots, gidx, lens, L, 1, hq, dm->hkv, dm->d, dm->scale, o, scratch, nt);
    gemv(o, ly->o, 0, x, H, HD, nt);
    blitz_add_rms_norm_bf16(x, res, res, ly->ln2, h, 1, H, dm->eps);
    gemv(h, ly->gate_up, 0, gu, 2 * I, H, nt);
    for (int i = 0; i < I; i++) { /* silu(gate) rounded, times up rounded: F.silu(g) * u in bf16 */
      const float g = bf(gu[i]);
      a[i] = to_bf(rbf(g / (1.0f + expf(-g))) * bf(gu[I + i]));
    }
    gemv(a, ly->down, 0, x, H, I, nt);
  }
  return rc;
}
