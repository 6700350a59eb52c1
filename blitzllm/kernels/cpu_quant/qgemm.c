/* Weight-only quantized matmul on x86 CPUs with AVX-512: y [M, N] = x [M, K] @ W.T in fp32,
   W read from GGUF's own blocks of 32 (kernels/cpu_quant/native.py builds and loads this file).

   q4: codes [N, K/2] uint8, group g's 16 bytes hold its codes j (low nibble) and j + 16 (high);
       w = d q + m (Q4_1) or d (q - 8) (Q4_0, passed as m = -8 d); d, m fp16 [N, K/32].
   q8: codes [N, K] int8, w = d q (Q8_0); d fp16 [N, K/32].
   dense: a bf16 weight [N, K], each value widened to fp32 exactly (an HF checkpoint's), or fp32.

   Every weight is its exact GGUF value and every product and sum is fp32, so the result is the
   fp32 matmul with the dequantized weight up to summation order. Each pass unpacks NB weight
   rows once for up to RB activation rows. */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#ifndef RB
#define RB 4
#endif
#ifndef NB
#define NB 2
#endif
#define MAXG 1024 /* K up to 32768 */
/* Each thread prefetches the weights PFD passes ahead of the one it computes. Streaming from
   DRAM (the model larger than the last-level cache, or that cache shared with a busy
   neighbour), the hardware prefetcher alone stops at each 4 KB page and a pass waits on its
   loads; from cache the prefetches cost nothing (docs/cpu.md has the figures). (A prefetch past
   an array's end, of the last pass's missing rows, reads nothing and cannot fault.) */
#ifndef PFD
#define PFD 4
#endif

static inline void prefetch(const void* p, size_t bytes) {
  for (size_t o = 0; o < bytes; o += 64) _mm_prefetch((const char*)p + o, _MM_HINT_T0);
}

static inline void halves(const uint16_t* h, float* f, int n) {
  int i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(f + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(h + i))));
  for (; i < n; i++) f[i] = _cvtsh_ss(h[i]);
}

/* the 32 weights of group g of a row as two vectors of 16 floats: q8 codes (codes + g * 32;
   the scale applies to their sum), bf16 or fp32 (the weights themselves, 64 / 128 bytes) */
enum { Q4 = 0, Q8 = 1, BF16 = 2, F32 = 3 };
static inline void unpack(const uint8_t* row, int g, int kind, __m512* a, __m512* b) {
  if (kind == F32) {
    *a = _mm512_loadu_ps(row + g * 128);
    *b = _mm512_loadu_ps(row + g * 128 + 64);
  } else if (kind == BF16) {
    const __m256i* w = (const __m256i*)(row + g * 64);
    *a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(w)), 16));
    *b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(w + 1)), 16));
  } else {
    *a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row + g * 32))));
    *b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row + g * 32 + 16))));
  }
}

/* q4: the 16 values a group's codes can take, d k + m for k = 0..15 (one rounding: the
   weights of blitz_q4_dequant); each code then picks its weight by a lane permute (its low four
   bits index the table), which costs less than widening it to fp32 and scaling the sum */
static inline __m512 q4_table(float d, float m) {
  const __m512 k = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_fmadd_ps(_mm512_set1_ps(d), k, _mm512_set1_ps(m));
}

/* pass() for q4 codes: each row's sums in two chains, the groups' low-nibble halves in one and
   high in the other (half the latency a group waits on); with AVX512-VBMI two groups' 32 bytes
   are spread to the lanes by one byte permute (one shuffle less a group). Both forms add in the
   same order, so every build and batch size gives a row the same bits. */
static inline __attribute__((always_inline)) void pass_q4(const float* x, int nr, int K, const uint8_t* c, size_t ldc, const uint16_t* dh,
                           const uint16_t* mh, int nb, float* y, size_t ldy) {
  const int G = K / 32;
  float d[NB][MAXG], m[NB][MAXG];
  __m512 lo[NB][RB], hi[NB][RB];
  for (int i = 0; i < nb; i++) {
    halves(dh + (size_t)i * G, d[i], G);
    halves(mh + (size_t)i * G, m[i], G);
    for (int r = 0; r < RB; r++) lo[i][r] = hi[i][r] = _mm512_setzero_ps();
  }
  int g = 0;
#ifdef __AVX512VBMI__
  /* lane j: byte 0 <- byte j (group g's codes j, j + 16), byte 2 <- byte 16 + j (group g + 1's) */
  const __m512i pick = _mm512_set_epi32(0x1f000f, 0x1e000e, 0x1d000d, 0x1c000c, 0x1b000b, 0x1a000a, 0x190009, 0x180008,
                                        0x170007, 0x160006, 0x150005, 0x140004, 0x130003, 0x120002, 0x110001, 0x100000);
  for (; g + 2 <= G; g += 2) {
    __m512 w[NB][4];
    for (int i = 0; i < nb; i++) {
      const __m512i v = _mm512_permutexvar_epi8(
          pick, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(c + (size_t)i * ldc + g * 16))));
      const __m512 ta = q4_table(d[i][g], m[i][g]), tb = q4_table(d[i][g + 1], m[i][g + 1]);
      w[i][0] = _mm512_permutexvar_ps(v, ta);
      w[i][1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), ta);
      w[i][2] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 16), tb);
      w[i][3] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 20), tb);
    }
    for (int r = 0; r < nr; r++) {
      const float* xr = x + (size_t)r * K + g * 32;
      for (int i = 0; i < nb; i++) {
        lo[i][r] = _mm512_fmadd_ps(w[i][2], _mm512_loadu_ps(xr + 32), _mm512_fmadd_ps(w[i][0], _mm512_loadu_ps(xr), lo[i][r]));
        hi[i][r] = _mm512_fmadd_ps(w[i][3], _mm512_loadu_ps(xr + 48), _mm512_fmadd_ps(w[i][1], _mm512_loadu_ps(xr + 16), hi[i][r]));
      }
    }
  }
#endif
  for (; g < G; g++) {
    __m512 a[NB], b[NB];
    for (int i = 0; i < nb; i++) {
      const __m512 t = q4_table(d[i][g], m[i][g]);
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(c + (size_t)i * ldc + g * 16)));
      a[i] = _mm512_permutexvar_ps(v, t);  /* (the permute reads an index's low four bits only) */
      b[i] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t);
    }
    for (int r = 0; r < nr; r++) {
      const float* xr = x + (size_t)r * K + g * 32;
      for (int i = 0; i < nb; i++) {
        lo[i][r] = _mm512_fmadd_ps(a[i], _mm512_loadu_ps(xr), lo[i][r]);
        hi[i][r] = _mm512_fmadd_ps(b[i], _mm512_loadu_ps(xr + 16), hi[i][r]);
      }
    }
  }
  for (int i = 0; i < nb; i++)
    for (int r = 0; r < nr; r++) y[(size_t)r * ldy + i] = _mm512_reduce_add_ps(_mm512_add_ps(lo[i][r], hi[i][r]));
}

/* weight rows [n, n + nb) (codes from ``c``, row stride ldc bytes) against activation rows
   [r, r + nr) -> y[r, n], q8 or dense (q4: pass_q4 above); ``dh``: the q8 rows' fp16 scales */
static inline __attribute__((always_inline)) void pass(const float* x, int nr, int K, const uint8_t* c, size_t ldc, int kind,
                        const uint16_t* dh, int nb, float* y, size_t ldy) {
  const int G = K / 32;
  float d[NB][MAXG];
  __m512 acc[NB][RB];
  for (int i = 0; i < nb; i++) {
    if (dh) halves(dh + (size_t)i * G, d[i], G);
    for (int r = 0; r < RB; r++) acc[i][r] = _mm512_setzero_ps();
  }
  for (int g = 0; g < G; g++) {
    __m512 a[NB], b[NB];
    for (int i = 0; i < nb; i++) unpack(c + (size_t)i * ldc, g, kind, &a[i], &b[i]);
    for (int r = 0; r < nr; r++) {
      const float* xr = x + (size_t)r * K + g * 32;
      const __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16);
      for (int i = 0; i < nb; i++)
        acc[i][r] = kind != Q8 ? _mm512_fmadd_ps(b[i], x1, _mm512_fmadd_ps(a[i], x0, acc[i][r]))
                               : _mm512_fmadd_ps(_mm512_set1_ps(d[i][g]),
                                                 _mm512_fmadd_ps(b[i], x1, _mm512_mul_ps(a[i], x0)), acc[i][r]);
    }
  }
  for (int i = 0; i < nb; i++)
    for (int r = 0; r < nr; r++) y[(size_t)r * ldy + i] = _mm512_reduce_add_ps(acc[i][r]);
}

int blitz_q4_gemm(const float* x, const uint8_t* codes, const uint16_t* d, const uint16_t* m, float* y, int M,
                  int N, int K, int nthreads) {
  const int G = K / 32;
  if (K % 32 || G > MAXG) return 1;
  const int passes = (N + NB - 1) / NB;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int p = 0; p < passes; p++) {
    const int n = p * NB, nb = N - n < NB ? N - n : NB;
    for (int r = 0; r < M; r += RB)
    {
      const int nr = M - r < RB ? M - r : RB;
      const uint8_t* c = codes + (size_t)n * (K / 2);
      if (r == 0 && p + PFD < passes) {
        prefetch(c + (size_t)PFD * NB * (K / 2), (size_t)NB * (K / 2));
        prefetch(d + (size_t)(n + PFD * NB) * G, (size_t)NB * G * 2);
        prefetch(m + (size_t)(n + PFD * NB) * G, (size_t)NB * G * 2);
      }
      if (nr == 1 && nb == NB) /* (decode's one row: its sums in registers, the loops unrolled for it) */
        pass_q4(x + (size_t)r * K, 1, K, c, K / 2, d + (size_t)n * G, m + (size_t)n * G, NB, y + (size_t)r * N + n, N);
      else
        pass_q4(x + (size_t)r * K, nr, K, c, K / 2, d + (size_t)n * G, m + (size_t)n * G, nb, y + (size_t)r * N + n, N);
    }
  }
  return 0;
}

int blitz_q8_gemm(const float* x, const int8_t* codes, const uint16_t* d, float* y, int M, int N, int K,
                  int nthreads) {
  const int G = K / 32;
  if (K % 32 || G > MAXG) return 1;
  const int passes = (N + NB - 1) / NB;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int p = 0; p < passes; p++) {
    const int n = p * NB, nb = N - n < NB ? N - n : NB;
    for (int r = 0; r < M; r += RB) {
      const int nr = M - r < RB ? M - r : RB;
      const uint8_t* c = (const uint8_t*)codes + (size_t)n * K;
      if (r == 0 && p + PFD < passes) {
        prefetch(c + (size_t)PFD * NB * K, (size_t)NB * K);
        prefetch(d + (size_t)(n + PFD * NB) * G, (size_t)NB * G * 2);
      }
      if (nr == 1 && nb == NB) /* (as blitz_q4_gemm's) */
        pass(x + (size_t)r * K, 1, K, c, K, Q8, d + (size_t)n * G, NB, y + (size_t)r * N + n, N);
      else
        pass(x + (size_t)r * K, nr, K, c, K, Q8, d + (size_t)n * G, nb, y + (size_t)r * N + n, N);
    }
  }
  return 0;
}

/* a dense weight [N, K] (no scales), bf16 (f32 = 0; each value widened exactly) or fp32:
   y = x @ W.T in fp32 */
int blitz_dense_gemm(const float* x, const void* w, float* y, int M, int N, int K, int f32, int nthreads) {
  if (K % 32 || K / 32 > MAXG) return 1;
  const size_t ldw = (size_t)K * (f32 ? 4 : 2);
  const int passes = (N + NB - 1) / NB;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int p = 0; p < passes; p++) {
    const int n = p * NB, nb = N - n < NB ? N - n : NB;
    for (int r = 0; r < M; r += RB) {
      const int nr = M - r < RB ? M - r : RB;
      const uint8_t* c = (const uint8_t*)w + n * ldw;
      if (r == 0 && p + PFD < passes) prefetch(c + PFD * NB * ldw, NB * ldw);
      if (nr == 1 && nb == NB) /* (as blitz_q4_gemm's) */
        pass(x + (size_t)r * K, 1, K, c, ldw, f32 ? F32 : BF16, 0, NB, y + (size_t)r * N + n, N);
      else
        pass(x + (size_t)r * K, nr, K, c, ldw, f32 ? F32 : BF16, 0, nb, y + (size_t)r * N + n, N);
    }
  }
  return 0;
}

/* the weight [N, K] in fp32 (prefill multiplies it by a dense GEMM) */
void blitz_q4_dequant(const uint8_t* codes, const uint16_t* dh, const uint16_t* mh, float* w, int N, int K,
                      int nthreads) {
  const int G = K / 32;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int n = 0; n < N; n++) {
    float d[MAXG], m[MAXG];
    halves(dh + (size_t)n * G, d, G);
    halves(mh + (size_t)n * G, m, G);
    for (int g = 0; g < G; g++) {
      __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(codes + (size_t)n * (K / 2) + g * 16)));
      const __m512 dg = _mm512_set1_ps(d[g]), mg = _mm512_set1_ps(m[g]);
      float* wg = w + (size_t)n * K + g * 32;
      _mm512_storeu_ps(wg, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_epi32(v, _mm512_set1_epi32(15))), dg, mg));
      _mm512_storeu_ps(wg + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), dg, mg));
    }
  }
}

void blitz_q8_dequant(const int8_t* codes, const uint16_t* dh, float* w, int N, int K, int nthreads) {
  const int G = K / 32;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int n = 0; n < N; n++) {
    float d[MAXG];
    halves(dh + (size_t)n * G, d, G);
    for (int g = 0; g < G; g++) {
      const int8_t* q = codes + (size_t)n * K + g * 32;
      const __m512 dg = _mm512_set1_ps(d[g]);
      float* wg = w + (size_t)n * K + g * 32;
      _mm512_storeu_ps(wg, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q))), dg));
      _mm512_storeu_ps(wg + 16,
                       _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 16)))), dg));
    }
  }
}
