/* The fp32 glue of a CPU decode layer around its matmuls (kernels/cpu_decode/ops.py builds and
   loads this file; runner/cpu_graph.py calls it): the residual add + RMSNorm, and one call for
   q / k RMSNorm, rotary, the paged KV-cache write and attention over the cache rows. Each is a
   handful of torch ops of a few microseconds' work on a decode row but 10-30 us of dispatch
   each; here one call. Plain C, vectorized by the compiler. */
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
