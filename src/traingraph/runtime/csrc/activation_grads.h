/* Input gradients of elementwise activations, one pass each (included by kernels.c).
 *
 * The autodiff rules write each as a chain of onnxruntime ops, one pass over the activation
 * per op (a HardSwish's gradient seven, two of them slow Wheres, a SiLU's six). Here the same
 * float operations in the same order, each rounded to float32 as the graph rounds it (no
 * contraction into fused multiply-adds), so every element is the graph's, NaN and infinities
 * included.
 */

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

struct hardswish {
    const float *x, *g;
    float *out;
    float lo, hi, below, above, divisor, offset;
    Py_ssize_t size;
};

/* out = g * Where(x < lo, below, Where(x > hi, above, x / divisor + offset)) */
TARGETS static void hardswish_range(const void *arg, Py_ssize_t i0, Py_ssize_t i1)
{
    const struct hardswish *h = arg;
    const float lo = h->lo, hi = h->hi, below = h->below, above = h->above;
    const float divisor = h->divisor, offset = h->offset;
    const float *restrict x = h->x, *restrict g = h->g;
    float *restrict out = h->out;
    for (Py_ssize_t i = i0; i < i1; i++) {
        const float v = x[i], middle = v / divisor + offset;
        const float slope = v < lo ? below : (v > hi ? above : middle);
        out[i] = g[i] * slope;
    }
}

struct silu {
    const float *x, *s, *g;
    float *out;
    Py_ssize_t size;
};

/* out = g s + (g x) (s (1 - s)), with s = Sigmoid(x) read, not recomputed */
TARGETS static void silu_range(const void *arg, Py_ssize_t i0, Py_ssize_t i1)
{
    const struct silu *p = arg;
    const float *restrict x = p->x, *restrict s = p->s, *restrict g = p->g;
    float *restrict out = p->out;
    for (Py_ssize_t i = i0; i < i1; i++) {
        const float direct = g[i] * s[i], through = g[i] * x[i];
        const float slope = s[i] * (1.0f - s[i]);
        out[i] = direct + through * slope;
    }
}

#pragma GCC pop_options

/* Views of `count` float32 C-contiguous arrays of one size (the last one written); -1 with an
 * exception set where one is not. */
static int same_size_arrays(PyObject **objects, Py_buffer *views, int count, const char *function,
                            const char *const *names, Py_ssize_t *held)
{
    for (int k = 0; k < count; k++) {
        if (float32_array(objects[k], &views[k], -1, k == count - 1, function, k, names[k]) < 0) {
            return -1;
        }
        (*held)++;
    }
    for (int k = 1; k < count; k++) {
        if (views[k].len != views[0].len) {
            PyErr_Format(PyExc_ValueError,
                         "%s: %s has %zd elements and %s %zd; expected arrays of one size",
                         function, names[0], views[0].len / 4, names[k], views[k].len / 4);
            return -1;
        }
    }
    return 0;
}

PyDoc_STRVAR(hardswish_grad_doc,
"hardswish_grad(x, g, out, lo, hi, below, above, divisor, offset, threads)\n--\n\n"
"Write ``g * Where(x < lo, below, Where(x > hi, above, x / divisor + offset))`` into ``out``\n"
"(a HardSwish's input gradient: lo -3, hi 3, below 0, above 1, divisor 3, offset 0.5):\n"
"``x``, ``g`` and ``out`` float32 and C-contiguous of one size. ``threads`` threads share the\n"
"elements.");

static PyObject *hardswish_grad(PyObject *self, PyObject *args)
{
    PyObject *objects[3];
    float lo, hi, below, above, divisor, offset;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOffffffi:hardswish_grad", &objects[0], &objects[1],
                          &objects[2], &lo, &hi, &below, &above, &divisor, &offset, &threads)) {
        return NULL;
    }
    static const char *const names[3] = {"x", "g", "out"};
    Py_buffer views[3];
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    if (same_size_arrays(objects, views, 3, "hardswish_grad: array", names, &held) == 0) {
        struct hardswish h = {.x = views[0].buf, .g = views[1].buf, .out = views[2].buf,
                              .lo = lo, .hi = hi, .below = below, .above = above,
                              .divisor = divisor, .offset = offset, .size = views[0].len / 4};
        run_elementwise(hardswish_range, &h, h.size, threads);
        result = Py_NewRef(Py_None);
    }
    release_views(views, held);
    return result;
}

PyDoc_STRVAR(silu_grad_doc,
"silu_grad(x, s, g, out, threads)\n--\n\n"
"Write ``g s + (g x) (s (1 - s))`` into ``out`` (the input gradient of ``x Sigmoid(x)``, with\n"
"``s`` the Sigmoid's output): ``x``, ``s``, ``g`` and ``out`` float32 and C-contiguous of one\n"
"size. ``threads`` threads share the elements.");

static PyObject *silu_grad(PyObject *self, PyObject *args)
{
    PyObject *objects[4];
    int threads;
    if (!PyArg_ParseTuple(args, "OOOOi:silu_grad", &objects[0], &objects[1], &objects[2],
                          &objects[3], &threads)) {
        return NULL;
    }
    static const char *const names[4] = {"x", "s", "g", "out"};
    Py_buffer views[4];
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    if (same_size_arrays(objects, views, 4, "silu_grad: array", names, &held) == 0) {
        struct silu p = {.x = views[0].buf, .s = views[1].buf, .g = views[2].buf,
                         .out = views[3].buf, .size = views[0].len / 4};
        run_elementwise(silu_range, &p, p.size, threads);
        result = Py_NewRef(Py_None);
    }
    release_views(views, held);
    return result;
}
