/* widen: 1 kernel(s), C dialect. Generated; do not edit. */
#include <math.h>
#include <stdint.h>

#define WIDEN_INF_F32 ((float)INFINITY)
#define WIDEN_NAN_F32 ((float)NAN)
#define WIDEN_INF_F64 ((double)INFINITY)
#define WIDEN_NAN_F64 ((double)NAN)

static inline float widen_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

static inline uint16_t widen_f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) {
        return (uint16_t)((v.u >> 16) | 0x40u);
    }
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* bf16_convert: 300 items, one thread per item (CUDA block 256) */
void widen_bf16_convert(const uint16_t* restrict xb, const float* restrict xf, float* restrict yf, uint16_t* restrict yb, int64_t start, int64_t end) {
    for (int64_t item = start; item < end; ++item) {
        yf[item] = widen_bf16_to_f32(xb[item]) * 2e0f;
        yb[item] = widen_f32_to_bf16(xf[item]);
        yb[item] = widen_f32_to_bf16(widen_bf16_to_f32(yb[item]) + 1e0f);
    }
}

void widen_bf16_convert_entry(void** args, int64_t start, int64_t end) {
    widen_bf16_convert((const uint16_t*)args[0], (const float*)args[1], (float*)args[2], (uint16_t*)args[3], start, end);
}
