/* One-pass AdamW and SGD loops for one element type, included once per type by _fusedc.c.
 *
 * Before each inclusion the includer defines:
 *   T       the element type (float, double),
 *   SQRT    its square root (sqrtf, sqrt),
 *   SUFFIX  the name suffix of the generated functions (f32, f64).
 *
 * Each element of each array is read once and written at most once. The arithmetic is the optimizer graph's, op by
 * op and in its order, in T; the module is compiled with -ffp-contract=off so that no
 * multiply-add is fused and the results equal the graph's separate Mul and Add nodes.
 */

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)

/* m += (g - m)(1 - b1); v = v b2 + g^2 (1 - b2);
 * p += -lr ((m / bc1) / (sqrt(v) / bc2_sqrt + eps) [+ wd p]) */
static inline __attribute__((always_inline)) void CAT(adamw_loop, SUFFIX)(
    T *p, const T *g, T *m, T *v, Py_ssize_t begin, Py_ssize_t end, const T *c, const int decay)
{
    const T one_minus_b1 = c[0], b2 = c[1], one_minus_b2 = c[2], bc1 = c[3], bc2_sqrt = c[4];
    const T eps = c[5], wd = c[6], neg_lr = c[7];
    for (Py_ssize_t i = begin; i < end; i++) {
        const T gi = g[i], pi = p[i];
        const T mi = m[i] + (gi - m[i]) * one_minus_b1;
        const T vi = v[i] * b2 + (gi * gi) * one_minus_b2;
        T u = (mi / bc1) / (SQRT(vi) / bc2_sqrt + eps);
        if (decay) {
            u = u + pi * wd;
        }
        m[i] = mi;
        v[i] = vi;
        p[i] = pi + u * neg_lr;
    }
}

TARGETS static void CAT(adamw, SUFFIX)(const struct adamw_args *a, Py_ssize_t begin, Py_ssize_t end)
{
    T c[8];
    for (int k = 0; k < 8; k++) {
        c[k] = (T)a->coefficients[k];
    }
    T *p = a->param, *m = a->exp_avg, *v = a->exp_avg_sq;
    const T *g = a->grad;
    if (a->decay) {
        CAT(adamw_loop, SUFFIX)(p, g, m, v, begin, end, c, 1);
    } else {
        CAT(adamw_loop, SUFFIX)(p, g, m, v, begin, end, c, 0);
    }
}

/* g' = g [+ wd p]; with momentum b = mu b + g' (or g' at a dampened first step, or
 * mu b + (1 - tau) g'), g' = b or g' + mu b (Nesterov); p += -lr g' */
static inline __attribute__((always_inline)) void CAT(sgd_loop, SUFFIX)(
    T *p, const T *g, T *buf, Py_ssize_t begin, Py_ssize_t end, const T *c, const int decay,
    const int mode)
{
    const T wd = c[0], mu = c[1], one_minus_tau = c[2], neg_lr = c[3];
    for (Py_ssize_t i = begin; i < end; i++) {
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

#define SGD_CASE(MODE)                                                              \
    case MODE:                                                                      \
        if (a->decay) {                                                             \
            CAT(sgd_loop, SUFFIX)(p, g, buf, begin, end, c, 1, MODE);               \
        } else {                                                                    \
            CAT(sgd_loop, SUFFIX)(p, g, buf, begin, end, c, 0, MODE);               \
        }                                                                           \
        break;

TARGETS static void CAT(sgd, SUFFIX)(const struct sgd_args *a, Py_ssize_t begin, Py_ssize_t end)
{
    T c[4];
    for (int k = 0; k < 4; k++) {
        c[k] = (T)a->coefficients[k];
    }
    T *p = a->param, *buf = a->momentum_buffer;
    const T *g = a->grad;
    switch (a->mode) {
        SGD_CASE(SGD_PLAIN)
        SGD_CASE(SGD_MOMENTUM)
        SGD_CASE(SGD_NESTEROV)
        SGD_CASE(SGD_DAMPENED)
        SGD_CASE(SGD_FIRST_DAMPENED)
    }
}

#undef SGD_CASE
#undef CAT
#undef CAT_
