/* The input gradient of a Clip with both bounds (included by _convc.c).
 *
 * The graph writes it as Where(Or(Less(x, lo), Greater(x, hi)), fill, g): three passes that
 * write boolean masks and a fourth that selects. Here one pass: out = fill where x < lo or
 * x > hi, else g, with the same comparisons (false for a NaN x, which keeps g), so that every
 * element is the one the graph selects, NaN and infinities included.
 */

struct clip {
    const float *x, *g;
    float *out;
    float lo, hi, fill;
    Py_ssize_t size;
};

TARGETS static void clip_range(const void *arg, Py_ssize_t i0, Py_ssize_t i1)
{
    const struct clip *c = arg;
    const float lo = c->lo, hi = c->hi, fill = c->fill;
    const float *restrict x = c->x, *restrict g = c->g;
    float *restrict out = c->out;
    for (Py_ssize_t i = i0; i < i1; i++) {
        out[i] = (x[i] < lo) | (x[i] > hi) ? fill : g[i];
    }
}

PyDoc_STRVAR(clip_grad_doc,
"clip_grad(x, lo, hi, fill, g, out, threads)\n--\n\n"
"Write ``Where(Or(Less(x, lo), Greater(x, hi)), fill, g)`` into ``out``: ``x``, ``g`` and\n"
"``out`` float32 and C-contiguous of one size, ``lo``, ``hi`` and ``fill`` float32 arrays of\n"
"one element. ``threads`` threads share the elements.");

static PyObject *clip_grad(PyObject *self, PyObject *args)
{
    PyObject *objects[6];
    int threads;
    if (!PyArg_ParseTuple(args, "OOOOOOi:clip_grad", &objects[0], &objects[1], &objects[2],
                          &objects[3], &objects[4], &objects[5], &threads)) {
        return NULL;
    }
    static const char *names[6] = {"x", "lo", "hi", "fill", "g", "out"};
    Py_buffer views[6];
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    for (int k = 0; k < 6; k++) {
        if (float32_array(objects[k], &views[k], -1, k == 5, "clip_grad: array", k, names[k]) < 0) {
            goto done;
        }
        held++;
    }
    const Py_ssize_t size = views[0].len / 4;
    if (views[4].len / 4 != size || views[5].len / 4 != size || views[1].len != 4 ||
        views[2].len != 4 || views[3].len != 4) {
        PyErr_Format(PyExc_ValueError,
                     "clip_grad: x, g and out have %zd, %zd and %zd elements and lo, hi and fill"
                     " %zd, %zd and %zd; expected one size for the first three and one element"
                     " each for the others",
                     size, views[4].len / 4, views[5].len / 4, views[1].len / 4,
                     views[2].len / 4, views[3].len / 4);
        goto done;
    }
    struct clip c = {.x = views[0].buf, .g = views[4].buf, .out = views[5].buf,
                     .lo = *(const float *)views[1].buf, .hi = *(const float *)views[2].buf,
                     .fill = *(const float *)views[3].buf, .size = size};
    run_elementwise(clip_range, &c, size, threads);
    result = Py_NewRef(Py_None);
done:
    release_views(views, held);
    return result;
}
