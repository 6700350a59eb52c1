/* One bf16 activation row against a bf16 weight on x86 CPUs with AVX512-BF16 (kernels/cpu_gemm
   builds and loads this file): y [N] = x [K] @ W.T (+ bias), W [N, K] row-major as the
   checkpoint stores it. Each weight is read once by a plain stream of 64-byte loads and
   vdpbf16ps multiplies bf16 pairs into fp32 sums (products of two bf16 values are exact in fp32),
   so y is the fp32 dot product rounded once to bf16, as F.linear's, up to summation order.
   Why not oneDNN here: its packed bf16 GEMM at one row read the weights at about two thirds of
   this loop's speed (the step of a bf16 decode at batch 1 is these reads). */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define NB 4 /* weight rows per block: four independent sums cover vdpbf16ps' latency */
#ifndef PFD
#define PFD 2 /* blocks ahead whose rows a thread prefetches (as kernels/cpu_quant/qgemm.c, which says why) */
#endif

static inline uint16_t to_bf16(float s) { /* round to nearest even; NaN stays NaN (as decode.c's to_bf) */
  uint32_t u;
  __builtin_memcpy(&u, &s, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

/* rows [0, nb) of w (nb <= NB) against x -> y; the last K % 32 columns through masked loads */
static inline void block(const uint16_t* x, const uint16_t* w, size_t K, int nb, const uint16_t* bias,
                         uint16_t* y) {
  __m512 acc[NB];
  for (int i = 0; i < NB; i++) acc[i] = _mm512_setzero_ps();
  size_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
    for (int i = 0; i < NB; i++)
      if (i < nb) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(w + i * K + k), xv);
  }
  if (k < K) {
    const __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + k);
    for (int i = 0; i < nb; i++)
      acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_maskz_loadu_epi16(m, w + i * K + k), xv);
  }
  for (int i = 0; i < nb; i++)
    y[i] = to_bf16(_mm512_reduce_add_ps(acc[i]) + (bias ? bf16_to_f32(bias[i]) : 0.0f));
}

void blitz_gemv_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int N, int K,
                     int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int n = 0; n < N; n += NB) {
    if (n + PFD * NB < N) /* (rows past the end: a prefetch reads nothing and cannot fault) */
      for (size_t o = 0; o < (size_t)NB * K * 2; o += 64)
        _mm_prefetch((const char*)(w + (size_t)(n + PFD * NB) * K) + o, _MM_HINT_T0);
    block(x, w + (size_t)n * K, (size_t)K, N - n < NB ? N - n : NB, bias ? bias + n : 0, y + n);
  }
}
