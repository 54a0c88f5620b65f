/* widen: 1 kernel(s), C dialect. Generated; do not edit. */
#include <math.h>
#include <stdint.h>

#define WIDEN_INF_F32 ((float)INFINITY)
#define WIDEN_NAN_F32 ((float)NAN)
#define WIDEN_INF_F64 ((double)INFINITY)
#define WIDEN_NAN_F64 ((double)NAN)

/* stream_mix: 6 items, one thread per item (CUDA block 128) */
void widen_stream_mix(const float* restrict h, const float* restrict h_mix, float* restrict out, int64_t start, int64_t end) {
    for (int64_t item = start; item < end; ++item) {
        const int64_t base = item * 32;
        for (int64_t c = 0; c < 8; ++c) {
            float acc[4];
            #pragma GCC unroll 64
            for (int64_t s = 0; s < 4; ++s) {
                acc[s] = 0e0f;
            }
            #pragma GCC unroll 64
            for (int64_t s = 0; s < 4; ++s) {
                #pragma GCC unroll 64
                for (int64_t r = 0; r < 4; ++r) {
                    acc[s] += h_mix[s * 4 + r] * h[base + r * 8 + c];
                }
            }
            #pragma GCC unroll 64
            for (int64_t s = 0; s < 4; ++s) {
                out[base + s * 8 + c] = acc[s];
            }
        }
    }
}

void widen_stream_mix_entry(void** args, int64_t start, int64_t end) {
    widen_stream_mix((const float*)args[0], (const float*)args[1], (float*)args[2], start, end);
}
