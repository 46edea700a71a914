/* One LSTM step's gate math after its recurrence MatMul, forward and backward, each in one
 * pass (included by kernels.c, after activation_grads.h, whose Sigmoid it shares).
 *
 * The LSTM gradient rule (autodiff/rules/recurrent_steps.py) writes each forward step as
 * eighteen onnxruntime ops after the MatMul (lstm_forward) and each backward step as six
 * (lstm_backward), each a pass over the step's [D, 4H, N] or [D, H, N] tensors, every
 * direction stacked. Here the same float operations in the same order, each rounded to
 * float32 (no contraction into fused multiply-adds); the Sigmoid and Tanh are computed here,
 * as onnxruntime's within their rounding and at their ends (Sigmoid 0 and 1, Tanh -1 and 1
 * for infinities, NaN for NaN).
 *
 * A [D, 4H, N] operand may be one column block of a [D, 4H, T*N] tensor (all steps' columns
 * side by side): `width` is N, `stride` the row length T*N and `offset` the block's first
 * column; a contiguous operand has stride = width and offset 0.
 */

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

struct lstm_cell {
    const float *mm, *piece, *c_prev;
    float *h, *c, *slope, *through, *f;
    Py_ssize_t block;                 /* H * N: one direction's [H, N] */
    Py_ssize_t width, stride, offset; /* piece's columns (see the top) */
};

/* Where element e of a [D, 4H, N] operand lies in its (possibly wider) tensor. */
static inline Py_ssize_t lstm_column_at(Py_ssize_t e, Py_ssize_t width, Py_ssize_t stride,
                                        Py_ssize_t offset)
{
    return e / width * stride + offset + e % width;
}

/* How many of the up to `lanes` elements from r (within a direction's block) one pass takes: a
 * pass of a column block stays within a row. */
static inline Py_ssize_t lstm_count(Py_ssize_t left, Py_ssize_t block, Py_ssize_t r,
                                    Py_ssize_t width, int blocked, Py_ssize_t lanes)
{
    Py_ssize_t count = left < lanes ? left : lanes;
    count = block - r < count ? block - r : count;
    if (blocked && width - r % width < count) {
        count = width - r % width;
    }
    return count;
}

struct lstm_cell_grad {
    const float *mm, *dy, *dc_next, *f_next, *through, *slope;
    float *dc, *dgates, *columns;
    Py_ssize_t block;                 /* H * N: one direction's [H, N] */
    Py_ssize_t width, stride, offset; /* columns' (see the top) */
};

#define LANES_BODY "lstm_lanes.h"
#include "widths.h"
#undef LANES_BODY


#pragma GCC pop_options

/* Whether an operand of `len` floats holds `rows` rows of `stride` with a block of `width`
 * columns at `offset`; else a ValueError naming it. */
static int lstm_columns_fit(const char *kernel, const char *name, Py_ssize_t len,
                            Py_ssize_t rows, Py_ssize_t width, Py_ssize_t stride,
                            Py_ssize_t offset)
{
    if (width <= 0 || offset < 0 || offset + width > stride || len != rows * stride) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %s has %zd elements; expected %zd rows of %zd with columns %zd to %zd"
                     " of each (width %zd, stride %zd, offset %zd)",
                     kernel, name, len, rows, stride, offset, offset + width, width, stride,
                     offset);
        return -1;
    }
    return 0;
}

/* width, stride and offset as given (width 0: a contiguous operand of `block`-wide rows), or
 * a ValueError where they do not fit rows within the directions' blocks */
static int lstm_columns(const char *kernel, Py_ssize_t block, Py_ssize_t *width,
                        Py_ssize_t *stride, Py_ssize_t *offset)
{
    if (*width == 0 && *stride == 0 && *offset == 0) {
        *width = *stride = block;
        return 0;
    }
    if (*width <= 0 || block % *width != 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s: width %zd does not divide block %zd; expected the batch N of"
                     " [D, H, N] states",
                     kernel, *width, block);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(lstm_cell_doc,
"lstm_cell(mm, piece, c_prev, h, c, slope, through, f, block, threads, width=0, stride=0,\n"
"offset=0)\n--\n\n"
"One LSTM step after its recurrence MatMul ``mm``, every direction stacked: ``mm``, ``piece``\n"
"(the input projection and biases) and ``slope`` are ``[D, 4H, N]``, gate order i, o, f, c;\n"
"``c_prev``, ``h``, ``c``, ``through`` and ``f`` ``[D, H, N]``; ``block`` is ``H * N``. Writes\n"
"``c = f c_prev + i g``, ``h = o tanh(c)``, the gates' slopes ``[i g (1 - i), h (1 - o),\n"
"f c_prev (1 - f), i - i g g]``, ``through = o - h tanh(c)`` and ``f``. With ``width`` N,\n"
"``piece`` is the columns ``offset`` to ``offset + N`` of a ``[D, 4H, stride]`` tensor. All\n"
"float32 and C-contiguous; ``threads`` threads share the elements.");

static PyObject *lstm_cell(PyObject *self, PyObject *args)
{
    PyObject *objects[8];
    Py_ssize_t block, width = 0, stride = 0, offset = 0;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOOOOOOni|nnn:lstm_cell", &objects[0], &objects[1],
                          &objects[2], &objects[3], &objects[4], &objects[5], &objects[6],
                          &objects[7], &block, &threads, &width, &stride, &offset)) {
        return NULL;
    }
    static const char *const names[8] = {"mm", "piece", "c_prev", "h", "c", "slope", "through",
                                          "f"};
    static const int gates[8] = {1, 1, 0, 0, 0, 1, 0, 0};
    Py_buffer views[8];
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    for (int k = 0; k < 8; k++) {
        if (float32_array(objects[k], &views[k], -1, k >= 3, "lstm_cell: array", k,
                          names[k]) < 0) {
            goto done;
        }
        held++;
    }
    const Py_ssize_t size = views[2].len / 4;
    if (block <= 0 || size % block != 0) {
        PyErr_Format(PyExc_ValueError,
                     "lstm_cell: c_prev has %zd elements, not a multiple of block %zd; expected"
                     " block = H * N of [D, H, N] states",
                     size, block);
        goto done;
    }
    if (lstm_columns("lstm_cell", block, &width, &stride, &offset) < 0 ||
        lstm_columns_fit("lstm_cell", "piece", views[1].len / 4, 4 * size / width, width,
                         stride, offset) < 0) {
        goto done;
    }
    for (int k = 0; k < 8; k++) {
        const Py_ssize_t want = gates[k] ? 4 * size : size;
        if (k != 1 && views[k].len / 4 != want) {
            PyErr_Format(PyExc_ValueError,
                         "lstm_cell: %s has %zd elements; expected %zd (%s of c_prev's %zd)",
                         names[k], views[k].len / 4, want, gates[k] ? "4 times" : "those",
                         size);
            goto done;
        }
    }
    struct lstm_cell p = {.mm = views[0].buf, .piece = views[1].buf, .c_prev = views[2].buf,
                          .h = views[3].buf, .c = views[4].buf, .slope = views[5].buf,
                          .through = views[6].buf, .f = views[7].buf, .block = block,
                          .width = width, .stride = stride, .offset = offset};
    /* a Sigmoid or Tanh an element: enough work for a second thread from a few thousand on */
    run_elementwise_from(narrow_blocks ? lstm_cell_range_8 : lstm_cell_range_16, &p, size,
                         threads, 4096);
    result = Py_NewRef(Py_None);
done:
    release_views(views, held);
    return result;
}

PyDoc_STRVAR(lstm_cell_grad_doc,
"lstm_cell_grad(mm, dy, dc_next, f_next, through, slope, dc, dgates, columns, block, width,\n"
"stride, offset, threads)\n--\n\n"
"One LSTM step's backward after the MatMul ``mm`` of the recurrence weights (transposed) by\n"
"the gates' gradient of the step after it, every direction stacked: ``dh = mm + dy`` (``mm``\n"
"where ``dy`` is None), ``dc = dh through + dc_next f_next`` and ``dgates = [dc, dh, dc, dc]\n"
"slope``. ``mm``, ``dy``, ``dc_next``, ``f_next``, ``through`` and ``dc`` are ``[D, H, N]``,\n"
"``slope`` and ``dgates`` ``[D, 4H, N]``; ``block`` is ``H * N``. ``dgates`` is also written\n"
"into the columns ``offset`` to ``offset + width`` of ``columns`` (``[D, 4H, stride]``) where\n"
"it is not None. All float32 and C-contiguous; ``threads`` threads share the elements.");

static PyObject *lstm_cell_grad(PyObject *self, PyObject *args)
{
    PyObject *objects[9];
    Py_ssize_t block, width, stride, offset;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOnnnni:lstm_cell_grad", &objects[0], &objects[1],
                          &objects[2], &objects[3], &objects[4], &objects[5], &objects[6],
                          &objects[7], &objects[8], &block, &width, &stride, &offset,
                          &threads)) {
        return NULL;
    }
    static const char *const names[9] = {"mm", "dy", "dc_next", "f_next", "through", "slope",
                                          "dc", "dgates", "columns"};
    static const int gates[9] = {0, 0, 0, 0, 0, 1, 0, 1, 0};
    Py_buffer views[9];
    int present[9];
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    for (int k = 0; k < 9; k++) {
        present[k] = objects[k] != Py_None || (k != 1 && k != 8);
        if (present[k] && float32_array(objects[k], &views[held], -1, k >= 6,
                                        "lstm_cell_grad: array", k, names[k]) < 0) {
            goto done;
        }
        held += present[k];
    }
    const float *data[9] = {NULL};
    Py_ssize_t lens[9] = {0};
    for (int k = 0, v = 0; k < 9; k++) {
        if (present[k]) {
            data[k] = views[v].buf;
            lens[k] = views[v].len / 4;
            v++;
        }
    }
    const Py_ssize_t size = lens[0];
    if (block <= 0 || size % block != 0) {
        PyErr_Format(PyExc_ValueError,
                     "lstm_cell_grad: mm has %zd elements, not a multiple of block %zd; expected"
                     " block = H * N of [D, H, N] states",
                     size, block);
        goto done;
    }
    if (lstm_columns("lstm_cell_grad", block, &width, &stride, &offset) < 0) {
        goto done;
    }
    if (present[8] && lstm_columns_fit("lstm_cell_grad", "columns", lens[8], 4 * size / width,
                                       width, stride, offset) < 0) {
        goto done;
    }
    for (int k = 0; k < 8; k++) {
        const Py_ssize_t want = gates[k] ? 4 * size : size;
        if (present[k] && lens[k] != want) {
            PyErr_Format(PyExc_ValueError,
                         "lstm_cell_grad: %s has %zd elements; expected %zd (%s of mm's %zd)",
                         names[k], lens[k], want, gates[k] ? "4 times" : "those", size);
            goto done;
        }
    }
    struct lstm_cell_grad p = {.mm = data[0], .dy = data[1], .dc_next = data[2],
                               .f_next = data[3], .through = data[4], .slope = data[5],
                               .dc = (float *)data[6], .dgates = (float *)data[7],
                               .columns = (float *)data[8], .block = block, .width = width,
                               .stride = stride, .offset = offset};
    run_elementwise_from(narrow_blocks ? lstm_cell_grad_range_8 : lstm_cell_grad_range_16,
                         &p, size, threads, 16384);
    result = Py_NewRef(Py_None);
done:
    release_views(views, held);
    return result;
}
