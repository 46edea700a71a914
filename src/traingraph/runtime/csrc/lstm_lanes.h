/* One LSTM step's gate math, forward and backward, over vectors of LANES floats (included by
 * lstm_cell.h once per width, after silu_lanes.h, whose Sigmoid it shares; V, VI, VU, LANES
 * and FN as widths.h defines them). Each lane is computed alone, so both widths give the same
 * results. */

/* tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|); x - x^3 / 3 for |x| < 2^-5, where
 * 1 - e cancels; 1 from |x| >= 9 */
static inline __attribute__((always_inline)) V FN(lstm_tanh)(V x)
{
    const VI magnitude = (VI){0} + INT32_MAX;
    const V a = (V)((VI)x & magnitude), one = (V){0} + 1.0f;
    const V e = FN(gelu_exp)(FN(gelu_select)(a < 9.0f, -2.0f * a, (V){0} - 18.0f));
    const V big = FN(gelu_select)(a < 9.0f, (one - e) / (one + e), one);
    const V t = FN(gelu_select)(a < 0.03125f, a - a * a * a / 3.0f, big);
    const V signed_t = (V)((VI)t | ((VI)x & ~magnitude));
    return FN(gelu_select)(x == x, signed_t, x);
}

/* gates = mm + piece, [i, o, f] = Sigmoid, g = Tanh (gate order i, o, f, c);
 * c = f c_prev + i g, h = o tanh(c), slope = [i g (1 - i), h (1 - o), f c_prev (1 - f),
 * i - i g g], through = o - h tanh(c) */
TARGETS static void FN(lstm_cell_range)(const void *arg, Py_ssize_t i0, Py_ssize_t i1)
{
    const struct lstm_cell *p = arg;
    const Py_ssize_t block = p->block, width = p->width;
    const int blocked = p->stride != width || p->offset != 0;
    Py_ssize_t i = i0;
    while (i < i1) {
        const Py_ssize_t d = i / block, r = i - d * block, base = 4 * d * block + r;
        const Py_ssize_t count = lstm_count(i1 - i, block, r, width, blocked, LANES);
        V pre[4] = {{0}}, cp = {0};
        const float *piece[4];
        for (int k = 0; k < 4; k++) {
            piece[k] = p->piece + lstm_column_at(base + k * block, width, p->stride, p->offset);
        }
        if (count == LANES) {
            for (int k = 0; k < 4; k++) {
                pre[k] = *(const VU *)(p->mm + base + k * block) + *(const VU *)piece[k];
            }
            cp = *(const VU *)(p->c_prev + i);
        }
        else {
            for (int k = 0; k < 4; k++) {
                for (Py_ssize_t j = 0; j < count; j++) {
                    pre[k][j] = p->mm[base + k * block + j] + piece[k][j];
                }
            }
            for (Py_ssize_t j = 0; j < count; j++) {
                cp[j] = p->c_prev[i + j];
            }
        }
        const V one = (V){0} + 1.0f;
        const V in = FN(silu_sigmoid)(pre[0]), out = FN(silu_sigmoid)(pre[1]);
        const V forget = FN(silu_sigmoid)(pre[2]), g = FN(lstm_tanh)(pre[3]);
        const V fc = forget * cp, ig = in * g;
        const V c = fc + ig, tanh_c = FN(lstm_tanh)(c), h = out * tanh_c;
        const V slopes[4] = {ig * (one - in), h * (one - out), fc * (one - forget),
                               in - ig * g};
        const V through = out - h * tanh_c;
        if (count == LANES) {
            *(VU *)(p->h + i) = h;
            *(VU *)(p->c + i) = c;
            *(VU *)(p->through + i) = through;
            *(VU *)(p->f + i) = forget;
            for (int k = 0; k < 4; k++) {
                *(VU *)(p->slope + base + k * block) = slopes[k];
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


/* dh = mm + dy (mm where there is no dy), dc = dh through + dc_next f_next,
 * dgates = [dc, dh, dc, dc] slope (gate order i, o, f, c), also into columns where given */
TARGETS static void FN(lstm_cell_grad_range)(const void *arg, Py_ssize_t i0, Py_ssize_t i1)
{
    const struct lstm_cell_grad *p = arg;
    const Py_ssize_t block = p->block, width = p->width;
    Py_ssize_t i = i0;
    while (i < i1) {
        const Py_ssize_t d = i / block, r = i - d * block, base = 4 * d * block + r;
        const Py_ssize_t count = lstm_count(i1 - i, block, r, width, p->columns != NULL, LANES);
        V mm = {0}, dy = {0}, dc_next = {0}, f_next = {0}, through = {0}, slope[4] = {{0}};
        if (count == LANES) {
            mm = *(const VU *)(p->mm + i);
            dy = p->dy ? *(const VU *)(p->dy + i) : dy;
            dc_next = *(const VU *)(p->dc_next + i);
            f_next = *(const VU *)(p->f_next + i);
            through = *(const VU *)(p->through + i);
            for (int k = 0; k < 4; k++) {
                slope[k] = *(const VU *)(p->slope + base + k * block);
            }
        }
        else {
            for (Py_ssize_t j = 0; j < count; j++) {
                mm[j] = p->mm[i + j];
                dy[j] = p->dy ? p->dy[i + j] : 0.0f;
                dc_next[j] = p->dc_next[i + j];
                f_next[j] = p->f_next[i + j];
                through[j] = p->through[i + j];
                for (int k = 0; k < 4; k++) {
                    slope[k][j] = p->slope[base + k * block + j];
                }
            }
        }
        const V dh = p->dy ? mm + dy : mm;
        const V from_h = dh * through, c_back = dc_next * f_next;
        const V dc = from_h + c_back;
        const V dgates[4] = {dc * slope[0], dh * slope[1], dc * slope[2], dc * slope[3]};
        float *column[4] = {NULL, NULL, NULL, NULL};
        if (p->columns != NULL) {
            for (int k = 0; k < 4; k++) {
                column[k] = p->columns +
                            lstm_column_at(base + k * block, width, p->stride, p->offset);
            }
        }
        if (count == LANES) {
            *(VU *)(p->dc + i) = dc;
            for (int k = 0; k < 4; k++) {
                *(VU *)(p->dgates + base + k * block) = dgates[k];
                if (column[k] != NULL) {
                    *(VU *)column[k] = dgates[k];
                }
            }
        }
        else {
            for (Py_ssize_t j = 0; j < count; j++) {
                p->dc[i + j] = dc[j];
                for (int k = 0; k < 4; k++) {
                    p->dgates[base + k * block + j] = dgates[k][j];
                    if (column[k] != NULL) {
                        column[k][j] = dgates[k][j];
                    }
                }
            }
        }
        i += count;
    }
}
