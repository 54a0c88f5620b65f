/* widen: 1 kernel(s), C dialect. Generated; do not edit. */
#include <math.h>
#include <stdint.h>

#define WIDEN_INF_F32 ((float)INFINITY)
#define WIDEN_NAN_F32 ((float)NAN)
#define WIDEN_INF_F64 ((double)INFINITY)
#define WIDEN_NAN_F64 ((double)NAN)

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
                sum = sum + expf(x[base[lane] + j] - m);
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
                y[base[lane] + j] = expf(x[base[lane] + j] - m) / total;
            }
        }
    }
}

void widen_softmax_entry(void** args, int64_t start, int64_t end) {
    widen_softmax((const float*)args[0], (float*)args[1], (float*)args[2], start, end);
}
