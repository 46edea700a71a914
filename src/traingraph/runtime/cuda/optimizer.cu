/* One-pass AdamW and SGD updates in place over flat device blocks (compiled at run time by
 * traingraph.runtime.cuda.kernels with --fmad=false and IEEE division and square roots).
 *
 * The arithmetic is the optimizer graph's, op by op and in its order, in the element type T:
 * the same as the CPU's fused loops (csrc/optimizer_kernels.h), so a step gives the graph's
 * numbers bit for bit on either device. The coefficients are computed by the caller in
 * float64 and rounded to T, as the graph computes its bias corrections.
 *
 * Each thread walks the elements with the grid's stride; each element of each array is read
 * once and written at most once.
 */

enum { SGD_PLAIN, SGD_MOMENTUM, SGD_NESTEROV, SGD_DAMPENED, SGD_FIRST_DAMPENED };

__device__ __forceinline__ float root(float x) { return sqrtf(x); }
__device__ __forceinline__ double root(double x) { return sqrt(x); }

/* m += (g - m)(1 - b1); v = v b2 + g^2 (1 - b2);
 * p += -lr ((m / bc1) / (sqrt(v) / bc2_sqrt + eps) [+ wd p]) */
template <typename T>
__device__ __forceinline__ void adamw(
    T *p, const T *g, T *m, T *v, long long n, T one_minus_b1, T b2, T one_minus_b2, T bc1,
    T bc2_sqrt, T eps, T wd, T neg_lr, int decay)
{
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const T gi = g[i], pi = p[i];
        const T mi = m[i] + (gi - m[i]) * one_minus_b1;
        const T vi = v[i] * b2 + (gi * gi) * one_minus_b2;
        T u = (mi / bc1) / (root(vi) / bc2_sqrt + eps);
        if (decay) {
            u = u + pi * wd;
        }
        m[i] = mi;
        v[i] = vi;
        p[i] = pi + u * neg_lr;
    }
}

/* g' = g [+ wd p]; with momentum b = mu b + g' (or g' at a dampened first step, or
 * mu b + (1 - tau) g'), g' = b or g' + mu b (Nesterov); p += -lr g' */
template <typename T>
__device__ __forceinline__ void sgd(
    T *p, const T *g, T *buf, long long n, T wd, T mu, T one_minus_tau, T neg_lr, int decay,
    int mode)
{
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const T pi = p[i];
        T gi = g[i];
        if (decay) {
            gi = gi + pi * wd;
        }
        if (mode != SGD_PLAIN) {
            T b;
            if (mode == SGD_FIRST_DAMPENED) {
                b = gi;
            } else if (mode == SGD_DAMPENED) {
                b = buf[i] * mu + gi * one_minus_tau;
            } else {
                b = buf[i] * mu + gi;
            }
            buf[i] = b;
            gi = mode == SGD_NESTEROV ? gi + b * mu : b;
        }
        p[i] = pi + gi * neg_lr;
    }
}

#define ADAMW(T, NAME)                                                                        \
    extern "C" __global__ void NAME(                                                          \
        T *p, const T *g, T *m, T *v, long long n, T one_minus_b1, T b2, T one_minus_b2,      \
        T bc1, T bc2_sqrt, T eps, T wd, T neg_lr, int decay)                                  \
    {                                                                                         \
        adamw<T>(p, g, m, v, n, one_minus_b1, b2, one_minus_b2, bc1, bc2_sqrt, eps, wd,       \
                 neg_lr, decay);                                                              \
    }

#define SGD(T, NAME)                                                                          \
    extern "C" __global__ void NAME(                                                          \
        T *p, const T *g, T *buf, long long n, T wd, T mu, T one_minus_tau, T neg_lr,         \
        int decay, int mode)                                                                  \
    {                                                                                         \
        sgd<T>(p, g, buf, n, wd, mu, one_minus_tau, neg_lr, decay, mode);                     \
    }

ADAMW(float, adamw_f32)
ADAMW(double, adamw_f64)
SGD(float, sgd_f32)
SGD(double, sgd_f64)
