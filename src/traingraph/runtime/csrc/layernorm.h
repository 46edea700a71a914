/* The gradient of a LayerNormalization over the last axis (included by _convc.c).
 *
 * A row x of d elements, with mean m, r = 1 / sqrt(var + eps), xh = (x - m) r and the output's
 * gradient dy, has g = dy scale and
 *     dx = r (g - mean(g) - xh mean(g xh)),   dscale += dy xh,   dbias += dy,
 * the last two summed over the rows. A row is read three times while it is in the cache: its
 * mean, then its variance and the two means of g, then dx and the sums. Each thread sums its
 * rows' dscale and dbias in float over blocks of LN_BLOCK rows, and the blocks in double. */

#define LN_BLOCK 64

struct lng {
    const float *x, *dy, *scale;
    float *dx, *dscale, *dbias; /* dx, dscale may be NULL */
    Py_ssize_t rows, d;
    double eps;
    float *block;    /* per thread: 2 d floats, a block's sums */
    double *partial; /* per thread: 2 d doubles, the thread's sums */
};

TARGETS static void lng_rows(const struct lng *p, Py_ssize_t r0, Py_ssize_t r1, float *block,
                             double *partial)
{
    const Py_ssize_t d = p->d;
    const float inv_d = 1.0f / (float)d;
    float *bs = block, *bb = block + d;
    for (Py_ssize_t j = 0; j < 2 * d; j++) {
        block[j] = 0.0f;
    }
    for (Py_ssize_t row = r0; row < r1; row++) {
        const float *x = p->x + row * d, *dy = p->dy + row * d, *scale = p->scale;
        v16 s = {0};
        float ts = 0.0f;
        Py_ssize_t i = 0;
        for (; i + 16 <= d; i += 16) {
            s += *(const v16u *)(x + i);
        }
        for (; i < d; i++) {
            ts += x[i];
        }
        const float mean = (hsum(s) + ts) * inv_d;
        v16 sv = {0}, sg = {0}, sgc = {0};
        float tv = 0.0f, tg = 0.0f, tgc = 0.0f;
        for (i = 0; i + 16 <= d; i += 16) {
            const v16 c = *(const v16u *)(x + i) - mean;
            const v16 g = *(const v16u *)(dy + i) * *(const v16u *)(scale + i);
            sv += c * c;
            sg += g;
            sgc += g * c;
        }
        for (; i < d; i++) {
            const float c = x[i] - mean, g = dy[i] * scale[i];
            tv += c * c;
            tg += g;
            tgc += g * c;
        }
        const float r = (float)(1.0 / sqrt((double)((hsum(sv) + tv) * inv_d) + p->eps));
        const float mean_g = (hsum(sg) + tg) * inv_d;
        const float k = (hsum(sgc) + tgc) * inv_d * r * r; /* mean(g xh) r */
        if (p->dx != NULL) {
            float *dx = p->dx + row * d;
            for (i = 0; i + 16 <= d; i += 16) {
                const v16 c = *(const v16u *)(x + i) - mean;
                const v16 g = *(const v16u *)(dy + i) * *(const v16u *)(scale + i);
                *(v16u *)(dx + i) = r * (g - mean_g - c * k);
            }
            for (; i < d; i++) {
                dx[i] = r * (dy[i] * scale[i] - mean_g - (x[i] - mean) * k);
            }
        }
        for (i = 0; i + 16 <= d; i += 16) {
            const v16 g = *(const v16u *)(dy + i);
            *(v16u *)(bs + i) += g * ((*(const v16u *)(x + i) - mean) * r);
            *(v16u *)(bb + i) += g;
        }
        for (; i < d; i++) {
            bs[i] += dy[i] * ((x[i] - mean) * r);
            bb[i] += dy[i];
        }
        if ((row - r0) % LN_BLOCK == LN_BLOCK - 1 || row == r1 - 1) {
            for (Py_ssize_t j = 0; j < 2 * d; j++) {
                partial[j] += block[j];
                block[j] = 0.0f;
            }
        }
    }
}

/* lng_rows for narrow_blocks: each v16 as two v8 halves, the same sums in the same order */
TARGETS static void lng_rows_narrow(const struct lng *p, Py_ssize_t r0, Py_ssize_t r1,
                                    float *block, double *partial)
{
    const Py_ssize_t d = p->d;
    const float inv_d = 1.0f / (float)d;
    float *bs = block, *bb = block + d;
    for (Py_ssize_t j = 0; j < 2 * d; j++) {
        block[j] = 0.0f;
    }
    for (Py_ssize_t row = r0; row < r1; row++) {
        const float *x = p->x + row * d, *dy = p->dy + row * d, *scale = p->scale;
        v8 s[2] = {{0}};
        float ts = 0.0f;
        Py_ssize_t i = 0;
        for (; i + 16 <= d; i += 16) {
            s[0] += *(const v8u *)(x + i);
            s[1] += *(const v8u *)(x + i + 8);
        }
        for (; i < d; i++) {
            ts += x[i];
        }
        const float mean = (hsum8x2(s[0], s[1]) + ts) * inv_d;
        v8 sv[2] = {{0}}, sg[2] = {{0}}, sgc[2] = {{0}};
        float tv = 0.0f, tg = 0.0f, tgc = 0.0f;
        for (i = 0; i + 16 <= d; i += 16) {
            for (int h = 0; h < 2; h++) {
                const Py_ssize_t j = i + 8 * h;
                const v8 c = *(const v8u *)(x + j) - mean;
                const v8 g = *(const v8u *)(dy + j) * *(const v8u *)(scale + j);
                sv[h] += c * c;
                sg[h] += g;
                sgc[h] += g * c;
            }
        }
        for (; i < d; i++) {
            const float c = x[i] - mean, g = dy[i] * scale[i];
            tv += c * c;
            tg += g;
            tgc += g * c;
        }
        const float r =
            (float)(1.0 / sqrt((double)((hsum8x2(sv[0], sv[1]) + tv) * inv_d) + p->eps));
        const float mean_g = (hsum8x2(sg[0], sg[1]) + tg) * inv_d;
        const float k = (hsum8x2(sgc[0], sgc[1]) + tgc) * inv_d * r * r;
        if (p->dx != NULL) {
            float *dx = p->dx + row * d;
            for (i = 0; i + 16 <= d; i += 16) {
                for (int h = 0; h < 2; h++) {
                    const Py_ssize_t j = i + 8 * h;
                    const v8 c = *(const v8u *)(x + j) - mean;
                    const v8 g = *(const v8u *)(dy + j) * *(const v8u *)(scale + j);
                    *(v8u *)(dx + j) = r * (g - mean_g - c * k);
                }
            }
            for (; i < d; i++) {
                dx[i] = r * (dy[i] * scale[i] - mean_g - (x[i] - mean) * k);
            }
        }
        for (i = 0; i + 16 <= d; i += 16) {
            for (int h = 0; h < 2; h++) {
                const Py_ssize_t j = i + 8 * h;
                const v8 g = *(const v8u *)(dy + j);
                *(v8u *)(bs + j) += g * ((*(const v8u *)(x + j) - mean) * r);
                *(v8u *)(bb + j) += g;
            }
        }
        for (; i < d; i++) {
            bs[i] += dy[i] * ((x[i] - mean) * r);
            bb[i] += dy[i];
        }
        if ((row - r0) % LN_BLOCK == LN_BLOCK - 1 || row == r1 - 1) {
            for (Py_ssize_t j = 0; j < 2 * d; j++) {
                partial[j] += block[j];
                block[j] = 0.0f;
            }
        }
    }
}

static int lng_share(const void *arg, int t, int threads)
{
    const struct lng *p = arg;
    (narrow_blocks ? lng_rows_narrow : lng_rows)(p, p->rows * t / threads,
                                                 p->rows * (t + 1) / threads,
                                                 p->block + 2 * p->d * t,
                                                 p->partial + 2 * p->d * t);
    return 0;
}

PyDoc_STRVAR(layer_norm_grad_doc,
"layer_norm_grad(x, dy, scale, dx, dscale, dbias, epsilon, threads)\n--\n\n"
"The gradient of a LayerNormalization over the last axis of ``x`` (float32, C-contiguous),\n"
"with ``scale`` of the last axis' size, given ``dy``, the gradient of its output (``x``'s\n"
"shape). Writes ``dx`` (``x``'s shape) and ``dscale``, ``dbias`` (the last axis' size), each\n"
"of ``dx`` and ``dscale`` unless it is None; ``threads`` threads share the rows.");

static PyObject *layer_norm_grad(PyObject *self, PyObject *args)
{
    PyObject *objects[6];
    double eps;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOOOOdi:layer_norm_grad", &objects[0], &objects[1],
                          &objects[2], &objects[3], &objects[4], &objects[5], &eps, &threads)) {
        return NULL;
    }
    static const char *names[6] = {"x", "dy", "scale", "dx", "dscale", "dbias"};
    Py_buffer views[6];
    int held[6] = {0};
    PyObject *result = NULL;
    float *block = NULL;
    double *partial = NULL;
    for (int k = 0; k < 6; k++) {
        if ((k == 3 || k == 4) && objects[k] == Py_None) {
            continue; /* dx or dscale not wanted */
        }
        if (float32_array(objects[k], &views[k], -1, k >= 3, "layer_norm_grad: argument", k,
                          names[k]) < 0) {
            goto done;
        }
        held[k] = 1;
    }
    const Py_buffer *x = &views[0];
    const Py_ssize_t d = x->ndim >= 1 ? x->shape[x->ndim - 1] : 0;
    int fits = x->ndim >= 1 && d > 0;
    for (int k = 1; k < 6 && fits; k++) {
        if (held[k]) {
            fits = (k == 1 || k == 3) ? views[k].len == x->len : views[k].len == d * 4;
        }
    }
    if (!fits) {
        PyErr_SetString(PyExc_ValueError,
                        "layer_norm_grad: x, dy and dx must have one size, and scale, dscale and"
                        " dbias the size of x's last axis (not 0)");
        goto done;
    }
    const Py_ssize_t rows = x->len / 4 / d;
    threads = pool_threads(threads);
    if (rows < 2 * threads) {
        threads = 1;
    }
    block = malloc(sizeof(float) * (size_t)(2 * d * threads));
    partial = calloc((size_t)(2 * d * threads), sizeof(double));
    if (block == NULL || partial == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    struct lng p = {
        .x = x->buf, .dy = views[1].buf, .scale = views[2].buf,
        .dx = held[3] ? views[3].buf : NULL, .dscale = held[4] ? views[4].buf : NULL,
        .dbias = views[5].buf, .rows = rows, .d = d, .eps = eps, .block = block,
        .partial = partial,
    };
    run_pool(lng_share, &p, threads);
    for (Py_ssize_t j = 0; j < d; j++) {
        double s = 0.0, b = 0.0;
        for (int t = 0; t < threads; t++) {
            s += partial[2 * d * t + j];
            b += partial[2 * d * t + d + j];
        }
        if (p.dscale != NULL) {
            p.dscale[j] = (float)s;
        }
        p.dbias[j] = (float)b;
    }
    result = Py_NewRef(Py_None);
done:
    free(block);
    free(partial);
    release_held(views, held, 6);
    return result;
}
