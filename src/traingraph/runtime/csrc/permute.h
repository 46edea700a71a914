/* A tensor's axes permuted (and some reversed) into a new C-contiguous buffer (included by
 * _convc.c).
 *
 * dst = src.reshape(dims).transpose(perm), with the axes `reversed` of src.reshape(dims) taken
 * back to front (a Conv input gradient's filter turned by 180 degrees): the layout changes that onnxruntime's blocked
 * convolution kernels need of a filter every step (OIHW into channel blocks), which a Gather of
 * the filter's positions does one indexed element at a time. Each thread writes a share of dst's
 * rows (all axes but the last) in order; the reads of a row go along the source at the stride
 * of dst's last axis. Values are copied, never computed: NaN and infinities stay as they are.
 */

#define PERMUTE_MAX_DIMS 8

struct permute {
    const float *src;
    float *dst;
    int nd;
    Py_ssize_t extent[PERMUTE_MAX_DIMS]; /* dst's axes */
    Py_ssize_t stride[PERMUTE_MAX_DIMS]; /* the source stride of each of dst's axes */
    Py_ssize_t rows;                     /* dst's rows: the product of all extents but the last */
};

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
    permute_rows(p, p->rows * t / threads, p->rows * (t + 1) / threads);
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
    struct permute p = {.src = start, .dst = views[1].buf, .nd = (int)nd, .rows = 1};
    for (Py_ssize_t a = 0; a < nd; a++) {
        p.extent[a] = size[order[a]];
        p.stride[a] = stride[order[a]];
        if (a < nd - 1) {
            p.rows *= p.extent[a];
        }
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
