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

/* softmax: 3 items, one block of 64 lanes per item */
void widen_softmax(const float* restrict x, float* restrict y, float* restrict centered, int64_t start, int64_t end) {
    for (int64_t item = start; item < end; ++item) {
        int64_t base[64];
        float own[64];
        float widen_red_f32[64];
        for (int64_t lane = 0; lane < 64; ++lane) {
            base[lane] = item * 200;
            own[lane] = x[base[lane] + lane];
            float mx = -WIDEN_INF_F32;
            for (int64_t j = lane; j < 200; j += 64) {
                mx = fmaxf(mx, x[base[lane] + j]);
            }
            widen_red_f32[lane] = mx;
        }
        for (int64_t widen_s = 32; widen_s > 0; widen_s >>= 1) {
            for (int64_t lane = 0; lane < widen_s; ++lane) {
                widen_red_f32[lane] = fmaxf(widen_red_f32[lane], widen_red_f32[lane + widen_s]);
            }
        }
        const float m = widen_red_f32[0];
        for (int64_t lane = 0; lane < 64; ++lane) {
            float sum = 0e0f;
            for (int64_t j = lane; j < 200; j += 64) {
                sum = sum + widen_expf(x[base[lane] + j] - m);
            }
            widen_red_f32[lane] = sum;
        }
        for (int64_t widen_s = 32; widen_s > 0; widen_s >>= 1) {
            for (int64_t lane = 0; lane < widen_s; ++lane) {
                widen_red_f32[lane] = widen_red_f32[lane] + widen_red_f32[lane + widen_s];
            }
        }
        const float total = widen_red_f32[0];
        for (int64_t lane = 0; lane < 64; ++lane) {
            centered[item * 64 + lane] = own[lane] - m;
        }
        /* barrier */
        for (int64_t lane = 0; lane < 64; ++lane) {
            for (int64_t j = lane; j < 200; j += 64) {
                y[base[lane] + j] = widen_expf(x[base[lane] + j] - m) / total;
            }
        }
    }
}

void widen_softmax_entry(void** args, int64_t start, int64_t end) {
    widen_softmax((const float*)args[0], (float*)args[1], (float*)args[2], start, end);
}
