/* GELU and its gradient, element by element (included by _convc.c).
 *
 * GELU(a) = a Phi(a), Phi(a) = (1 + erf(a / sqrt 2)) / 2, and dGELU/da = Phi(a) + a phi(a),
 * phi(a) = exp(-a^2 / 2) / sqrt(2 pi). erfc(z) for z >= 0 is Abramowitz and Stegun's 7.1.26,
 * t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) exp(-z^2) with t = 1 / (1 + p z), within 1.5e-7 of
 * it (about what 1 + erf(z) keeps of erf in float32 where erf is near -1); Phi(a) is half of
 * erfc(|a| / sqrt 2), or 1 minus that for a >= 0. The exponential is shared with phi.
 *
 * The tanh approximation, GELU(a) = (a / 2) (1 + t), t = tanh(u), u = c (a + k a^3), c =
 * sqrt(2 / pi), k = 0.044715, has the gradient (1 + t) / 2 + (a / 2) (1 - t^2) c (1 + 3 k a^2),
 * the products grouped as the graph's gradient groups them, so that a product of zero and an
 * infinity is NaN where the graph's is (1 - t^2 is 0 where |a| is large, and a^2 infinite
 * beyond 1.8e19). tanh is Cephes' odd polynomial below 0.625 and (1 - e) / (1 + e), e =
 * exp(-2 |u|), above: within 2 units in the last place. */

struct gelu {
    const float *a, *g; /* g: the output's gradient, or NULL for the forward */
    const float *mask;  /* a factor of GELU's output (a Dropout's mask), or NULL */
    float *out;
    Py_ssize_t size;
    int tanh; /* the tanh approximation */
};

static inline __attribute__((always_inline)) v16 gelu_select(v16i m, v16 yes, v16 no)
{
    return (v16)(((v16i)yes & m) | ((v16i)no & ~m));
}

/* exp(x) for -87 <= x <= 0 (below, exp(-87)): x = n ln 2 + r, |r| <= ln 2 / 2, exp(r) by
 * Cephes' expf polynomial, 2^n into the exponent bits. */
static inline __attribute__((always_inline)) v16 gelu_exp(v16 x)
{
    const v16 low = (v16){0} - 87.0f;
    x = gelu_select(x < low, low, x);
    const v16i n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, v16i); /* x <= 0 */
    const v16 nf = __builtin_convertvector(n, v16);
    const v16 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    v16 p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (v16)((n + 127) << 23);
}

/* Phi(a) into *phi_cdf and exp(-a^2 / 2) into *gauss. */
static inline __attribute__((always_inline)) void gelu_phi(v16 a, v16 *phi_cdf, v16 *gauss)
{
    const v16i magnitude = (v16i){0} + INT32_MAX; /* all bits but the sign's */
    const v16 z = (v16)((v16i)a & magnitude) * 0.70710678118654752f; /* |a| / sqrt 2 */
    const v16 t = 1.0f / (1.0f + 0.3275911f * z);
    v16 q = 1.061405429f * t - 1.453152027f;
    q = q * t + 1.421413741f;
    q = q * t - 0.284496736f;
    q = q * t + 0.254829592f;
    /* 0 for an infinite a, as exp(-inf) is in the graph: a phi(a) is then NaN there too */
    *gauss = gelu_select(z < __builtin_inff(), gelu_exp(-(z * z)), (v16){0});
    const v16 half_erfc = 0.5f * q * t * *gauss;
    *phi_cdf = gelu_select(a < 0.0f, half_erfc, 1.0f - half_erfc);
}

/* tanh(u), NaN for NaN. */
static inline __attribute__((always_inline)) v16 gelu_tanh(v16 u)
{
    const v16i magnitude = (v16i){0} + INT32_MAX;
    const v16 x = (v16)((v16i)u & magnitude);
    const v16i sign = (v16i)u & ~magnitude;
    const v16 z = x * x;
    v16 p = -5.70498872745e-3f * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    const v16 small = x + x * z * p;
    const v16 e = gelu_exp(-2.0f * x); /* exp(-87) for x beyond 43.5: then 1 */
    const v16 large = (1.0f - e) / (1.0f + e);
    const v16 t = (v16)((v16i)gelu_select(x < 0.625f, small, large) | sign);
    return gelu_select(u == u, t, u);
}

/* The tanh approximation's GELU, or with g its gradient times g. */
static inline __attribute__((always_inline)) v16 gelu_tanh_form(v16 a, const v16 *g)
{
    const v16 c = (v16){0} + 0.79788456080286536f, k = (v16){0} + 0.044715f;
    const v16 square = a * a;
    const v16 t = gelu_tanh(c * (a + k * (square * a)));
    const v16 half = a * 0.5f;
    if (g == NULL) {
        return half * (1.0f + t);
    }
    const v16 dt = *g * half * (1.0f - t * t);
    return *g * (0.5f * (1.0f + t)) + dt * c * (1.0f + k * (3.0f * square));
}

TARGETS static void gelu_range(const void *arg, Py_ssize_t i0, Py_ssize_t i1)
{
    const struct gelu *p = arg;
    for (Py_ssize_t i = i0; i < i1; i += 16) {
        v16 a = {0}, g = {0}, mask = {0};
        const Py_ssize_t count = i1 - i < 16 ? i1 - i : 16;
        if (count == 16) {
            a = *(const v16u *)(p->a + i);
            if (p->g != NULL) {
                g = *(const v16u *)(p->g + i);
            }
            if (p->mask != NULL) {
                mask = *(const v16u *)(p->mask + i);
            }
        }
        else {
            for (Py_ssize_t j = 0; j < count; j++) {
                a[j] = p->a[i + j];
                g[j] = p->g != NULL ? p->g[i + j] : 0.0f;
                mask[j] = p->mask != NULL ? p->mask[i + j] : 0.0f;
            }
        }
        v16 out;
        if (p->tanh) {
            out = gelu_tanh_form(a, p->g != NULL ? &g : NULL);
        }
        else {
            v16 cdf, gauss;
            gelu_phi(a, &cdf, &gauss);
            out = p->g == NULL ? a * cdf : g * (cdf + a * gauss * 0.39894228040143268f);
        }
        if (p->mask != NULL) {
            out *= mask;
        }
        if (count == 16) {
            *(v16u *)(p->out + i) = out;
        }
        else {
            for (Py_ssize_t j = 0; j < count; j++) {
                p->out[i + j] = out[j];
            }
        }
    }
}

PyDoc_STRVAR(gelu_doc,
"gelu(a, g, out, threads, mask=None, tanh=False)\n--\n\n"
"Write into ``out`` (float32, C-contiguous, ``a``'s size) GELU(a) = a Phi(a) of the float32\n"
"array ``a`` where ``g`` is None, else the gradient ``g * (Phi(a) + a phi(a))`` for the\n"
"output's gradient ``g`` (``a``'s size), with Phi and phi the standard normal's distribution\n"
"and density (erf within 1.5e-7); times ``mask`` (``a``'s size) where given: GELU's output\n"
"times a Dropout's mask, and its gradient for the product's. With ``tanh``, the tanh\n"
"approximation (a / 2) (1 + tanh(sqrt(2 / pi) (a + 0.044715 a^3))) and its gradient instead.\n"
"``threads`` threads share the elements (one below 64K).");

static PyObject *gelu(PyObject *self, PyObject *args)
{
    PyObject *objects[4] = {NULL, NULL, NULL, Py_None};
    int threads, tanh = 0;
    if (!PyArg_ParseTuple(args, "OOOi|Op:gelu", &objects[0], &objects[1], &objects[2], &threads,
                          &objects[3], &tanh)) {
        return NULL;
    }
    static const char *names[4] = {"a", "g", "out", "mask"};
    Py_buffer views[4];
    const float *bufs[4] = {NULL};
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    for (int k = 0; k < 4; k++) {
        if ((k == 1 || k == 3) && objects[k] == Py_None) {
            continue;
        }
        if (float32_array(objects[k], &views[held], -1, k == 2, "gelu: argument", k, names[k]) <
            0) {
            goto done;
        }
        bufs[k] = views[held].buf;
        if (views[held].len != views[0].len) {
            PyErr_Format(PyExc_ValueError,
                         "gelu: %s has %zd elements, a has %zd; pass arrays of a's size",
                         names[k], views[held].len / 4, views[0].len / 4);
            held++;
            goto done;
        }
        held++;
    }
    struct gelu p = {.a = bufs[0], .g = bufs[1], .mask = bufs[3], .out = (float *)bufs[2],
                     .size = views[0].len / 4, .tanh = tanh};
    run_elementwise(gelu_range, &p, p.size, threads);
    result = Py_NewRef(Py_None);
done:
    release_views(views, held);
    return result;
}
