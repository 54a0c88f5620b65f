/* widen: 1 kernel(s), CUDA dialect. Generated; do not edit. */
#define WIDEN_INF_F32 __int_as_float(0x7f800000)
#define WIDEN_NAN_F32 __int_as_float(0x7fc00000)
#define WIDEN_INF_F64 __longlong_as_double(0x7ff0000000000000LL)
#define WIDEN_NAN_F64 __longlong_as_double(0x7ff8000000000000LL)

/* rmsnorm: 5 items, one thread per item (CUDA block 128) */
extern "C" __global__ void __launch_bounds__(128) widen_rmsnorm(const float* __restrict__ x, const float* __restrict__ g, float* __restrict__ y) {
    const long long item = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (item >= 5) return;
    /* one row per item */
    const long long base = item * 48;
    float ss = 0e0f;
    for (long long j = 0; j < 48; ++j) {
        const float v = x[base + j];
        ss = ss + v * v;
    }
    const float r = 1.0f / sqrtf(ss / 4.8e1f + 1e-6f);
    for (long long j = 0; j < 48; ++j) {
        y[base + j] = x[base + j] * r * g[j];
    }
}
