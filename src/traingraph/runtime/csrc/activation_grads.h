/* Elementwise activations' input gradients, and HardSwish itself, one pass each (included by
 * kernels.c, after gelu.h, whose exponential the SiLU's shares).
 *
 * The autodiff rules write each as a chain of onnxruntime ops, one pass over the activation
 * per op (a HardSwish's gradient seven, two of them slow Wheres, a SiLU's six). Here the same
 * float operations in the same order, each rounded to float32 as the graph rounds it (no
 * contraction into fused multiply-adds): the HardSwish's is every element the graph's, NaN
 * and infinities included. The SiLU's computes the Sigmoid itself (reading it would keep the
 * forward's Sigmoid output alive until the backward), as onnxruntime's does at its ends:
 * exactly 0 from x <= -18 and 1 from x >= 18, NaN for NaN.
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

struct hardswish_forward {
    const float *x;
    float *out;
    float alpha, beta;
    Py_ssize_t size;
};

/* out = x * max(min(x * alpha + beta, 1), 0): HardSwish as onnxruntime runs it, a HardSigmoid
 * (the product and the sum rounded apart) and a Mul; a NaN keeps its payload, as there, and a
 * signaling one is quieted by the product (signaling-nans: x * 1 is not x) */
#pragma GCC push_options
#pragma GCC optimize("signaling-nans")
TARGETS static void hardswish_forward_range(const void *arg, Py_ssize_t i0, Py_ssize_t i1)
{
    const struct hardswish_forward *h = arg;
    const float alpha = h->alpha, beta = h->beta;
    const float *restrict x = h->x;
    float *restrict out = h->out;
    for (Py_ssize_t i = i0; i < i1; i++) {
        const float v = x[i];
        float t = v * alpha;
        t = t + beta;
        t = t < 1.0f ? t : 1.0f;
        t = t > 0.0f ? t : 0.0f;
        out[i] = v * t;
    }
}
#pragma GCC pop_options

struct silu {
    const float *x, *g;
    float *out;
    Py_ssize_t size;
};

#define LANES_BODY "silu_lanes.h"
#include "widths.h"
#undef LANES_BODY

#define RELU_GRAD_PARTS 8

struct relu_grad {
    const float *parts[RELU_GRAD_PARTS], *y;
    float *out;
    int count;
};

/* out = (((p0 + p1) + p2) + ...) * (y > 0 ? 1 : 0): a Relu's input gradient as its rule
 * writes it (the cast mask times the gradient), of the Sum of the gradient's parts in the Sum's
 * order: a non-finite gradient times the mask 0 is NaN and a negative one -0, as there */
TARGETS static void relu_grad_range(const void *arg, Py_ssize_t i0, Py_ssize_t i1)
{
    const struct relu_grad *r = arg;
    const float *restrict y = r->y;
    float *restrict out = r->out;
    for (Py_ssize_t i = i0; i < i1; i++) {
        float g = r->parts[0][i];
        for (int k = 1; k < r->count; k++) {
            g = g + r->parts[k][i];
        }
        out[i] = g * (y[i] > 0.0f ? 1.0f : 0.0f);
    }
}

/* The same for the common one- and two-part gradients, whose loops vectorize. */
TARGETS static void relu_grad_one_range(const void *arg, Py_ssize_t i0, Py_ssize_t i1)
{
    const struct relu_grad *r = arg;
    const float *restrict g = r->parts[0], *restrict y = r->y;
    float *restrict out = r->out;
    for (Py_ssize_t i = i0; i < i1; i++) {
        out[i] = g[i] * (y[i] > 0.0f ? 1.0f : 0.0f);
    }
}

TARGETS static void relu_grad_two_range(const void *arg, Py_ssize_t i0, Py_ssize_t i1)
{
    const struct relu_grad *r = arg;
    const float *restrict a = r->parts[0], *restrict b = r->parts[1], *restrict y = r->y;
    float *restrict out = r->out;
    for (Py_ssize_t i = i0; i < i1; i++) {
        out[i] = (a[i] + b[i]) * (y[i] > 0.0f ? 1.0f : 0.0f);
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

PyDoc_STRVAR(hardswish_doc,
"hardswish(x, out, alpha, beta, threads)\n--\n\n"
"Write ``x * max(min(x * alpha + beta, 1), 0)`` into ``out`` (HardSwish as onnxruntime expands\n"
"it: HardSigmoid, then Mul): ``x`` and ``out`` float32 and C-contiguous of one size.\n"
"``threads`` threads share the elements.");

static PyObject *hardswish(PyObject *self, PyObject *args)
{
    PyObject *objects[2];
    float alpha, beta;
    int threads;
    if (!PyArg_ParseTuple(args, "OOffi:hardswish", &objects[0], &objects[1], &alpha, &beta,
                          &threads)) {
        return NULL;
    }
    static const char *const names[2] = {"x", "out"};
    Py_buffer views[2];
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    if (same_size_arrays(objects, views, 2, "hardswish: array", names, &held) == 0) {
        struct hardswish_forward h = {.x = views[0].buf, .out = views[1].buf, .alpha = alpha,
                                      .beta = beta, .size = views[0].len / 4};
        run_elementwise(hardswish_forward_range, &h, h.size, threads);
        result = Py_NewRef(Py_None);
    }
    release_views(views, held);
    return result;
}

PyDoc_STRVAR(silu_grad_doc,
"silu_grad(x, g, out, threads)\n--\n\n"
"Write ``g s + (g x) (s (1 - s))`` into ``out``, ``s = Sigmoid(x)`` (the input gradient of\n"
"``x Sigmoid(x)``; the Sigmoid as onnxruntime's at its ends: 0 from x <= -18, 1 from x >= 18):\n"
"``x``, ``g`` and ``out`` float32 and C-contiguous of one size. ``threads`` threads share the\n"
"elements.");

static PyObject *silu_grad(PyObject *self, PyObject *args)
{
    PyObject *objects[3];
    int threads;
    if (!PyArg_ParseTuple(args, "OOOi:silu_grad", &objects[0], &objects[1], &objects[2],
                          &threads)) {
        return NULL;
    }
    static const char *const names[3] = {"x", "g", "out"};
    Py_buffer views[3];
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    if (same_size_arrays(objects, views, 3, "silu_grad: array", names, &held) == 0) {
        struct silu p = {.x = views[0].buf, .g = views[1].buf, .out = views[2].buf,
                         .size = views[0].len / 4};
        run_elementwise(narrow_blocks ? silu_range_8 : silu_range_16, &p, p.size, threads);
        result = Py_NewRef(Py_None);
    }
    release_views(views, held);
    return result;
}

PyDoc_STRVAR(relu_grad_doc,
"relu_grad(parts, y, out, threads)\n--\n\n"
"Write ``(((p0 + p1) + p2) + ...) * (y > 0 ? 1 : 0)`` into ``out``: a Relu's input gradient\n"
"(``y`` the Relu's output) of the gradient that is the sum of the 1 to 8 arrays ``parts``,\n"
"added in their order. Every array float32 and C-contiguous of one size. ``threads`` threads\n"
"share the elements.");

static PyObject *relu_grad(PyObject *self, PyObject *args)
{
    PyObject *sequence, *y, *out;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOi:relu_grad", &sequence, &y, &out, &threads)) {
        return NULL;
    }
    PyObject *items = PySequence_Fast(sequence, "relu_grad: parts must be a sequence of arrays");
    if (items == NULL) {
        return NULL;
    }
    const Py_ssize_t count = PySequence_Fast_GET_SIZE(items);
    if (count < 1 || count > RELU_GRAD_PARTS) {
        PyErr_Format(PyExc_ValueError, "relu_grad: %zd parts; expected 1 to %d", count,
                     RELU_GRAD_PARTS);
        Py_DECREF(items);
        return NULL;
    }
    static const char *const names[RELU_GRAD_PARTS + 2] = {
        "parts[0]", "parts[1]", "parts[2]", "parts[3]", "parts[4]", "parts[5]", "parts[6]",
        "parts[7]", "y", "out"};
    PyObject *objects[RELU_GRAD_PARTS + 2];
    const char *ordered[RELU_GRAD_PARTS + 2];
    for (Py_ssize_t k = 0; k < count; k++) {
        objects[k] = PySequence_Fast_GET_ITEM(items, k);
        ordered[k] = names[k];
    }
    objects[count] = y;
    objects[count + 1] = out;
    ordered[count] = names[RELU_GRAD_PARTS];
    ordered[count + 1] = names[RELU_GRAD_PARTS + 1];
    Py_buffer views[RELU_GRAD_PARTS + 2];
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    if (same_size_arrays(objects, views, (int)count + 2, "relu_grad: array", ordered, &held) ==
        0) {
        struct relu_grad r = {.y = views[count].buf, .out = views[count + 1].buf,
                              .count = (int)count};
        for (Py_ssize_t k = 0; k < count; k++) {
            r.parts[k] = views[k].buf;
        }
        const Py_ssize_t size = views[0].len / 4;
        run_elementwise(count == 1 ? relu_grad_one_range
                        : count == 2 ? relu_grad_two_range : relu_grad_range,
                        &r, size, threads);
        result = Py_NewRef(Py_None);
    }
    release_views(views, held);
    Py_DECREF(items);
    return result;
}
