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

#define LANES_BODY "gelu_lanes.h"
#include "widths.h"
#undef LANES_BODY

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
    run_elementwise(narrow_blocks ? gelu_range_8 : gelu_range_16, &p, p.size, threads);
    result = Py_NewRef(Py_None);
done:
    release_views(views, held);
    return result;
}
