/* widen: 1 kernel(s), C dialect. Generated; do not edit. */
#include <math.h>
#include <stdint.h>

#define WIDEN_INF_F32 ((float)INFINITY)
#define WIDEN_NAN_F32 ((float)NAN)
#define WIDEN_INF_F64 ((double)INFINITY)
#define WIDEN_NAN_F64 ((double)NAN)

/* rmsnorm: 5 items, one thread per item (CUDA block 128) */
void widen_rmsnorm(const float* restrict x, const float* restrict g, float* restrict y, int64_t start, int64_t end) {
    for (int64_t item = start; item < end; ++item) {
        /* one row per item */
        const int64_t base = item * 48;
        float ss = 0e0f;
        for (int64_t j = 0; j < 48; ++j) {
            const float v = x[base + j];
            ss = ss + v * v;
        }
        const float r = 1.0f / sqrtf(ss / 4.8e1f + 1e-6f);
        for (int64_t j = 0; j < 48; ++j) {
            y[base + j] = x[base + j] * r * g[j];
        }
    }
}

void widen_rmsnorm_entry(void** args, int64_t start, int64_t end) {
    widen_rmsnorm((const float*)args[0], (const float*)args[1], (float*)args[2], start, end);
}
