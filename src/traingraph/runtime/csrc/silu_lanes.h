/* The SiLU's gradient's loop over vectors of LANES floats (included by activation_grads.h
 * once per width, after gelu.h, whose exponential it shares; V, VI, VU, LANES and FN as
 * widths.h defines them). Each lane is computed alone, so both widths give the same
 * results. */

/* Sigmoid(x): 1 / (1 + e) for x >= 0, e / (1 + e) below, e = exp(-|x|), 0 from |x| >= 18 */
static inline __attribute__((always_inline)) V FN(silu_sigmoid)(V x)
{
    const VI magnitude = (VI){0} + INT32_MAX;
    const V a = (V)((VI)x & magnitude), one = (V){0} + 1.0f;
    const V e = FN(gelu_select)(a < 18.0f, FN(gelu_exp)(FN(gelu_select)(a < 18.0f, -a, (V){0})),
                              (V){0});
    const V t = one / (one + e);
    return FN(gelu_select)(x == x, FN(gelu_select)(x >= 0.0f, t, e * t), x);
}

/* out = g s + (g x) (s (1 - s)), s = Sigmoid(x) */
TARGETS static void FN(silu_range)(const void *arg, Py_ssize_t i0, Py_ssize_t i1)
{
    const struct silu *p = arg;
    for (Py_ssize_t i = i0; i < i1; i += LANES) {
        const Py_ssize_t count = i1 - i < LANES ? i1 - i : LANES;
        V x = {0}, g = {0};
        if (count == LANES) {
            x = *(const VU *)(p->x + i);
            g = *(const VU *)(p->g + i);
        }
        else {
            for (Py_ssize_t j = 0; j < count; j++) {
                x[j] = p->x[i + j];
                g[j] = p->g[i + j];
            }
        }
        const V s = FN(silu_sigmoid)(x);
        const V direct = g * s, through = g * x, slope = s * (1.0f - s);
        const V out = direct + through * slope;
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

