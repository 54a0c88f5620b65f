/* widen: 1 kernel(s), CUDA dialect. Generated; do not edit. */
#define WIDEN_INF_F32 __int_as_float(0x7f800000)
#define WIDEN_NAN_F32 __int_as_float(0x7fc00000)
#define WIDEN_INF_F64 __longlong_as_double(0x7ff0000000000000LL)
#define WIDEN_NAN_F64 __longlong_as_double(0x7ff8000000000000LL)

/* softmax: 3 items, one block of 64 lanes per item */
extern "C" __global__ void __launch_bounds__(64) widen_softmax(const float* __restrict__ x, float* __restrict__ y, float* __restrict__ centered) {
    __shared__ float widen_red_f32[64];
    const long long item = blockIdx.x;
    const long long lane = threadIdx.x;
    if (item >= 3) return;
    const long long base = item * 200;
    const float own = x[base + lane];
    float mx = -WIDEN_INF_F32;
    for (long long j = lane; j < 200; j += 64) {
        mx = fmaxf(mx, x[base + j]);
    }
    widen_red_f32[lane] = mx;
    __syncthreads();
    for (int widen_s = 32; widen_s > 0; widen_s >>= 1) {
        if (lane < widen_s) {
            widen_red_f32[lane] = fmaxf(widen_red_f32[lane], widen_red_f32[lane + widen_s]);
        }
        __syncthreads();
    }
    const float m = widen_red_f32[0];
    __syncthreads();
    float sum = 0e0f;
    for (long long j = lane; j < 200; j += 64) {
        sum = sum + expf(x[base + j] - m);
    }
    widen_red_f32[lane] = sum;
    __syncthreads();
    for (int widen_s = 32; widen_s > 0; widen_s >>= 1) {
        if (lane < widen_s) {
            widen_red_f32[lane] = widen_red_f32[lane] + widen_red_f32[lane + widen_s];
        }
        __syncthreads();
    }
    const float total = widen_red_f32[0];
    __syncthreads();
    centered[item * 64 + lane] = own - m;
    __syncthreads();
    for (long long j = lane; j < 200; j += 64) {
        y[base + j] = expf(x[base + j] - m) / total;
    }
}
