/* widen: 1 kernel(s), CUDA dialect. Generated; do not edit. */
#define WIDEN_INF_F32 __int_as_float(0x7f800000)
#define WIDEN_NAN_F32 __int_as_float(0x7fc00000)
#define WIDEN_INF_F64 __longlong_as_double(0x7ff0000000000000LL)
#define WIDEN_NAN_F64 __longlong_as_double(0x7ff8000000000000LL)

/* stream_mix: 6 items, one thread per item (CUDA block 128) */
extern "C" __global__ void __launch_bounds__(128) widen_stream_mix(const float* __restrict__ h, const float* __restrict__ h_mix, float* __restrict__ out) {
    const long long item = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (item >= 6) return;
    const long long base = item * 32;
    for (long long c = 0; c < 8; ++c) {
        float acc[4];
        #pragma unroll
        for (long long s = 0; s < 4; ++s) {
            acc[s] = 0e0f;
        }
        #pragma unroll
        for (long long s = 0; s < 4; ++s) {
            #pragma unroll
            for (long long r = 0; r < 4; ++r) {
                acc[s] += h_mix[s * 4 + r] * h[base + r * 8 + c];
            }
        }
        #pragma unroll
        for (long long s = 0; s < 4; ++s) {
            out[base + s * 8 + c] = acc[s];
        }
    }
}
