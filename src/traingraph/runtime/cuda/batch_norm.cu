/* Training-mode BatchNormalization over x [n, c, s] (float32), forward and gradient, compiled
 * at run time by traingraph.runtime.cuda.kernels (--fmad=false, IEEE division and roots).
 *
 * Each is two kernels over a grid of (parts, c) blocks, block (p, ch) taking part p of channel
 * ch's n * s values (positions j = p * part .. of the channel, at (j / s * c + ch) * s + j % s):
 *   - *_sums: the block's sums, shifted by the channel's first value (zero where that is not
 *     finite) and added in double, written to partial[(ch * parts + p) * K + k];
 *   - *_apply: the channel's sums (its parts' added in order, so every block of a channel gets
 *     the same coefficients and a step the same bits run after run), the statistics in
 *     double, then the block's part of the output.
 *
 * Forward, with M = n * s, d = x - x0:
 *     mean = x0 + sum(d) / M,  var = sum(d^2) / M - (sum(d) / M)^2 (at least 0, NaN kept),
 *     y = a x + (bias - a mean) [+ addend] [then Relu],  a = scale / sqrt(var + eps),
 * and the batch mean and variance, which the graph's running statistics read.
 * Gradient, with g = dy (or dy * (y > 0), the Relu's gradient in front of it):
 *     dscale = rstd sum(g (x - mean)),  dbias = sum(g),
 *     dx = a g - k (x - mean) + (k (mean - (float)mean) - cc),
 *     a = scale rstd,  k = a rstd dscale / M,  cc = a dbias / M,
 * x - mean taken before k scales it, as the CPU kernel does.
 */

#define THREADS 256

__device__ __forceinline__ float finite_or_zero(float v) { return v - v == 0.0f ? v : 0.0f; }

/* max(v, 0) of the Relu, NaN kept (relu_nan != 0) or zeroed (as a `v > 0 ? v : 0`) */
__device__ __forceinline__ float relu(float v, int relu_nan)
{
    return v > 0.0f || (relu_nan && v != v) ? v : 0.0f;
}

/* The sums of the block's threads, each of K doubles, written by thread 0 to out[0..K) */
template <int K>
__device__ __forceinline__ void block_sums(double (&v)[K], double *out)
{
    __shared__ double warps[THREADS / 32][K];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int k = 0; k < K; k++) {
        for (int step = 16; step > 0; step >>= 1) {
            v[k] += __shfl_down_sync(0xffffffffu, v[k], step);
        }
        if (lane == 0) {
            warps[warp][k] = v[k];
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 0; k < K; k++) {
            double total = 0.0;
            for (int w = 0; w < THREADS / 32; w++) {
                total += warps[w][k];
            }
            out[k] = total;
        }
    }
}

/* The positions [start, stop) of this block's part of channel ch */
struct Part {
    long long start, stop;
    __device__ Part(long long m, long long part) : start(blockIdx.x * part)
    {
        stop = start + part < m ? start + part : m;
    }
};

__device__ __forceinline__ long long at(long long j, long long c, long long s, int ch)
{
    const long long n = j / s;
    return (n * c + ch) * s + (j - n * s);
}

extern "C" __global__ void __launch_bounds__(THREADS)
bn_forward_sums(const float *x, double *partial, long long n, long long c, long long s,
                long long part)
{
    const int ch = blockIdx.y;
    const Part p(n * s, part);
    const float x0 = finite_or_zero(x[ch * s]);
    double v[2] = {0.0, 0.0};
    for (long long j = p.start + threadIdx.x; j < p.stop; j += THREADS) {
        const double d = (double)(x[at(j, c, s, ch)] - x0);
        v[0] += d;
        v[1] += d * d;
    }
    block_sums<2>(v, partial + ((long long)ch * gridDim.x + blockIdx.x) * 2);
}

extern "C" __global__ void __launch_bounds__(THREADS)
bn_forward_apply(const float *x, const float *scale, const float *bias, const float *addend,
                 float *y, float *mean_out, float *var_out, const double *partial, long long n,
                 long long c, long long s, long long part, double eps, int relu_after,
                 int relu_nan)
{
    __shared__ float coefficients[2];
    const int ch = blockIdx.y;
    const long long m = n * s;
    if (threadIdx.x == 0) {
        double sums[2] = {0.0, 0.0};
        for (unsigned q = 0; q < gridDim.x; q++) {
            sums[0] += partial[((long long)ch * gridDim.x + q) * 2];
            sums[1] += partial[((long long)ch * gridDim.x + q) * 2 + 1];
        }
        const double count = (double)m, x0 = (double)finite_or_zero(x[ch * s]);
        const double shifted = sums[0] / count;
        double var = sums[1] / count - shifted * shifted;
        var = var < 0.0 ? 0.0 : var; /* NaN stays NaN */
        const double mean = x0 + shifted, a = (double)scale[ch] / sqrt(var + eps);
        coefficients[0] = (float)a;
        coefficients[1] = (float)((double)bias[ch] - a * mean);
        if (blockIdx.x == 0) {
            mean_out[ch] = (float)mean;
            var_out[ch] = (float)var;
        }
    }
    __syncthreads();
    const float a = coefficients[0], shift = coefficients[1];
    const Part p(m, part);
    for (long long j = p.start + threadIdx.x; j < p.stop; j += THREADS) {
        const long long i = at(j, c, s, ch);
        float v = a * x[i] + shift;
        if (addend != nullptr) {
            v = v + addend[i];
        }
        y[i] = relu_after ? relu(v, relu_nan) : v;
    }
}

/* The Relu's gradient of the graph, dy * Cast(y > 0): dy * 0 where y is not above 0 */
__device__ __forceinline__ float gated(const float *dy, const float *y, long long i)
{
    return y != nullptr ? dy[i] * (float)(y[i] > 0.0f) : dy[i];
}

extern "C" __global__ void __launch_bounds__(THREADS)
bn_grad_sums(const float *x, const float *dy, const float *y, double *partial, long long n,
             long long c, long long s, long long part)
{
    const int ch = blockIdx.y;
    const Part p(n * s, part);
    const float x0 = finite_or_zero(x[ch * s]);
    double v[4] = {0.0, 0.0, 0.0, 0.0};
    for (long long j = p.start + threadIdx.x; j < p.stop; j += THREADS) {
        const long long i = at(j, c, s, ch);
        const double d = (double)(x[i] - x0), g = (double)gated(dy, y, i);
        v[0] += d;
        v[1] += d * d;
        v[2] += g;
        v[3] += g * d;
    }
    block_sums<4>(v, partial + ((long long)ch * gridDim.x + blockIdx.x) * 4);
}

extern "C" __global__ void __launch_bounds__(THREADS)
bn_grad_apply(const float *x, const float *dy, const float *y, const float *scale, float *dx,
              float *dscale, float *dbias, const double *partial, long long n, long long c,
              long long s, long long part, double eps)
{
    __shared__ float coefficients[4];
    const int ch = blockIdx.y;
    const long long m = n * s;
    if (threadIdx.x == 0) {
        double sums[4] = {0.0, 0.0, 0.0, 0.0};
        for (unsigned q = 0; q < gridDim.x; q++) {
            for (int k = 0; k < 4; k++) {
                sums[k] += partial[((long long)ch * gridDim.x + q) * 4 + k];
            }
        }
        const double count = (double)m, x0 = (double)finite_or_zero(x[ch * s]);
        const double shifted = sums[0] / count;
        double var = sums[1] / count - shifted * shifted;
        var = var < 0.0 ? 0.0 : var; /* NaN stays NaN */
        const double mean = x0 + shifted, rstd = 1.0 / sqrt(var + eps);
        const double sum_g = sums[2], sum_gc = sums[3] - shifted * sums[2];
        /* without dx, the scale is not read (a graph need not hold it) */
        const double ds = rstd * sum_gc;
        const double a = (scale != nullptr ? (double)scale[ch] : 1.0) * rstd;
        const double k = a * rstd * ds / count, cc = a * sum_g / count;
        const float mean_f = (float)mean;
        coefficients[0] = (float)a;
        coefficients[1] = (float)k;
        coefficients[2] = mean_f;
        coefficients[3] = (float)(k * (mean - (double)mean_f) - cc);
        if (blockIdx.x == 0) {
            if (dscale != nullptr) {
                dscale[ch] = (float)ds;
            }
            if (dbias != nullptr) {
                dbias[ch] = (float)sum_g;
            }
        }
    }
    if (dx == nullptr) {
        return;
    }
    __syncthreads();
    const float a = coefficients[0], k = coefficients[1], mean = coefficients[2];
    const float shift = coefficients[3];
    const Part p(m, part);
    for (long long j = p.start + threadIdx.x; j < p.stop; j += THREADS) {
        const long long i = at(j, c, s, ch);
        dx[i] = a * gated(dy, y, i) - k * (x[i] - mean) + shift;
    }
}
