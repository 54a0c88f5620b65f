/* widen: 1 kernel(s), C dialect. Generated; do not edit. */
#include <math.h>
#include <stdint.h>

#define WIDEN_INF_F32 ((float)INFINITY)
#define WIDEN_NAN_F32 ((float)NAN)
#define WIDEN_INF_F64 ((double)INFINITY)
#define WIDEN_NAN_F64 ((double)NAN)

#if defined(__GNUC__) || defined(__clang__)
#define WIDEN_INLINE static inline __attribute__((always_inline))
#else
#define WIDEN_INLINE static inline
#endif

#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
#define WIDEN_FMA(a, b, c) fmaf(a, b, c)
#else
#define WIDEN_FMA(a, b, c) ((a) * (b) + (c))
#endif

WIDEN_INLINE float widen_pow2i(int32_t k) {
    union { int32_t i; float f; } v;
    v.i = (k + 127) << 23;
    return v.f;
}

WIDEN_INLINE float widen_expf(float x) {
    const float c = x < -104.0f ? -104.0f : x > 89.0f ? 89.0f : x == x ? x : 0.0f;
    const float shifter = 12582912.0f;
    const float n = (c * 1.44269504088896341f + shifter) - shifter;
    const float r = WIDEN_FMA(-n, 1.42860682030941723212e-6f, WIDEN_FMA(-n, 6.93145751953125e-1f, c));
    float p = 1.9875691500e-4f;
    p = WIDEN_FMA(p, r, 1.3981999507e-3f);
    p = WIDEN_FMA(p, r, 8.3334519073e-3f);
    p = WIDEN_FMA(p, r, 4.1665795894e-2f);
    p = WIDEN_FMA(p, r, 1.6666665459e-1f);
    p = WIDEN_FMA(p, r, 5.0000001201e-1f);
    p = WIDEN_FMA(p, r * r, r) + 1.0f;
    const int32_t k = (int32_t)n;
    const int32_t half = k >> 1;
    const float e = p * widen_pow2i(half) * widen_pow2i(k - half);
    return x == x ? e : x;
}

/* silu_mul: 1000 items, one thread per item (CUDA block 256) */
void widen_silu_mul(const float* restrict a, const float* restrict b, float* restrict out, int64_t start, int64_t end) {
    for (int64_t item = start; item < end; ++item) {
        const float av = a[item];
        const float s = av / (1e0f + widen_expf(-av));
        const float v = s * b[item];
        out[item] = v > 1e2f ? 1e2f : v;
    }
}

void widen_silu_mul_entry(void** args, int64_t start, int64_t end) {
    widen_silu_mul((const float*)args[0], (const float*)args[1], (float*)args[2], start, end);
}
