/* One LSTM step's gate math after its recurrence MatMul, in one pass (included by kernels.c,
 * after activation_grads.h, whose Sigmoid it shares).
 *
 * The LSTM gradient rule (autodiff/rules/recurrent_steps.py, lstm_forward) writes each step
 * as eighteen onnxruntime ops after the MatMul, each a pass over the step's [D, 4H, N] or
 * [D, H, N] tensors, every direction stacked. Here the same float operations in the same
 * order, each rounded to float32 (no contraction into fused multiply-adds); the Sigmoid and
 * Tanh are computed here, as onnxruntime's within their rounding and at their ends (Sigmoid
 * 0 and 1, Tanh -1 and 1 for infinities, NaN for NaN).
 */

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

struct lstm_cell {
    const float *mm, *piece, *c_prev;
    float *h, *c, *slope, *through, *f;
    Py_ssize_t block; /* H * N: one direction's [H, N] */
};

/* tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|); x - x^3 / 3 for |x| < 2^-5, where
 * 1 - e cancels; 1 from |x| >= 9 */
static inline __attribute__((always_inline)) v16 lstm_tanh(v16 x)
{
    const v16i magnitude = (v16i){0} + INT32_MAX;
    const v16 a = (v16)((v16i)x & magnitude), one = (v16){0} + 1.0f;
    const v16 e = gelu_exp(gelu_select(a < 9.0f, -2.0f * a, (v16){0} - 18.0f));
    const v16 big = gelu_select(a < 9.0f, (one - e) / (one + e), one);
    const v16 t = gelu_select(a < 0.03125f, a - a * a * a / 3.0f, big);
    const v16 signed_t = (v16)((v16i)t | ((v16i)x & ~magnitude));
    return gelu_select(x == x, signed_t, x);
}

/* gates = mm + piece, [i, o, f] = Sigmoid, g = Tanh (gate order i, o, f, c);
 * c = f c_prev + i g, h = o tanh(c), slope = [i g (1 - i), h (1 - o), f c_prev (1 - f),
 * i - i g g], through = o - h tanh(c) */
TARGETS static void lstm_cell_range(const void *arg, Py_ssize_t i0, Py_ssize_t i1)
{
    const struct lstm_cell *p = arg;
    const Py_ssize_t block = p->block;
    Py_ssize_t i = i0;
    while (i < i1) {
        const Py_ssize_t d = i / block, r = i - d * block, base = 4 * d * block + r;
        Py_ssize_t count = i1 - i < 16 ? i1 - i : 16;
        count = block - r < count ? block - r : count;
        v16 pre[4] = {{0}}, cp = {0};
        if (count == 16) {
            for (int k = 0; k < 4; k++) {
                pre[k] = *(const v16u *)(p->mm + base + k * block) +
                         *(const v16u *)(p->piece + base + k * block);
            }
            cp = *(const v16u *)(p->c_prev + i);
        }
        else {
            for (int k = 0; k < 4; k++) {
                for (Py_ssize_t j = 0; j < count; j++) {
                    pre[k][j] = p->mm[base + k * block + j] + p->piece[base + k * block + j];
                }
            }
            for (Py_ssize_t j = 0; j < count; j++) {
                cp[j] = p->c_prev[i + j];
            }
        }
        const v16 one = (v16){0} + 1.0f;
        const v16 in = silu_sigmoid(pre[0]), out = silu_sigmoid(pre[1]);
        const v16 forget = silu_sigmoid(pre[2]), g = lstm_tanh(pre[3]);
        const v16 fc = forget * cp, ig = in * g;
        const v16 c = fc + ig, tanh_c = lstm_tanh(c), h = out * tanh_c;
        const v16 slopes[4] = {ig * (one - in), h * (one - out), fc * (one - forget),
                               in - ig * g};
        const v16 through = out - h * tanh_c;
        if (count == 16) {
            *(v16u *)(p->h + i) = h;
            *(v16u *)(p->c + i) = c;
            *(v16u *)(p->through + i) = through;
            *(v16u *)(p->f + i) = forget;
            for (int k = 0; k < 4; k++) {
                *(v16u *)(p->slope + base + k * block) = slopes[k];
            }
        }
        else {
            for (Py_ssize_t j = 0; j < count; j++) {
                p->h[i + j] = h[j];
                p->c[i + j] = c[j];
                p->through[i + j] = through[j];
                p->f[i + j] = forget[j];
            }
            for (int k = 0; k < 4; k++) {
                for (Py_ssize_t j = 0; j < count; j++) {
                    p->slope[base + k * block + j] = slopes[k][j];
                }
            }
        }
        i += count;
    }
}

#pragma GCC pop_options

PyDoc_STRVAR(lstm_cell_doc,
"lstm_cell(mm, piece, c_prev, h, c, slope, through, f, block, threads)\n--\n\n"
"One LSTM step after its recurrence MatMul ``mm``, every direction stacked: ``mm``, ``piece``\n"
"(the input projection and biases) and ``slope`` are ``[D, 4H, N]``, gate order i, o, f, c;\n"
"``c_prev``, ``h``, ``c``, ``through`` and ``f`` ``[D, H, N]``; ``block`` is ``H * N``. Writes\n"
"``c = f c_prev + i g``, ``h = o tanh(c)``, the gates' slopes ``[i g (1 - i), h (1 - o),\n"
"f c_prev (1 - f), i - i g g]``, ``through = o - h tanh(c)`` and ``f``. All float32 and\n"
"C-contiguous; ``threads`` threads share the elements.");

static PyObject *lstm_cell(PyObject *self, PyObject *args)
{
    PyObject *objects[8];
    Py_ssize_t block;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOOOOOOni:lstm_cell", &objects[0], &objects[1], &objects[2],
                          &objects[3], &objects[4], &objects[5], &objects[6], &objects[7],
                          &block, &threads)) {
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
    for (int k = 0; k < 8; k++) {
        const Py_ssize_t want = gates[k] ? 4 * size : size;
        if (views[k].len / 4 != want) {
            PyErr_Format(PyExc_ValueError,
                         "lstm_cell: %s has %zd elements; expected %zd (%s of c_prev's %zd)",
                         names[k], views[k].len / 4, want, gates[k] ? "4 times" : "those",
                         size);
            goto done;
        }
    }
    struct lstm_cell p = {.mm = views[0].buf, .piece = views[1].buf, .c_prev = views[2].buf,
                          .h = views[3].buf, .c = views[4].buf, .slope = views[5].buf,
                          .through = views[6].buf, .f = views[7].buf, .block = block};
    /* a Sigmoid or Tanh an element: enough work for a second thread from a few thousand on */
    const struct split share = {lstm_cell_range, &p, size};
    Py_BEGIN_ALLOW_THREADS
    if (threads <= 1 || size < 4096) {
        lstm_cell_range(&p, 0, size);
    }
    else {
        pool_run(split_share, &share, threads);
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t k = 0; k < held; k++) {
        PyBuffer_Release(&views[k]);
    }
    return result;
}
