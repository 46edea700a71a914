/* One-pass AdamW and SGD updates in place over flat device blocks (compiled at run time by
 * traingraph.runtime.cuda.kernels with --fmad=false and IEEE division and square roots).
 *
 * The arithmetic is the optimizer graph's, op by op and in its order, in the element type T:
 * the same as the CPU's fused loops (csrc/optimizer_kernels.h), so a step gives the graph's
 * numbers bit for bit on either device. The coefficients are computed by the caller in
 * float64 and rounded to T, as the graph computes its bias corrections.
 *
 * Each thread walks the elements (or 16-byte vectors of them) with the grid's stride; each
 * element of each array is read once and written at most once.
 */

enum { SGD_PLAIN, SGD_MOMENTUM, SGD_NESTEROV, SGD_DAMPENED, SGD_FIRST_DAMPENED };

__device__ __forceinline__ float root(float x) { return sqrtf(x); }
__device__ __forceinline__ double root(double x) { return sqrt(x); }

/* m += (g - m)(1 - b1); v = v b2 + g^2 (1 - b2);
 * p += -lr ((m / bc1) / (sqrt(v) / bc2_sqrt + eps) [+ wd p]) */
template <typename T>
struct AdamW {
    T one_minus_b1, b2, one_minus_b2, bc1, bc2_sqrt, eps, wd, neg_lr;
    int decay;

    __device__ __forceinline__ void operator()(T &p, const T g, T &m, T &v) const
    {
        const T mi = m + (g - m) * one_minus_b1;
        const T vi = v * b2 + (g * g) * one_minus_b2;
        T u = (mi / bc1) / (root(vi) / bc2_sqrt + eps);
        if (decay) {
            u = u + p * wd;
        }
        m = mi;
        v = vi;
        p = p + u * neg_lr;
    }
};

/* g' = g [+ wd p]; with momentum b = mu b + g' (or g' at a dampened first step, or
 * mu b + (1 - tau) g'), g' = b or g' + mu b (Nesterov); p += -lr g' */
template <typename T>
struct SGD {
    T wd, mu, one_minus_tau, neg_lr;
    int decay, mode;

    __device__ __forceinline__ void operator()(T &p, T g, T &buf) const
    {
        if (decay) {
            g = g + p * wd;
        }
        if (mode != SGD_PLAIN) {
            T b;
            if (mode == SGD_FIRST_DAMPENED) {
                b = g;
            } else if (mode == SGD_DAMPENED) {
                b = buf * mu + g * one_minus_tau;
            } else {
                b = buf * mu + g;
            }
            buf = b;
            g = mode == SGD_NESTEROV ? g + b * mu : b;
        }
        p = p + g * neg_lr;
    }
};

/* The elements i of the grid's threads, with the grid's stride. */
#define EACH(i, n)                                                                            \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n);             \
         i += (long long)blockDim.x * gridDim.x)

/* One element at a time, or W elements of one 16-byte vector V (the caller passes
 * 16-byte-aligned blocks and n counting vectors); either way each element gets the same ops. */
#define ADAMW(T, NAME, V, W)                                                                  \
    extern "C" __global__ void NAME(                                                          \
        V *p, const V *g, V *m, V *v, long long n, T one_minus_b1, T b2, T one_minus_b2,      \
        T bc1, T bc2_sqrt, T eps, T wd, T neg_lr, int decay)                                  \
    {                                                                                         \
        const AdamW<T> step = {one_minus_b1, b2, one_minus_b2, bc1, bc2_sqrt, eps, wd,        \
                               neg_lr, decay};                                                \
        EACH(i, n)                                                                            \
        {                                                                                     \
            V pi = p[i], mi = m[i], vi = v[i];                                                \
            const V gi = g[i];                                                                \
            T *pl = (T *)&pi, *ml = (T *)&mi, *vl = (T *)&vi;                                 \
            const T *gl = (const T *)&gi;                                                     \
            for (int k = 0; k < W; k++) {                                                     \
                step(pl[k], gl[k], ml[k], vl[k]);                                             \
            }                                                                                 \
            p[i] = pi;                                                                        \
            m[i] = mi;                                                                        \
            v[i] = vi;                                                                        \
        }                                                                                     \
    }

#define SGD_KERNEL(T, NAME, V, W)                                                             \
    extern "C" __global__ void NAME(                                                          \
        V *p, const V *g, V *buf, long long n, T wd, T mu, T one_minus_tau, T neg_lr,         \
        int decay, int mode)                                                                  \
    {                                                                                         \
        const SGD<T> step = {wd, mu, one_minus_tau, neg_lr, decay, mode};                     \
        EACH(i, n)                                                                            \
        {                                                                                     \
            V pi = p[i], bi;                                                                  \
            const V gi = g[i];                                                                \
            if (mode != SGD_PLAIN) {                                                          \
                bi = buf[i];                                                                  \
            }                                                                                 \
            T *pl = (T *)&pi, *bl = (T *)&bi;                                                 \
            const T *gl = (const T *)&gi;                                                     \
            for (int k = 0; k < W; k++) {                                                     \
                step(pl[k], gl[k], bl[k]);                                                    \
            }                                                                                 \
            p[i] = pi;                                                                        \
            if (mode != SGD_PLAIN) {                                                          \
                buf[i] = bi;                                                                  \
            }                                                                                 \
        }                                                                                     \
    }

ADAMW(float, adamw_f32, float, 1)
ADAMW(float, adamw_f32_vec, float4, 4)
ADAMW(double, adamw_f64, double, 1)
ADAMW(double, adamw_f64_vec, double2, 2)
SGD_KERNEL(float, sgd_f32, float, 1)
SGD_KERNEL(float, sgd_f32_vec, float4, 4)
SGD_KERNEL(double, sgd_f64, double, 1)
SGD_KERNEL(double, sgd_f64_vec, double2, 2)
