/* The input gradient of a strided depthwise convolution (included by kernels.c).
 *
 * The graph writes it as a ConvTranspose with one group per channel, which onnxruntime runs as
 * a GEMM per group into columns and a col2im: about four times the time of the forward
 * convolution at stride 2. Here each plane's rows are gathered by phase: along a stride s, the
 * input columns x = s j + b (phase b) receive the taps kx = b + pad (mod s) from the output
 * gradient's columns j + (b + pad - kx) / s, one contiguous run each, so the sums over j
 * vectorize; a tap that falls outside the output gradient is left out, as col2im leaves out
 * what falls outside the image. Each input element is the sum of the products the graph adds
 * (in another order), initialized to 0 as col2im's is.
 */

struct dwt {
    const float *dy, *w;
    float *dx;
    Py_ssize_t planes, c, oh, ow, h, w_, kh, kw, sh, sw, pt, pl;
};

/* floor(a / b) for b > 0 */
static inline Py_ssize_t dwt_floor(Py_ssize_t a, Py_ssize_t b)
{
    return a >= 0 ? a / b : -((-a + b - 1) / b);
}

TARGETS static void dwt_plane(const struct dwt *t, Py_ssize_t p, float *acc)
{
    const float *g = t->dy + p * t->oh * t->ow, *k = t->w + (p % t->c) * t->kh * t->kw;
    float *d = t->dx + p * t->h * t->w_;
    for (Py_ssize_t y = 0; y < t->h; y++) {
        float *row = d + y * t->w_;
        for (Py_ssize_t b = 0; b < t->sw && b < t->w_; b++) {
            const Py_ssize_t n = (t->w_ - b + t->sw - 1) / t->sw; /* columns of phase b */
            for (Py_ssize_t j = 0; j < n; j++) {
                acc[j] = 0.0f;
            }
            for (Py_ssize_t ky = 0; ky < t->kh; ky++) {
                const Py_ssize_t r = y + t->pt - ky;
                if (r < 0 || r % t->sh != 0 || r / t->sh >= t->oh) {
                    continue;
                }
                const float *grow = g + (r / t->sh) * t->ow;
                for (Py_ssize_t kx = (b + t->pl) % t->sw; kx < t->kw; kx += t->sw) {
                    /* column j of phase b reads the output gradient's column j + shift */
                    const Py_ssize_t shift = dwt_floor(b + t->pl - kx, t->sw);
                    const Py_ssize_t j0 = shift < 0 ? -shift : 0;
                    const Py_ssize_t j1 = t->ow - shift < n ? t->ow - shift : n;
                    const float wv = k[ky * t->kw + kx];
                    const float *src = grow + shift;
                    for (Py_ssize_t j = j0; j < j1; j++) {
                        acc[j] += wv * src[j];
                    }
                }
            }
            for (Py_ssize_t j = 0; j < n; j++) {
                row[j * t->sw + b] = acc[j];
            }
        }
    }
}

/* The taps of one call, the same for every plane: for each input row y the filter rows ky
 * that reach it and the output-gradient rows they read, and for each column phase b the
 * filter columns kx of that phase and the shift of the columns they read. */
struct dwt_taps {
    Py_ssize_t *row_count, *row_ky, *row_oy; /* row_ky[y * kh + i], i < row_count[y] */
    Py_ssize_t *col_count, *col_kx, *col_shift; /* col_kx[b * kw + i], i < col_count[b] */
};

static void dwt_taps_of(const struct dwt *t, struct dwt_taps *taps)
{
    for (Py_ssize_t y = 0; y < t->h; y++) {
        Py_ssize_t count = 0;
        for (Py_ssize_t ky = 0; ky < t->kh; ky++) {
            const Py_ssize_t r = y + t->pt - ky;
            if (r >= 0 && r % t->sh == 0 && r / t->sh < t->oh) {
                taps->row_ky[y * t->kh + count] = ky;
                taps->row_oy[y * t->kh + count] = r / t->sh;
                count++;
            }
        }
        taps->row_count[y] = count;
    }
    for (Py_ssize_t b = 0; b < t->sw; b++) {
        Py_ssize_t count = 0;
        for (Py_ssize_t kx = (b + t->pl) % t->sw; kx < t->kw; kx += t->sw) {
            taps->col_kx[b * t->kw + count] = kx;
            taps->col_shift[b * t->kw + count] = dwt_floor(b + t->pl - kx, t->sw);
            count++;
        }
        taps->col_count[b] = count;
    }
}

/* The same sums from a copy of the plane whose rows have `left` zero columns before them and
 * enough after (a row of `stride` columns): each tap of a phase reads 16 columns at a time
 * without bounds (a zero column adds a product 0 to a sum, which leaves it as it is but for the
 * sign of a zero). Only for finite filters (else a zero column's product would be NaN):
 * dwt_plane takes the others. */
TARGETS static void dwt_plane_padded(const struct dwt *t, const struct dwt_taps *taps,
                                     Py_ssize_t p, float *scratch, Py_ssize_t left,
                                     Py_ssize_t stride, float *acc, Py_ssize_t acc_stride)
{
    const float *g = t->dy + p * t->oh * t->ow, *k = t->w + (p % t->c) * t->kh * t->kw;
    float *d = t->dx + p * t->h * t->w_;
    for (Py_ssize_t r = 0; r < t->oh; r++) {
        memcpy(scratch + r * stride + left, g + r * t->ow, sizeof(float) * (size_t)t->ow);
    }
    const Py_ssize_t phases = t->sw < t->w_ ? t->sw : t->w_;
    for (Py_ssize_t y = 0; y < t->h; y++) {
        const Py_ssize_t rows = taps->row_count[y];
        const Py_ssize_t *ky = taps->row_ky + y * t->kh, *oy = taps->row_oy + y * t->kh;
        for (Py_ssize_t b = 0; b < phases; b++) {
            const Py_ssize_t n = (t->w_ - b + t->sw - 1) / t->sw, cols = taps->col_count[b];
            const Py_ssize_t *kx = taps->col_kx + b * t->kw, *shift = taps->col_shift + b * t->kw;
            float *out = acc + b * acc_stride;
            for (Py_ssize_t j = 0; j < n; j += 16) {
                v16 a = {0};
                for (Py_ssize_t i = 0; i < rows; i++) {
                    const float *prow = scratch + oy[i] * stride + left + j;
                    const float *wrow = k + ky[i] * t->kw;
                    for (Py_ssize_t q = 0; q < cols; q++) {
                        a += wrow[kx[q]] * *(const v16u *)(prow + shift[q]);
                    }
                }
                *(v16u *)(out + j) = a;
            }
        }
        float *row = d + y * t->w_;
        if (t->sw == 2) {
            const float *even = acc, *odd = acc + acc_stride;
            const Py_ssize_t pairs = t->w_ / 2;
            for (Py_ssize_t j = 0; j < pairs; j++) {
                row[2 * j] = even[j];
                row[2 * j + 1] = odd[j];
            }
            if (t->w_ % 2) {
                row[t->w_ - 1] = even[pairs];
            }
        }
        else {
            for (Py_ssize_t x = 0; x < t->w_; x++) {
                row[x] = acc[(x % t->sw) * acc_stride + x / t->sw];
            }
        }
    }
}

static int dwt_share(const void *arg, int t, int threads)
{
    const struct dwt *d = arg;
    const Py_ssize_t acc_stride = round16(d->w_) + 16;
    Py_ssize_t *index = malloc(sizeof(Py_ssize_t) *
                               (size_t)(d->h * (1 + 2 * d->kh) + d->sw * (1 + 2 * d->kw)));
    float *acc = calloc((size_t)(acc_stride * d->sw + 16), sizeof(float));
    if (acc == NULL || index == NULL) {
        free(acc);
        free(index);
        return -1;
    }
    struct dwt_taps taps = {.row_count = index, .row_ky = index + d->h,
                            .row_oy = index + d->h * (1 + d->kh),
                            .col_count = index + d->h * (1 + 2 * d->kh)};
    taps.col_kx = taps.col_count + d->sw;
    taps.col_shift = taps.col_kx + d->sw * d->kw;
    dwt_taps_of(d, &taps);
    /* the padded rows: `left` zeros for the most negative shift, then the row and zeros up to
     * the last column that phase 0's 16-column runs read at the largest shift */
    Py_ssize_t lo = 0, hi = 0;
    for (Py_ssize_t b = 0; b < d->sw; b++) {
        for (Py_ssize_t i = 0; i < taps.col_count[b]; i++) {
            const Py_ssize_t shift = taps.col_shift[b * d->kw + i];
            lo = shift < lo ? shift : lo;
            hi = shift > hi ? shift : hi;
        }
    }
    const Py_ssize_t left = -lo, reach = round16((d->w_ + d->sw - 1) / d->sw) + hi;
    const Py_ssize_t stride = left + (reach > d->ow ? reach : d->ow) + 16;
    float *scratch = calloc((size_t)(stride * (d->oh + 1)), sizeof(float));
    if (scratch == NULL) {
        free(acc);
        free(index);
        return -1;
    }
    for (Py_ssize_t p = d->planes * t / threads; p < d->planes * (t + 1) / threads; p++) {
        const float *k = d->w + (p % d->c) * d->kh * d->kw;
        int finite = 1;
        for (Py_ssize_t i = 0; i < d->kh * d->kw && finite; i++) {
            finite = k[i] - k[i] == 0.0f;
        }
        if (finite) {
            dwt_plane_padded(d, &taps, p, scratch, left, stride, acc, acc_stride);
        }
        else {
            dwt_plane(d, p, acc);
        }
    }
    free(acc);
    free(scratch);
    free(index);
    return 0;
}

PyDoc_STRVAR(depthwise_conv_transpose_doc,
"depthwise_conv_transpose(dy, w, dx, strides, pads, threads)\n--\n\n"
"Write into ``dx`` ``[N, C, H, W]`` the transposed convolution of ``dy`` ``[N, C, OH, OW]``\n"
"with ``w`` ``[C, 1, KH, KW]``, one group per channel: ``dx[n, c, oy sh - pt + ky, ox sw - pl +\n"
"kx] += w[c, 0, ky, kx] dy[n, c, oy, ox]`` where that position is inside ``dx`` (the input\n"
"gradient of a depthwise Conv of ``strides`` ``(sh, sw)``, dilations 1 and begin ``pads``\n"
"``(pt, pl)``). All float32 and C-contiguous. ``threads`` threads share the planes.");

static PyObject *depthwise_conv_transpose(PyObject *self, PyObject *args)
{
    PyObject *objects[3];
    Py_ssize_t sh, sw, pt, pl;
    int threads;
    if (!PyArg_ParseTuple(args, "OOO(nn)(nn)i:depthwise_conv_transpose", &objects[0],
                          &objects[1], &objects[2], &sh, &sw, &pt, &pl, &threads)) {
        return NULL;
    }
    static const char *names[3] = {"dy", "w", "dx"};
    Py_buffer views[3];
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    for (int k = 0; k < 3; k++) {
        if (float32_array(objects[k], &views[k], 4, k == 2, "depthwise_conv_transpose: array", k,
                          names[k]) < 0) {
            goto done;
        }
        held++;
    }
    const Py_ssize_t *g = views[0].shape, *w = views[1].shape, *x = views[2].shape;
    if (g[0] != x[0] || g[1] != x[1] || w[0] != x[1] || w[1] != 1 || sh < 1 || sw < 1 ||
        pt < 0 || pl < 0) {
        PyErr_Format(PyExc_ValueError,
                     "depthwise_conv_transpose: dy [%zd, %zd, %zd, %zd], w [%zd, %zd, %zd, %zd],"
                     " dx [%zd, %zd, %zd, %zd], strides (%zd, %zd), pads (%zd, %zd); expected"
                     " dy and dx of one batch and channel count C, w [C, 1, KH, KW], strides of"
                     " 1 or more and pads of 0 or more",
                     g[0], g[1], g[2], g[3], w[0], w[1], w[2], w[3], x[0], x[1], x[2], x[3], sh,
                     sw, pt, pl);
        goto done;
    }
    struct dwt t = {.dy = views[0].buf, .w = views[1].buf, .dx = views[2].buf,
                    .planes = x[0] * x[1], .c = x[1], .oh = g[2], .ow = g[3], .h = x[2],
                    .w_ = x[3], .kh = w[2], .kw = w[3], .sh = sh, .sw = sw, .pt = pt, .pl = pl};
    if (run_shares(dwt_share, &t, t.planes * t.h * t.w_, threads) >= 0) {
        result = Py_NewRef(Py_None);
    }
done:
    release_views(views, held);
    return result;
}
