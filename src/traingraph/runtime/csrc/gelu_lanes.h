/* GELU's and its gradient's loops over vectors of LANES floats, compiled once per width
 * (gelu.h includes widths.h with this header; V, VI, VU, LANES and FN as widths.h defines
 * them). Each lane is computed alone, so both widths give the same results. */

static inline __attribute__((always_inline)) V FN(gelu_select)(VI m, V yes, V no)
{
    return (V)(((VI)yes & m) | ((VI)no & ~m));
}

/* exp(x) for -87 <= x <= 0 (below, exp(-87)): x = n ln 2 + r, |r| <= ln 2 / 2, exp(r) by
 * Cephes' expf polynomial, 2^n into the exponent bits. */
static inline __attribute__((always_inline)) V FN(gelu_exp)(V x)
{
    const V low = (V){0} - 87.0f;
    x = FN(gelu_select)(x < low, low, x);
    const VI n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, VI); /* x <= 0 */
    const V nf = __builtin_convertvector(n, V);
    const V r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    V p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (V)((n + 127) << 23);
}

/* Phi(a) into *phi_cdf and exp(-a^2 / 2) into *gauss. */
static inline __attribute__((always_inline)) void FN(gelu_phi)(V a, V *phi_cdf, V *gauss)
{
    const VI magnitude = (VI){0} + INT32_MAX; /* all bits but the sign's */
    const V z = (V)((VI)a & magnitude) * 0.70710678118654752f; /* |a| / sqrt 2 */
    const V t = 1.0f / (1.0f + 0.3275911f * z);
    V q = 1.061405429f * t - 1.453152027f;
    q = q * t + 1.421413741f;
    q = q * t - 0.284496736f;
    q = q * t + 0.254829592f;
    /* 0 for an infinite a, as exp(-inf) is in the graph: a phi(a) is then NaN there too */
    *gauss = FN(gelu_select)(z < __builtin_inff(), FN(gelu_exp)(-(z * z)), (V){0});
    const V half_erfc = 0.5f * q * t * *gauss;
    *phi_cdf = FN(gelu_select)(a < 0.0f, half_erfc, 1.0f - half_erfc);
}

/* tanh(u), NaN for NaN. */
static inline __attribute__((always_inline)) V FN(gelu_tanh)(V u)
{
    const VI magnitude = (VI){0} + INT32_MAX;
    const V x = (V)((VI)u & magnitude);
    const VI sign = (VI)u & ~magnitude;
    const V z = x * x;
    V p = -5.70498872745e-3f * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    const V small = x + x * z * p;
    const V e = FN(gelu_exp)(-2.0f * x); /* exp(-87) for x beyond 43.5: then 1 */
    const V large = (1.0f - e) / (1.0f + e);
    const V t = (V)((VI)FN(gelu_select)(x < 0.625f, small, large) | sign);
    return FN(gelu_select)(u == u, t, u);
}

/* The tanh approximation's GELU, or with g its gradient times g. */
static inline __attribute__((always_inline)) V FN(gelu_tanh_form)(V a, const V *g)
{
    const V c = (V){0} + 0.79788456080286536f, k = (V){0} + 0.044715f;
    const V square = a * a;
    const V t = FN(gelu_tanh)(c * (a + k * (square * a)));
    const V half = a * 0.5f;
    if (g == NULL) {
        return half * (1.0f + t);
    }
    const V dt = *g * half * (1.0f - t * t);
    return *g * (0.5f * (1.0f + t)) + dt * c * (1.0f + k * (3.0f * square));
}

TARGETS static void FN(gelu_range)(const void *arg, Py_ssize_t i0, Py_ssize_t i1)
{
    const struct gelu *p = arg;
    for (Py_ssize_t i = i0; i < i1; i += LANES) {
        V a = {0}, g = {0}, mask = {0};
        const Py_ssize_t count = i1 - i < LANES ? i1 - i : LANES;
        if (count == LANES) {
            a = *(const VU *)(p->a + i);
            if (p->g != NULL) {
                g = *(const VU *)(p->g + i);
            }
            if (p->mask != NULL) {
                mask = *(const VU *)(p->mask + i);
            }
        }
        else {
            for (Py_ssize_t j = 0; j < count; j++) {
                a[j] = p->a[i + j];
                g[j] = p->g != NULL ? p->g[i + j] : 0.0f;
                mask[j] = p->mask != NULL ? p->mask[i + j] : 0.0f;
            }
        }
        V out;
        if (p->tanh) {
            out = FN(gelu_tanh_form)(a, p->g != NULL ? &g : NULL);
        }
        else {
            V cdf, gauss;
            FN(gelu_phi)(a, &cdf, &gauss);
            out = p->g == NULL ? a * cdf : g * (cdf + a * gauss * 0.39894228040143268f);
        }
        if (p->mask != NULL) {
            out *= mask;
        }
        if (count == LANES) {
            *(VU *)(p->out + i) = out;
        }
        else {
            for (Py_ssize_t j = 0; j < count; j++) {
                p->out[i + j] = out[j];
            }
        }
    }
}

