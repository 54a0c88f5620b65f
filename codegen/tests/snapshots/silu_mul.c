/* widen: 1 kernel(s), C dialect. Generated; do not edit. */
#include <math.h>
#include <stdint.h>

#define WIDEN_INF_F32 ((float)INFINITY)
#define WIDEN_NAN_F32 ((float)NAN)
#define WIDEN_INF_F64 ((double)INFINITY)
#define WIDEN_NAN_F64 ((double)NAN)

/* silu_mul: 1000 items, one thread per item (CUDA block 256) */
void widen_silu_mul(const float* restrict a, const float* restrict b, float* restrict out, int64_t start, int64_t end) {
    for (int64_t item = start; item < end; ++item) {
        const float av = a[item];
        const float s = av / (1e0f + expf(-av));
        const float v = s * b[item];
        out[item] = v > 1e2f ? 1e2f : v;
    }
}

void widen_silu_mul_entry(void** args, int64_t start, int64_t end) {
    widen_silu_mul((const float*)args[0], (const float*)args[1], (float*)args[2], start, end);
}
