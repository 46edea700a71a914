/* The unfold of a 2-D convolution's input, as the rows of a matrix product (included by
 * _convc.c).
 *
 * cols[(c * KH + i) * KW + j, (n * OH + oh) * OW + ow] = x[n, c, oh * sh - top + i * dh,
 * ow * sw - left + j * dw], 0 where that position is in the padding: the columns whose product
 * with the output gradient [M, N * OH * OW] is a Conv's weight gradient. Each thread writes a
 * share of the rows (c, i, j); a row's runs along ow are copied where the stride is 1. Values
 * are copied, never computed: NaN and infinities stay as they are.
 */

struct unfold {
    const float *x;
    float *cols;
    Py_ssize_t n, c, h, w, kh, kw, oh, ow;
    Py_ssize_t stride[2], pad[2], dilation[2];
};

/* The ow positions [*lo, *hi) whose input column 0 <= ow * s - pad + j * d < w. */
static void unfold_span(Py_ssize_t ow, Py_ssize_t w, Py_ssize_t s, Py_ssize_t start,
                        Py_ssize_t *lo, Py_ssize_t *hi)
{
    Py_ssize_t a = 0, b = ow;
    while (a < b && a * s + start < 0) {
        a++;
    }
    while (b > a && (b - 1) * s + start >= w) {
        b--;
    }
    *lo = a;
    *hi = b;
}

TARGETS static void unfold_rows(const struct unfold *u, Py_ssize_t r0, Py_ssize_t r1)
{
    const Py_ssize_t plane = u->h * u->w, width = u->n * u->oh * u->ow;
    for (Py_ssize_t r = r0; r < r1; r++) {
        const Py_ssize_t c = r / (u->kh * u->kw), i = r / u->kw % u->kh, j = r % u->kw;
        const Py_ssize_t row0 = i * u->dilation[0] - u->pad[0];
        const Py_ssize_t col0 = j * u->dilation[1] - u->pad[1];
        Py_ssize_t lo, hi;
        unfold_span(u->ow, u->w, u->stride[1], col0, &lo, &hi);
        float *out = u->cols + r * width;
        for (Py_ssize_t n = 0; n < u->n; n++) {
            const float *image = u->x + (n * u->c + c) * plane;
            for (Py_ssize_t oh = 0; oh < u->oh; oh++, out += u->ow) {
                const Py_ssize_t ih = oh * u->stride[0] + row0;
                if (ih < 0 || ih >= u->h || lo >= hi) {
                    memset(out, 0, sizeof(float) * (size_t)u->ow);
                    continue;
                }
                const float *in = image + ih * u->w + col0;
                for (Py_ssize_t q = 0; q < lo; q++) {
                    out[q] = 0.0f;
                }
                if (u->stride[1] == 1) {
                    memcpy(out + lo, in + lo, sizeof(float) * (size_t)(hi - lo));
                }
                else {
                    for (Py_ssize_t q = lo; q < hi; q++) {
                        out[q] = in[q * u->stride[1]];
                    }
                }
                for (Py_ssize_t q = hi; q < u->ow; q++) {
                    out[q] = 0.0f;
                }
            }
        }
    }
}

static int unfold_share(const void *arg, int t, int threads)
{
    const struct unfold *u = arg;
    const Py_ssize_t rows = u->c * u->kh * u->kw;
    unfold_rows(u, rows * t / threads, rows * (t + 1) / threads);
    return 0;
}

PyDoc_STRVAR(unfold_doc,
"unfold(x, cols, kernel, grid, strides, pads, dilations, threads)\n--\n\n"
"Write the unfold of ``x`` ``[N, C, H, W]`` for a Conv of ``kernel`` ``(KH, KW)`` and output\n"
"``grid`` ``(OH, OW)`` into ``cols`` ``[C * KH * KW, N * OH * OW]`` (both float32 and\n"
"C-contiguous): row ``(c, i, j)`` holds, for every sample and output position, the input value\n"
"that filter tap ``(i, j)`` of channel ``c`` meets, and 0 in the padding. ``strides``, ``pads``\n"
"(begin) and ``dilations`` are pairs. ``threads`` threads share the rows.");

static PyObject *unfold(PyObject *self, PyObject *args)
{
    PyObject *objects[2];
    Py_ssize_t kh, kw, st[2], pd[2], dl[2], oh, ow;
    int threads;
    if (!PyArg_ParseTuple(args, "OO(nn)(nn)(nn)(nn)(nn)i:unfold", &objects[0], &objects[1], &kh,
                          &kw, &oh, &ow, &st[0], &st[1], &pd[0], &pd[1], &dl[0], &dl[1],
                          &threads)) {
        return NULL;
    }
    Py_buffer views[2];
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    static const char *names[2] = {"x", "cols"};
    for (int k = 0; k < 2; k++) {
        if (float32_array(objects[k], &views[k], k == 0 ? 4 : -1, k == 1, "unfold: array", k,
                          names[k]) < 0) {
            goto done;
        }
        held++;
    }
    const Py_ssize_t *xs = views[0].shape;
    const int fits = views[1].ndim == 2 && kh >= 1 && kw >= 1 && oh >= 0 && ow >= 0 &&
                     st[0] >= 1 && st[1] >= 1 && dl[0] >= 1 && dl[1] >= 1 && pd[0] >= 0 &&
                     pd[1] >= 0 && views[1].shape[0] == xs[1] * kh * kw &&
                     views[1].shape[1] == xs[0] * oh * ow;
    if (!fits) {
        PyErr_Format(PyExc_ValueError,
                     "unfold: x [%zd, %zd, %zd, %zd] with kernel (%zd, %zd), grid (%zd, %zd),"
                     " strides (%zd, %zd), pads (%zd, %zd) and dilations (%zd, %zd) does not fill"
                     " a cols of %zd elements; cols must be [C * KH * KW, N * OH * OW]",
                     xs[0], xs[1], xs[2], xs[3], kh, kw, oh, ow, st[0], st[1], pd[0], pd[1],
                     dl[0], dl[1], views[1].len / 4);
        goto done;
    }
    const struct unfold u = {
        .x = views[0].buf, .cols = views[1].buf, .n = xs[0], .c = xs[1], .h = xs[2], .w = xs[3],
        .kh = kh, .kw = kw, .oh = oh, .ow = ow, .stride = {st[0], st[1]}, .pad = {pd[0], pd[1]},
        .dilation = {dl[0], dl[1]},
    };
    if (views[1].len > 0 && run_shares(unfold_share, &u, views[1].len / 4, threads) < 0) {
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    release_views(views, held);
    return result;
}
