/* The glue of a CPU decode layer around its matmuls (kernels/cpu_decode/ops.py builds and
   loads this file; runner/cpu_graph.py calls it): the residual add + RMSNorm, and one call for
   q / k RMSNorm, rotary, the paged KV-cache write and attention over the cache rows; fp32, and
   a bf16 form of each around torch's bf16 GEMMs; either form over an fp8 (e4m3) KV cache
   (kv_cache_dtype="fp8": entries rounded from the model's dtype, widened as they load). Each is a
   handful of torch ops of a few microseconds' work on a decode row but 10-30 us of dispatch
   each; here one call. Plain C vectorized by the compiler, AVX-512 intrinsics in the bf16 forms
   and the attention (one core for both forms, its sums in registers). */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* ---- bf16 <-> fp32 ------------------------------------------------------------------------ */
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

/* ---- fp8 (e4m3) KV-cache entries ---------------------------------------------------------- */
/* kernels/attention/kv_store.py's rule: clamped to +-448, rounded to nearest even (subnormals
   below 2^-6 on their 2^-9 grid); no NaN is ever stored. */
static inline uint8_t to_e4m3(float f) {
  const uint8_t sign = signbit(f) ? 0x80 : 0;
  float a = fabsf(f);
  if (!(a < 448.0f)) a = 448.0f;
  int e;
  frexpf(a, &e); /* a = m 2^e, m in [0.5, 1): its binade's exponent is e - 1 */
  const int ex = e - 1 < -6 ? -6 : e - 1;
  const float r = nearbyintf(ldexpf(a, 3 - ex)); /* the mantissa steps of the binade (2^(ex-3) each) */
  if (r == 0.0f) return sign;
  if (ex == -6 && r < 8.0f) return sign | (uint8_t)r; /* a subnormal: r 2^-9 */
  /* r in [8, 16]: 16 carries into the next binade */
  const int ex2 = r >= 16.0f ? ex + 1 : ex, m = r >= 16.0f ? 0 : (int)r - 8;
  return sign | (uint8_t)((ex2 + 7) << 3) | (uint8_t)m;
}

/* x [n] -> e4m3 codes y [n] (the rule above; kernels/cpu_decode/ops.py to_e4m3's test hook) */
void blitz_to_e4m3(const float* x, uint8_t* y, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = to_e4m3(x[i]);
}

/* 16 e4m3 values widened to fp32 exactly: each one's bits moved into an fp16 (sign, then its 7
   magnitude bits under fp16's exponent, whose bias is 8 larger: a factor 2^-8 undone after), then
   fp16 -> fp32 in hardware (which handles the subnormals) */
static inline __m512 fp8x16(__m128i b) {
  const __m512i w = _mm512_cvtepu8_epi32(b);
  const __m512i h = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x80)), 8),
                                    _mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x7f)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)), _mm512_set1_ps(256.0f));
}

/* ---- attention of one query row over its cache rows (both forms) -------------------------- */

/* the lanes of a 16-wide step with ``left`` elements to go: all 16, or the first ``left`` */
static inline __mmask16 lanes(int left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

/* the KV cache's entries: fp32, bf16 or fp8 (e4m3) */
enum { KV_F32 = 0, KV_BF16 = 1, KV_FP8 = 2 };

/* 16 elements of a cache row of ``kind`` (widened exactly), from i on; ``m`` masks a row's tail */
static inline __m512 ld16(const void* p, size_t i, int kind, __mmask16 m) {
  if (kind == KV_FP8) /* (a 512-bit masked load of the 16 bytes: AVX-512BW without VL) */
    return fp8x16(_mm512_castsi512_si128(_mm512_maskz_loadu_epi8((__mmask64)m, (const uint8_t*)p + i)));
  if (kind == KV_BF16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm512_castsi512_si256(_mm512_maskz_loadu_epi16((__mmask32)m, (const uint16_t*)p + i))), 16));
  return _mm512_maskz_loadu_ps(m, (const float*)p + i);
}

/* e^x for x <= 0, 16 lanes (softmax after its max): x = n ln2 + r with |r| <= ln2 / 2, e^r by
   its Taylor series to r^7 (relative error under 6e-9, below fp32's rounding), 2^n by vscalefps */
static inline __m512 exp_le0(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f)); /* e^-104 is 0 in fp32; keeps n finite */
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 e = _mm512_set1_ps(1.0f / 5040);
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 720));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 120));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 24));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 6));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(0.5f));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(e, n);
}

#define ND_MAX 64 /* D up to 1024 */
#define HG_MAX 4
/* out[g][0..D) = softmax(scale q_g . k_l) v_l for the HG query heads g of one kv head, over the n
   cache rows gi[0..n) (row r's head at element r * rs + off of kc / vc, of ``kind``): each key
   and value is widened once for the HG heads. q_g at q + g D (fp32), out likewise; p: HG n floats.
   Inlined with ND = ceil(D / 16) and HG constants where D is a common head size, so that the
   queries and the output's sums stay in registers (the sums run over the keys, not through
   memory); fp32 throughout. */
static inline __attribute__((always_inline)) void attend(const float* q, const void* kc, const void* vc, int kind,
                                                         const int64_t* gi, int n, size_t rs, size_t off, int D,
                                                         const int ND, const int HG, float scale, float* p,
                                                         float* out) {
  const __mmask16 tail = lanes(D % 16 ? D % 16 : 16);
#define MASK(j) ((j) < ND - 1 ? (__mmask16)0xFFFF : tail)
  __m512 qv[HG_MAX][ND_MAX], o[HG_MAX][ND_MAX], kv[ND_MAX];
  for (int g = 0; g < HG; g++)
    for (int j = 0; j < ND; j++) qv[g][j] = _mm512_maskz_loadu_ps(MASK(j), q + (size_t)g * D + 16 * j);
  for (int l = 0; l < n; l++) {
    const size_t row = (size_t)gi[l] * rs + off;
    for (int j = 0; j < ND; j++) kv[j] = ld16(kc, row + 16 * j, kind, MASK(j));
    for (int g = 0; g < HG; g++) {
      __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
      for (int j = 1; j < ND; j++) acc = _mm512_fmadd_ps(qv[g][j], kv[j], acc);
      p[(size_t)g * n + l] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
  float inv[HG_MAX];
  for (int g = 0; g < HG; g++) { /* the max, then e^(s - max) in place and their sum */
    float* pg = p + (size_t)g * n;
    __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    for (int l = 0; l < n; l += 16) {
      const __mmask16 m = lanes(n - l);
      mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, pg + l));
    }
    const __m512 vmx = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    for (int l = 0; l < n; l += 16) {
      const __mmask16 m = lanes(n - l);
      const __m512 e = exp_le0(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, pg + l), vmx));
      _mm512_mask_storeu_ps(pg + l, m, e);
      sum = _mm512_mask_add_ps(sum, m, sum, e);
    }
    inv[g] = 1.0f / _mm512_reduce_add_ps(sum);
    for (int j = 0; j < ND; j++) o[g][j] = _mm512_setzero_ps();
  }
  for (int l = 0; l < n; l++) {
    const size_t row = (size_t)gi[l] * rs + off;
    for (int j = 0; j < ND; j++) kv[j] = ld16(vc, row + 16 * j, kind, MASK(j));
    for (int g = 0; g < HG; g++) {
      const __m512 pl = _mm512_set1_ps(p[(size_t)g * n + l]);
      for (int j = 0; j < ND; j++) o[g][j] = _mm512_fmadd_ps(pl, kv[j], o[g][j]);
    }
  }
  for (int g = 0; g < HG; g++)
    for (int j = 0; j < ND; j++)
      _mm512_mask_storeu_ps(out + (size_t)g * D + 16 * j, MASK(j), _mm512_mul_ps(o[g][j], _mm512_set1_ps(inv[g])));
#undef MASK
}

/* the attention of rows [B] x heads [Hq] (GQA: head h reads kv head h / (Hq / Hkv)): q row b head h
   at q + (b * qs + h) * D, its output (fp32) at out + (b * Hq + h) * D; scratch: B Hq L floats.
   One task per HG heads of a kv head: HG the largest of 4, 3, 2 that divides the group, keeps a
   task's query vectors (and as many sums) at 12 or fewer and leaves each thread 4 tasks or more;
   else 1. */
static void attend_all(const float* q, size_t qs, const void* kc, const void* vc, int kind, const int64_t* gidx,
                       const int64_t* lens, int L, int B, int Hq, int Hkv, int D, float scale, float* out,
                       float* scratch, int nthreads) {
  const int group = Hq / Hkv, nd = (D + 15) / 16;
  int hg = 1;
  for (int c = HG_MAX; c > 1 && hg == 1; c--)
    if (group % c == 0 && c * nd <= 12 && B * Hq / c >= 4 * nthreads) hg = c;
  const int tasks = B * Hq / hg;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int t = 0; t < tasks; t++) {
    const int b = t / (Hq / hg), h = t % (Hq / hg) * hg, n = (int)lens[b];
    const float* qh = q + ((size_t)b * qs + h) * D;
    const int64_t* gi = gidx + (size_t)b * L;
    float *p = scratch + ((size_t)b * Hq + h) * L, *o = out + ((size_t)b * Hq + h) * D;
    const size_t rs = (size_t)Hkv * D, off = (size_t)(h / group) * D;
#define ATTEND(ND, HG) attend(qh, kc, vc, kind, gi, n, rs, off, D, ND, HG, scale, p, o)
    if (D == 64 && hg == 3) ATTEND(4, 3); /* the common head sizes: their vectors in registers */
    else if (D == 64 && hg == 2) ATTEND(4, 2);
    else if (D == 64) ATTEND(4, 1);
    else if (D == 128 && hg == 1) ATTEND(8, 1);
    else if (D == 32 && hg == 4) ATTEND(2, 4);
    else if (D == 32 && hg == 3) ATTEND(2, 3);
    else if (D == 32 && hg == 2) ATTEND(2, 2);
    else if (hg == 1) ATTEND(nd, 1); /* others through memory */
    else for (int g = 0; g < hg; g++) attend(qh + (size_t)g * D, kc, vc, kind, gi, n, rs, off, D, nd, 1, scale,
                                             p + (size_t)g * L, o + (size_t)g * D);
#undef ATTEND
  }
}

/* ---- greedy sampling -------------------------------------------------------------------- */
/* Each row of x [B, V] (fp32): its argmax (the first maximum, as torch.argmax) and that token's
   log-softmax, max - (max + log sum e^(x - max)) (as x[tok] - logsumexp(x)), in three passes of
   16 lanes; torch's argmax and logsumexp are two passes each plus their dispatch. Returns 1
   where a row holds a NaN (the caller then takes torch's ops, which order NaN their own way). */
int blitz_greedy(const float* x, int B, int V, int64_t* tok, float* lp) {
  for (int b = 0; b < B; b++) {
    const float* r = x + (size_t)b * V;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (int i = 0; i < V; i += 16) {
      const __mmask16 m = lanes(V - i);
      const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, r + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      mx = _mm512_max_ps(mx, v);
    }
    if (nan) return 1;
    const float top = _mm512_reduce_max_ps(mx);
    const __m512 vt = _mm512_set1_ps(top);
    int64_t t = 0;
    for (int i = 0; i < V; i += 16) {
      const __mmask16 m = lanes(V - i);
      const __mmask16 eq = _mm512_mask_cmp_ps_mask(m, _mm512_loadu_ps(r + i), vt, _CMP_EQ_OQ);
      if (eq) { t = i + __builtin_ctz(eq); break; }
    }
    __m512 sum = _mm512_setzero_ps();
    for (int i = 0; i < V; i += 16) {
      const __mmask16 m = lanes(V - i);
      sum = _mm512_mask_add_ps(sum, m, sum, exp_le0(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, r + i), vt)));
    }
    tok[b] = t;
    lp[b] = top - (top + logf(_mm512_reduce_add_ps(sum)));
  }
  return 0;
}

/* ---- the fp32 forms ----------------------------------------------------------------------- */

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
  for (int i = 0; i < half; i++) t[i] = v[i] * cos[i] + v[i + half] * sin[i];
  for (int i = half; i < D; i++) t[i] = v[i] * cos[i] + v[i - half] * sin[i];
  for (int i = 0; i < D; i++) v[i] = t[i];
}

/* qkv [B, (Hq + 2 Hkv) D] (modified in place: normed and rotated q and k); k_cache / v_cache
   [rows, Hkv, D], fp32 or (kv_fp8) e4m3: row slots[b] gets the new k / v, then row b attends to
   cache rows gidx[b, 0 .. lens[b]) (its own new row included); out [B, Hq D]. */
int blitz_decode_attention(float* qkv, const float* q_norm, const float* k_norm, float qk_eps,
                           const float* cos, const float* sin, void* k_cache, void* v_cache,
                           const int64_t* slots, const int64_t* gidx, const int64_t* lens, int L, int B, int Hq,
                           int Hkv, int D, float scale, float* out, float* scratch, int nthreads, int kv_fp8) {
  if (D > 1024 || D % 2) return 1;
  const int W = (Hq + 2 * Hkv) * D;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (B >= 4)
  for (int b = 0; b < B; b++) {
    float* row = qkv + (size_t)b * W;
    for (int h = 0; h < Hq + Hkv; h++) {
      float* v = row + (size_t)h * D;
      if (q_norm) head_rms_norm(v, h < Hq ? q_norm : k_norm, D, qk_eps);
      rope(v, cos + (size_t)b * D, sin + (size_t)b * D, D);
    }
    for (int h = 0; h < Hkv; h++)
      for (int i = 0; i < D; i++) {
        const size_t at = ((size_t)slots[b] * Hkv + h) * D + i;
        const float k = row[(size_t)(Hq + h) * D + i], v = row[(size_t)(Hq + Hkv + h) * D + i];
        if (kv_fp8) {
          ((uint8_t*)k_cache)[at] = to_e4m3(k);
          ((uint8_t*)v_cache)[at] = to_e4m3(v);
        } else {
          ((float*)k_cache)[at] = k;
          ((float*)v_cache)[at] = v;
        }
      }
  }
  attend_all(qkv, Hq + 2 * Hkv, k_cache, v_cache, kv_fp8 ? KV_FP8 : KV_F32, gidx, lens, L, B, Hq, Hkv, D, scale,
             out, scratch, nthreads);
  return 0;
}

/* ---- the bf16 glue: the model's bf16 roundings around torch's bf16 GEMMs ------------------- */
/* Under --dtype bfloat16 a step's matmuls stay torch's (the CPU's bf16 / AMX units); these take
   and give bf16 tensors and round where the model's bf16 forward rounds (kernels/norm's
   reference_rms_norm: the normed values, then the weight's product; rotary in fp32, rounded),
   computing in fp32 between. */

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
   (bf16, or e4m3 with kv_fp8: the bf16 values rounded once more) and out [B, Hq D] bf16; norms
   bf16; cos / sin fp32. q / k normed (rounded as the norm above), rotated in fp32 and rounded;
   scores, softmax and the weighted sum of values in fp32. */
int blitz_decode_attention_bf16(uint16_t* qkv, const uint16_t* q_norm, const uint16_t* k_norm, float qk_eps,
                                const float* cos, const float* sin, void* k_cache, void* v_cache,
                                const int64_t* slots, const int64_t* gidx, const int64_t* lens, int L, int B, int Hq,
                                int Hkv, int D, float scale, uint16_t* out, float* scratch, int nthreads, int kv_fp8) {
  if (D > 1024 || D % 16) return 1;
  const int W = (Hq + 2 * Hkv) * D, half = D / 2;
  float* qf = scratch; /* [B, Hq, D]: the rotated queries, as fp32 */
  float* p_all = scratch + (size_t)B * Hq * D;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (B >= 4)
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
      for (int i = 0; i < half; i++) r[i] = rbf(t[i] * c[i] + t[i + half] * s[i]);
      for (int i = half; i < D; i++) r[i] = rbf(t[i] * c[i] + t[i - half] * s[i]);
      if (h < Hq)
        for (int i = 0; i < D; i++) qf[((size_t)b * Hq + h) * D + i] = r[i];
      else
        for (int i = 0; i < D; i++) {
          const size_t at = ((size_t)slots[b] * Hkv + (h - Hq)) * D + i;
          if (kv_fp8) ((uint8_t*)k_cache)[at] = to_e4m3(r[i]); /* (r: rounded to bf16 already) */
          else ((uint16_t*)k_cache)[at] = to_bf(r[i]);
        }
    }
    for (int h = 0; h < Hkv; h++)
      for (int i = 0; i < D; i++) {
        const size_t at = ((size_t)slots[b] * Hkv + h) * D + i;
        const uint16_t v = row[(size_t)(Hq + Hkv + h) * D + i];
        if (kv_fp8) ((uint8_t*)v_cache)[at] = to_e4m3(bf(v));
        else ((uint16_t*)v_cache)[at] = v;
      }
  }
  /* the outputs in fp32 over the queries (each task reads its query before it writes), then rounded */
  attend_all(qf, Hq, k_cache, v_cache, kv_fp8 ? KV_FP8 : KV_BF16, gidx, lens, L, B, Hq, Hkv, D, scale, qf, p_all,
             nthreads);
  for (size_t i = 0; i < (size_t)B * Hq * D; i += 16) store_bf16x16(out + i, _mm512_loadu_ps(qf + i));
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
  void *k_cache, *v_cache;
} Layer;

typedef struct {
  int hq, hkv, d, inter, nthreads, kv_fp8; /* kv_fp8: the caches hold e4m3 entries */
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
static int decode_layers(const Layer* layers, int n_layers, const Dims* dm, float* x, float* res, int B, int H,
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
                                 gidx, lens, L, B, dm->hq, dm->hkv, dm->d, dm->scale, o, att, dm->nthreads,
                                 dm->kv_fp8);
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
  void *k_cache, *v_cache;
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
                                      slots, gidx, lens, L, 1, hq, dm->hkv, dm->d, dm->scale, o, scratch, nt,
                                      dm->kv_fp8);
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

/* ---- a whole fp32 decode step, token ids to logits ----------------------------------------- */
/* Between the layers' C call and the sampler, torch ran about 25 small ops a step (the embedding
   row, rotary tables, the cache rows' index, the final norm, the lm_head's launch), each paying
   10-20 us on caches the layers' weights had just swept out; here they are loops of a few
   microseconds. */
typedef struct {
  const float* embed;   /* [vocab, H] */
  const float* cos_sin; /* [max_pos, D]: cos of the first half, then sin (layers/rotary.py's cache) */
  const float* norm;    /* the final RMSNorm's weight */
  float norm_eps;
  Linear head;          /* the lm_head; codes NULL: the output is the normed hidden state [B, H] */
  int vocab, max_pos, block_size, num_blocks;
} Ends;

static float* carve(float** p, size_t n) { /* n floats from *p, each piece 64-byte aligned */
  float* r = *p;
  *p += (n + 15) & ~(size_t)15;
  return r;
}

/* the floats of blitz_decode_step's scratch for B rows of contexts up to L */
size_t blitz_decode_step_scratch(const Dims* dm, int B, int H, int L) {
  const size_t W = (size_t)(dm->hq + 2 * dm->hkv) * dm->d;
  return (size_t)B * (2 * H + W + 2 * (size_t)dm->inter + (size_t)dm->hq * L) + (size_t)B * (2 * H + 2 * dm->d + 2)
         + 2 * (size_t)B * L + 16 * 8;
}

/* rows [3, B]: each row's token id, position and context length (its new token included);
   tables [B, nblk]: the KV-cache blocks of each row (block b of row r holds positions
   b * block_size ...; -1 past a row's table); out [B, vocab] logits (or [B, H]); scratch
   64-byte aligned. Returns 2 on an id, position, length or block out of range, 1 on a shape
   the kernels do not take. */
int blitz_decode_step(const Layer* layers, int n_layers, const Dims* dm, const Ends* e, int B, int H,
                      const int64_t* rows, const int32_t* tables, int nblk, float* out, float* scratch) {
  const int64_t *ids = rows, *pos = rows + B, *lens = rows + 2 * B;
  const int D = dm->d, half = D / 2, bs = e->block_size;
  int L = 1;
  for (int b = 0; b < B; b++) {
    if (ids[b] < 0 || ids[b] >= e->vocab || pos[b] < 0 || pos[b] >= e->max_pos || pos[b] >= lens[b]
        || lens[b] > (int64_t)nblk * bs)
      return 2;
    if (lens[b] > L) L = (int)lens[b];
    for (int j = 0; j < (lens[b] + bs - 1) / bs; j++)
      if (tables[(size_t)b * nblk + j] < 0 || tables[(size_t)b * nblk + j] >= e->num_blocks) return 2;
  }
  float* p = scratch;
  float *x = carve(&p, (size_t)B * H), *res = carve(&p, (size_t)B * H);
  float *cos = carve(&p, (size_t)B * D), *sin = carve(&p, (size_t)B * D);
  int64_t* slots = (int64_t*)carve(&p, 2 * (size_t)B);
  int64_t* gidx = (int64_t*)carve(&p, 2 * (size_t)B * L);
  for (int b = 0; b < B; b++) {
    const float* er = e->embed + (size_t)ids[b] * H;
    for (int i = 0; i < H; i++) { x[(size_t)b * H + i] = 0.0f; res[(size_t)b * H + i] = er[i]; }
    /* rotate-half tables as rotary_tables builds them: cos twice, sin with its first half negated */
    const float* cs = e->cos_sin + (size_t)pos[b] * D;
    for (int i = 0; i < half; i++) {
      cos[(size_t)b * D + i] = cos[(size_t)b * D + half + i] = cs[i];
      sin[(size_t)b * D + i] = -cs[half + i];
      sin[(size_t)b * D + half + i] = cs[half + i];
    }
    const int32_t* tb = tables + (size_t)b * nblk;
    slots[b] = (int64_t)tb[pos[b] / bs] * bs + pos[b] % bs;
    for (int t = 0; t < L; t++) /* (rows past lens[b] are never read) */
      gidx[(size_t)b * L + t] = t < lens[b] ? (int64_t)tb[t / bs] * bs + t % bs : 0;
  }
  int rc = decode_layers(layers, n_layers, dm, x, res, B, H, cos, sin, slots, gidx, lens, L, p);
  if (rc) return rc;
  float* h = e->head.codes ? p : out; /* (the layers' scratch is free again) */
  blitz_add_rms_norm(x, res, e->norm, h, B, H, e->norm_eps);
  return e->head.codes ? linear(dm, &e->head, h, out, B) : 0;
}
