/* The gradient of a 2-D MaxPool of any window, routed in place (included by _convc.c).
 *
 * The training graph writes it as a second MaxPool that returns the flat position of each
 * window's maximum, and a ScatterElements that adds the output gradient at those positions
 * into zeros. onnxruntime's MaxPool with positions is a scalar loop, and the scatter a pass
 * over int64 positions. Here each plane's windows are walked in order as onnxruntime's MaxPool
 * walks them: a window's maximum is its first element inside the input, replaced by each later
 * one strictly greater (so a NaN is chosen only where it comes first, as there), and the
 * window's gradient is added there. A plane's windows go to that plane only, in the order the
 * scatter takes them, so every sum is the graph's, added in the graph's order.
 */

struct mpg {
    const float *x, *g;
    float *dx;
    Py_ssize_t planes, h, w, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw;
    atomic_long *empty; /* windows that hold no input element */
};

static int mpg_share(const void *arg, int t, int threads)
{
    const struct mpg *p = arg;
    const Py_ssize_t plane = p->h * p->w;
    long empty = 0;
    for (Py_ssize_t c = p->planes * t / threads; c < p->planes * (t + 1) / threads; c++) {
        const float *x = p->x + c * plane, *g = p->g + c * p->oh * p->ow;
        float *dx = p->dx + c * plane;
        memset(dx, 0, sizeof(float) * (size_t)plane);
        for (Py_ssize_t i = 0; i < p->oh; i++) {
            const Py_ssize_t h0 = i * p->sh - p->ph;
            const int rows_inside = h0 >= 0 && h0 + (p->kh - 1) * p->dh < p->h;
            for (Py_ssize_t j = 0; j < p->ow; j++) {
                const Py_ssize_t w0 = j * p->sw - p->pw;
                if (rows_inside && w0 >= 0 && w0 + (p->kw - 1) * p->dw < p->w) {
                    /* a window inside the plane: its first element, then each strictly
                     * greater one, chosen without branches */
                    Py_ssize_t at = h0 * p->w + w0;
                    float best = x[at];
                    for (Py_ssize_t a = 0; a < p->kh; a++) {
                        const Py_ssize_t row = (h0 + a * p->dh) * p->w + w0;
                        for (Py_ssize_t b = a == 0; b < p->kw; b++) {
                            const Py_ssize_t q = row + b * p->dw;
                            const float v = x[q];
                            const int greater = v > best;
                            best = greater ? v : best;
                            at = greater ? q : at;
                        }
                    }
                    dx[at] += g[i * p->ow + j];
                    continue;
                }
                Py_ssize_t at = -1;
                float best = 0.0f;
                for (Py_ssize_t a = 0; a < p->kh; a++) {
                    const Py_ssize_t r = h0 + a * p->dh;
                    if (r < 0 || r >= p->h) {
                        continue;
                    }
                    for (Py_ssize_t b = 0; b < p->kw; b++) {
                        const Py_ssize_t q = w0 + b * p->dw;
                        if (q < 0 || q >= p->w) {
                            continue;
                        }
                        const float v = x[r * p->w + q];
                        if (at < 0 || v > best) {
                            best = v;
                            at = r * p->w + q;
                        }
                    }
                }
                if (at < 0) {
                    empty++;
                    continue;
                }
                dx[at] += g[i * p->ow + j];
            }
        }
    }
    (void)threads;
    if (empty) {
        atomic_fetch_add(p->empty, empty);
    }
    return 0;
}

PyDoc_STRVAR(max_pool_grad_doc,
"max_pool_grad(x, g, dx, kernel, strides, pads, dilations, threads)\n--\n\n"
"Write into ``dx`` (float32, C-contiguous, ``x``'s shape ``[N, C, H, W]``) the gradient of\n"
"``MaxPool(x)`` given that of its output, ``g`` ``[N, C, OH, OW]``: each window's ``g`` added\n"
"at its maximum (the first element inside ``x``, replaced by each later one strictly\n"
"greater), in the windows' order, into zeros. ``kernel``, ``strides``, ``pads`` (the begin\n"
"pads) and ``dilations`` are pairs. Raises ValueError where a window holds no element of\n"
"``x``. ``threads`` threads share the planes.");

static PyObject *max_pool_grad(PyObject *self, PyObject *args)
{
    PyObject *objects[3];
    Py_ssize_t kh, kw, sh, sw, ph, pw, dh, dw;
    int threads;
    if (!PyArg_ParseTuple(args, "OOO(nn)(nn)(nn)(nn)i:max_pool_grad", &objects[0], &objects[1],
                          &objects[2], &kh, &kw, &sh, &sw, &ph, &pw, &dh, &dw, &threads)) {
        return NULL;
    }
    static const char *names[3] = {"x", "g", "dx"};
    Py_buffer views[3];
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    for (; held < 3; held++) {
        if (float32_array(objects[held], &views[held], 4, held == 2, "max_pool_grad: argument",
                          held, names[held]) < 0) {
            goto done;
        }
    }
    const Py_ssize_t *xs = views[0].shape, *gs = views[1].shape, *ds = views[2].shape;
    int fits = kh >= 1 && kw >= 1 && sh >= 1 && sw >= 1 && ph >= 0 && pw >= 0 && dh >= 1 &&
               dw >= 1 && gs[0] == xs[0] && gs[1] == xs[1];
    for (int k = 0; k < 4; k++) {
        fits = fits && ds[k] == xs[k];
    }
    if (!fits) {
        PyErr_Format(PyExc_ValueError,
                     "max_pool_grad: x [%zd, %zd, %zd, %zd], g [%zd, %zd, %zd, %zd] and dx [%zd,"
                     " %zd, %zd, %zd] with kernel (%zd, %zd), strides (%zd, %zd), pads (%zd, %zd)"
                     " and dilations (%zd, %zd); expected dx of x's shape, g of x's batch and"
                     " channels, kernel, strides and dilations of 1 or more and pads of 0 or more",
                     xs[0], xs[1], xs[2], xs[3], gs[0], gs[1], gs[2], gs[3], ds[0], ds[1], ds[2],
                     ds[3], kh, kw, sh, sw, ph, pw, dh, dw);
        goto done;
    }
    atomic_long empty = 0;
    const struct mpg p = {
        .x = views[0].buf, .g = views[1].buf, .dx = views[2].buf, .planes = xs[0] * xs[1],
        .h = xs[2], .w = xs[3], .oh = gs[2], .ow = gs[3], .kh = kh, .kw = kw, .sh = sh, .sw = sw,
        .ph = ph, .pw = pw, .dh = dh, .dw = dw, .empty = &empty,
    };
    if (p.planes * p.h * p.w < ROUTE_PER_THREAD || threads < 1) {
        threads = 1;
    }
    Py_BEGIN_ALLOW_THREADS
    pool_run(mpg_share, &p, threads);
    Py_END_ALLOW_THREADS
    if (atomic_load(&empty)) {
        PyErr_Format(PyExc_ValueError,
                     "max_pool_grad: %ld windows of (%zd, %zd) hold no element of x [%zd, %zd,"
                     " %zd, %zd]; the graph routes them outside their plane: run it as written",
                     (long)atomic_load(&empty), kh, kw, xs[0], xs[1], xs[2], xs[3]);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    release_views(views, held);
    return result;
}
