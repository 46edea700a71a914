/* A tensor's axes permuted (and some reversed) into a new C-contiguous buffer (included by
 * _convc.c).
 *
 * dst = src.reshape(dims).transpose(perm), with the axes `reversed` of src.reshape(dims) taken
 * back to front (a Conv input gradient's filter turned by 180 degrees): the layout changes that onnxruntime's blocked
 * convolution kernels need of a filter every step (OIHW into channel blocks), which a Gather of
 * the filter's positions does one indexed element at a time. Each thread writes a share of dst's
 * rows (all axes but the last) in order; the reads of a row go along the source at the stride
 * of dst's last axis. Where that stride is not 1 and another of dst's axes runs along the
 * source (a transpose: an input gradient's filter with its two channel axes swapped), the
 * copy goes in 16 x 16 tiles of those two axes instead, read as 16 source runs and written as
 * 16 dst runs, transposed in registers. Values are copied, never computed: NaN and infinities
 * stay as they are.
 */

#define PERMUTE_MAX_DIMS 8

/* The 16 x 16 block r[0..15] (rows) transposed in place: four levels of swapping the
 * off-diagonal blocks of side 8, 4, 2 and 1. */
#if defined(__GNUC__) && !defined(__clang__)
#define TRANSPOSE16_STAGE(b, LO, HI)                                                                     \
    {                                                                                            \
        const v16i lo = LO, hi = HI;                                                             \
        _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++)                                    \
        {                                                                                        \
            if ((i & b) == 0) {                                                                  \
                const v16 a = r[i], c = r[i + b];                                                \
                r[i] = __builtin_shuffle(a, c, lo);                                              \
                r[i + b] = __builtin_shuffle(a, c, hi);                                          \
            }                                                                                    \
        }                                                                                        \
    }
static inline __attribute__((always_inline)) void transpose16(v16 *r)
{
    /* lane j of row i: (j & b) == 0 keeps row i's lane j (lo) or takes row i + b's lane j - b;
     * row i + b takes row i's lane j + b or keeps its own (hi) */
    TRANSPOSE16_STAGE(8, ((v16i){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}),
              ((v16i){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}))
    TRANSPOSE16_STAGE(4, ((v16i){0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}),
              ((v16i){4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}))
    TRANSPOSE16_STAGE(2, ((v16i){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}),
              ((v16i){2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}))
    TRANSPOSE16_STAGE(1, ((v16i){0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}),
              ((v16i){1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}))
}

/* transpose16 of an 8 x 8 block in v8 rows (three levels, of side 4, 2 and 1), for
 * narrow_blocks */
#define TRANSPOSE8_STAGE(b, LO, HI)                                                               \
    {                                                                                            \
        const v8i lo = LO, hi = HI;                                                              \
        _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++)                                      \
        {                                                                                        \
            if ((i & b) == 0) {                                                                  \
                const v8 a = r[i], c = r[i + b];                                                 \
                r[i] = __builtin_shuffle(a, c, lo);                                              \
                r[i + b] = __builtin_shuffle(a, c, hi);                                          \
            }                                                                                    \
        }                                                                                        \
    }
static inline __attribute__((always_inline)) void transpose8(v8 *r)
{
    TRANSPOSE8_STAGE(4, ((v8i){0, 1, 2, 3, 8, 9, 10, 11}), ((v8i){4, 5, 6, 7, 12, 13, 14, 15}))
    TRANSPOSE8_STAGE(2, ((v8i){0, 1, 8, 9, 4, 5, 12, 13}), ((v8i){2, 3, 10, 11, 6, 7, 14, 15}))
    TRANSPOSE8_STAGE(1, ((v8i){0, 8, 2, 10, 4, 12, 6, 14}), ((v8i){1, 9, 3, 11, 5, 13, 7, 15}))
}

/* permute_tiles' 16 x 16 block at in (rows along the source, columns `step` apart) into out
 * (rows `inner` apart) as four 8 x 8 blocks, for narrow_blocks */
static inline __attribute__((always_inline)) void transpose16_by8(const float *in, Py_ssize_t step,
                                                                  float *out, Py_ssize_t inner)
{
    for (int lb = 0; lb < 16; lb += 8) {
        for (int cb = 0; cb < 16; cb += 8) {
            v8 r[8];
            for (int c = 0; c < 8; c++) {
                r[c] = *(const v8u *)(in + lb + (cb + c) * step);
            }
            transpose8(r);
            for (int l = 0; l < 8; l++) {
                *(v8u *)(out + (lb + l) * inner + cb) = r[l];
            }
        }
    }
}
#endif


struct permute {
    const float *src;
    float *dst;
    int nd;
    Py_ssize_t extent[PERMUTE_MAX_DIMS]; /* dst's axes */
    Py_ssize_t stride[PERMUTE_MAX_DIMS]; /* the source stride of each of dst's axes */
    Py_ssize_t rows;                     /* dst's rows: the product of all extents but the last */
    int along;                           /* the tiles' row axis (source stride 1), or -1 */
    Py_ssize_t tiles;                    /* with `along`: row tiles of 16 over the other axes */
};

/* The tiles t0..t1 (of 16 places of axis `along` at all places of the axes before the last
 * but it) of a transpose: each the 16 x len block of dst at those places. */
TARGETS static void permute_tiles(const struct permute *p, Py_ssize_t t0, Py_ssize_t t1)
{
    const int last = p->nd - 1, k = p->along;
    const Py_ssize_t len = p->extent[last], step = p->stride[last];
    Py_ssize_t below[PERMUTE_MAX_DIMS]; /* dst's stride of each axis */
    below[last] = 1;
    for (int a = last - 1; a >= 0; a--) {
        below[a] = below[a + 1] * p->extent[a + 1];
    }
    const Py_ssize_t inner = below[k];
    const Py_ssize_t per = (p->extent[k] + 15) / 16; /* tiles along k */
    for (Py_ssize_t t = t0; t < t1; t++) {
        Py_ssize_t rest = t / per, src_off = 0, dst_off = 0;
        const Py_ssize_t i0 = (t % per) * 16;
        const Py_ssize_t rows = p->extent[k] - i0 < 16 ? p->extent[k] - i0 : 16;
        for (int a = last - 1; a >= 0; a--) { /* the tile's place in the other leading axes */
            if (a == k) {
                continue;
            }
            const Py_ssize_t i = rest % p->extent[a];
            rest /= p->extent[a];
            src_off += i * p->stride[a];
            dst_off += i * below[a];
        }
        const float *in = p->src + src_off + i0;
        float *out = p->dst + dst_off + i0 * inner;
        Py_ssize_t j = 0;
#if defined(__GNUC__) && !defined(__clang__)
        if (rows == 16 && narrow_blocks) {
            for (; j + 16 <= len; j += 16) {
                transpose16_by8(in + j * step, step, out + j, inner);
            }
        }
        if (rows == 16) {
            for (; j + 16 <= len; j += 16) {
                v16 r[16];
                for (int c = 0; c < 16; c++) {
                    r[c] = *(const v16u *)(in + (j + c) * step);
                }
                transpose16(r);
                for (int l = 0; l < 16; l++) {
                    *(v16u *)(out + l * inner + j) = r[l];
                }
            }
        }
#endif
        for (Py_ssize_t l = 0; l < rows; l++) {
            for (Py_ssize_t c = j; c < len; c++) {
                out[l * inner + c] = in[l + c * step];
            }
        }
    }
}

TARGETS static void permute_rows(const struct permute *p, Py_ssize_t r0, Py_ssize_t r1)
{
    const int last = p->nd - 1;
    const Py_ssize_t len = p->extent[last], step = p->stride[last];
    Py_ssize_t index[PERMUTE_MAX_DIMS] = {0}, offset = 0, rest = r0;
    for (int a = last - 1; a >= 0; a--) { /* row r0's place in dst's leading axes */
        index[a] = rest % p->extent[a];
        rest /= p->extent[a];
        offset += index[a] * p->stride[a];
    }
    float *out = p->dst + r0 * len;
    for (Py_ssize_t r = r0; r < r1; r++, out += len) {
        const float *in = p->src + offset;
        if (step == 1) {
            memcpy(out, in, sizeof(float) * (size_t)len);
        }
        else {
            for (Py_ssize_t j = 0; j < len; j++) {
                out[j] = in[j * step];
            }
        }
        for (int a = last - 1; a >= 0; a--) { /* the next row */
            offset += p->stride[a];
            if (++index[a] < p->extent[a]) {
                break;
            }
            offset -= index[a] * p->stride[a];
            index[a] = 0;
        }
    }
}

static int permute_share(const void *arg, int t, int threads)
{
    const struct permute *p = arg;
    if (p->along >= 0) {
        permute_tiles(p, p->tiles * t / threads, p->tiles * (t + 1) / threads);
    }
    else {
        permute_rows(p, p->rows * t / threads, p->rows * (t + 1) / threads);
    }
    return 0;
}

PyDoc_STRVAR(permute_doc,
"permute(src, dst, dims, perm, threads, reversed=())\n--\n\n"
"Write ``src.reshape(dims).transpose(perm)`` into ``dst``: both float32 and C-contiguous, of\n"
"``prod(dims)`` elements each (any shapes), ``perm`` a permutation of ``range(len(dims))``,\n"
"at most 8 axes; the axes ``reversed`` of ``src.reshape(dims)`` are read back to front\n"
"(``[::-1]``). ``threads`` threads share the rows of ``dst``.");

static PyObject *permute(PyObject *self, PyObject *args)
{
    PyObject *objects[2], *dims_obj, *perm_obj, *reversed_obj = NULL;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOOi|O:permute", &objects[0], &objects[1], &dims_obj,
                          &perm_obj, &threads, &reversed_obj)) {
        return NULL;
    }
    Py_buffer views[2];
    Py_ssize_t held = 0;
    PyObject *result = NULL, *dims = NULL, *perm = NULL, *reversed = NULL;
    static const char *names[2] = {"src", "dst"};
    for (int k = 0; k < 2; k++) {
        if (float32_array(objects[k], &views[k], -1, k == 1, "permute: array", k, names[k]) < 0) {
            goto done;
        }
        held++;
    }
    dims = PySequence_Fast(dims_obj, "permute: dims must be a sequence of ints");
    perm = dims ? PySequence_Fast(perm_obj, "permute: perm must be a sequence of ints") : NULL;
    if (perm == NULL) {
        goto done;
    }
    const Py_ssize_t nd = PySequence_Fast_GET_SIZE(dims);
    if (nd < 1 || nd > PERMUTE_MAX_DIMS || PySequence_Fast_GET_SIZE(perm) != nd) {
        PyErr_Format(PyExc_ValueError,
                     "permute: got %zd dims and %zd perm entries; expected 1 to %d of each, as"
                     " many of one as of the other",
                     nd, PySequence_Fast_GET_SIZE(perm), PERMUTE_MAX_DIMS);
        goto done;
    }
    Py_ssize_t size[PERMUTE_MAX_DIMS], order[PERMUTE_MAX_DIMS], stride[PERMUTE_MAX_DIMS];
    int seen[PERMUTE_MAX_DIMS] = {0};
    Py_ssize_t total = 1;
    for (Py_ssize_t a = 0; a < nd; a++) {
        size[a] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(dims, a));
        order[a] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(perm, a));
        if (PyErr_Occurred()) {
            goto done;
        }
        if (size[a] < 0 || order[a] < 0 || order[a] >= nd || seen[order[a]]++) {
            PyErr_Format(PyExc_ValueError,
                         "permute: dims must be >= 0 and perm a permutation of range(%zd); got"
                         " dims[%zd] = %zd, perm[%zd] = %zd",
                         nd, a, size[a], a, order[a]);
            goto done;
        }
        total *= size[a];
    }
    if (views[0].len / 4 != total || views[1].len / 4 != total) {
        PyErr_Format(PyExc_ValueError,
                     "permute: src has %zd and dst %zd elements; dims give %zd: both must hold"
                     " prod(dims)",
                     views[0].len / 4, views[1].len / 4, total);
        goto done;
    }
    stride[nd - 1] = 1;
    for (Py_ssize_t a = nd - 1; a > 0; a--) {
        stride[a - 1] = stride[a] * size[a];
    }
    const float *start = views[0].buf;
    if (reversed_obj != NULL) {
        reversed = PySequence_Fast(reversed_obj, "permute: reversed must be a sequence of ints");
        if (reversed == NULL) {
            goto done;
        }
        int flipped[PERMUTE_MAX_DIMS] = {0};
        for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(reversed); k++) {
            const Py_ssize_t a = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(reversed, k));
            if (PyErr_Occurred()) {
                goto done;
            }
            if (a < 0 || a >= nd || flipped[a]++) {
                PyErr_Format(PyExc_ValueError,
                             "permute: reversed must name distinct axes of range(%zd); got %zd",
                             nd, a);
                goto done;
            }
            if (size[a] > 0) {
                start += (size[a] - 1) * stride[a]; /* the axis's last place first */
            }
            stride[a] = -stride[a];
        }
    }
    struct permute p = {
        .src = start, .dst = views[1].buf, .nd = (int)nd, .rows = 1, .along = -1};
    for (Py_ssize_t a = 0; a < nd; a++) {
        p.extent[a] = size[order[a]];
        p.stride[a] = stride[order[a]];
        if (a < nd - 1) {
            p.rows *= p.extent[a];
            if (p.stride[a] == 1 && p.extent[a] >= 16) {
                p.along = (int)a;
            }
        }
    }
    if (p.along >= 0 && (p.stride[nd - 1] == 1 || p.extent[nd - 1] < 16)) {
        p.along = -1; /* rows of contiguous or short runs: copied row by row */
    }
    if (p.along >= 0) {
        p.tiles = p.rows / p.extent[p.along] * ((p.extent[p.along] + 15) / 16);
    }
    if (total > 0) {
        run_shares(permute_share, &p, total, threads);
    }
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(dims);
    Py_XDECREF(perm);
    Py_XDECREF(reversed);
    release_views(views, held);
    return result;
}
