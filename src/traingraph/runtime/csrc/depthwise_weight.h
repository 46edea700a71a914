/* The weight gradient of a depthwise convolution, channels in vector lanes (included by
 * kernels.c).
 *
 * With one channel per group and one filter per channel, every kernel tap's gradient is a dot
 * product within one channel's plane: dW[c, i, j] = sum_{n, u, v} dY[n, c, u, v] *
 * X[n, c, u*s0 + i*d0 - p0, v*s1 + j*d1 - p1]. conv_samples' layout (the plane's rows in
 * vector lanes) leaves most lanes of a small plane empty and pays a copy call per row, so here
 * the lanes hold 16 channels instead: a band of output rows of one sample, with the input rows
 * it reads, is transposed (16 x 16 blocks of channels and flattened positions, in registers)
 * into a buffer of one 16-channel vector per position, zero where the window leaves the image,
 * and each output row's products with a kernel row's taps are summed in registers, several
 * output columns at a time. Any stride, dilation and padding reads the buffer at whole-vector
 * offsets. Each output row's sums are added into the tap's sums in memory, in float32 as
 * conv_samples' are.
 */

#define DWW_LANES 16
#define DWW_BAND_FLOATS (24 * 1024) /* an input band's buffer: about half an L1 cache pair */

/* Where the depthwise form applies: one channel per group and one filter per channel. */
static int dww_fits(const struct conv *cv)
{
    return cv->group > 1 && cv->group == cv->c && cv->m == cv->c;
}


/* dst[k * 16 + l] = src[l * stride + k] for k < count (<= 16) and lanes l < lanes, 0 in the
 * other lanes: 16 channels' runs of count values, one vector per value. */
static inline __attribute__((always_inline)) void dww_gather(const float *src, Py_ssize_t stride,
                                                             int lanes, Py_ssize_t count,
                                                             float *dst)
{
#if defined(__GNUC__) && !defined(__clang__)
    if (count == 16 && lanes == 16 && narrow_blocks) {
        transpose16_by8(src, stride, dst, 16);
        return;
    }
    if (count == 16 && lanes == 16) {
        v16 r[16];
        for (int l = 0; l < 16; l++) {
            r[l] = *(const v16u *)(src + l * stride);
        }
        transpose16(r);
        for (int k = 0; k < 16; k++) {
            *(v16 *)(dst + k * 16) = r[k];
        }
        return;
    }
#endif
    for (Py_ssize_t k = 0; k < count; k++) {
        for (int l = 0; l < 16; l++) {
            dst[k * 16 + l] = l < lanes ? src[l * stride + k] : 0.0f;
        }
    }
}

/* acc[j] (j < kw) += the products of output row `dy` (ow vectors) with input row `x` at tap
 * columns j: U output columns at a time in U * KW accumulators. */
#define DWW_ROW(KW, U)                                                                           \
    TARGETS static void dww_row_##KW(const float *dy, const float *x, Py_ssize_t ow,           \
                                     Py_ssize_t s1, Py_ssize_t d1, v16 *sums)                  \
    {                                                                                            \
        v16 acc[U][KW];                                                                          \
        for (int u = 0; u < U; u++) {                                                            \
            for (int j = 0; j < KW; j++) {                                                       \
                acc[u][j] = (v16){0};                                                            \
            }                                                                                    \
        }                                                                                        \
        Py_ssize_t v = 0;                                                                        \
        for (; v + U <= ow; v += U) {                                                            \
            _Pragma("GCC unroll 8") for (int u = 0; u < U; u++)                                  \
            {                                                                                    \
                const v16 g = *(const v16 *)(dy + (v + u) * 16);                                 \
                const float *row = x + (v + u) * s1 * 16;                                        \
                _Pragma("GCC unroll 8") for (int j = 0; j < KW; j++)                             \
                {                                                                                \
                    acc[u][j] += g * *(const v16 *)(row + j * d1 * 16);                          \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        for (; v < ow; v++) {                                                                    \
            const v16 g = *(const v16 *)(dy + v * 16);                                           \
            const float *row = x + v * s1 * 16;                                                  \
            for (int j = 0; j < KW; j++) {                                                       \
                acc[0][j] += g * *(const v16 *)(row + j * d1 * 16);                              \
            }                                                                                    \
        }                                                                                        \
        for (int j = 0; j < KW; j++) {                                                           \
            v16 s = acc[0][j];                                                                   \
            for (int u = 1; u < U; u++) {                                                        \
                s += acc[u][j];                                                                  \
            }                                                                                    \
            sums[j] += s;                                                                        \
        }                                                                                        \
    }
DWW_ROW(1, 8)
DWW_ROW(3, 4)
DWW_ROW(5, 2)
DWW_ROW(7, 2)

/* dww_row_KW for narrow_blocks: each lane (channel) is summed alone, so the two halves of the
 * 16 lanes go one after the other in v8 accumulators, the same sums in each. */
#define DWW_ROW_NARROW(KW, U)                                                                    \
    TARGETS static void dww_row_narrow_##KW(const float *dy, const float *x, Py_ssize_t ow,    \
                                            Py_ssize_t s1, Py_ssize_t d1, v16 *sums)           \
    {                                                                                            \
        for (int h = 0; h < 2; h++) {                                                            \
            const float *dyh = dy + 8 * h, *xh = x + 8 * h;                                      \
            v8 acc[U][KW];                                                                       \
            for (int u = 0; u < U; u++) {                                                        \
                for (int j = 0; j < KW; j++) {                                                   \
                    acc[u][j] = (v8){0};                                                         \
                }                                                                                \
            }                                                                                    \
            Py_ssize_t v = 0;                                                                    \
            for (; v + U <= ow; v += U) {                                                        \
                _Pragma("GCC unroll 8") for (int u = 0; u < U; u++)                              \
                {                                                                                \
                    const v8 g = *(const v8 *)(dyh + (v + u) * 16);                              \
                    const float *row = xh + (v + u) * s1 * 16;                                   \
                    _Pragma("GCC unroll 8") for (int j = 0; j < KW; j++)                         \
                    {                                                                            \
                        acc[u][j] += g * *(const v8 *)(row + j * d1 * 16);                       \
                    }                                                                            \
                }                                                                                \
            }                                                                                    \
            for (; v < ow; v++) {                                                                \
                const v8 g = *(const v8 *)(dyh + v * 16);                                        \
                const float *row = xh + v * s1 * 16;                                             \
                for (int j = 0; j < KW; j++) {                                                   \
                    acc[0][j] += g * *(const v8 *)(row + j * d1 * 16);                           \
                }                                                                                \
            }                                                                                    \
            for (int j = 0; j < KW; j++) {                                                       \
                v8 s = acc[0][j];                                                                \
                for (int u = 1; u < U; u++) {                                                    \
                    s += acc[u][j];                                                              \
                }                                                                                \
                *(v8 *)((float *)&sums[j] + 8 * h) += s;                                         \
            }                                                                                    \
        }                                                                                        \
    }
DWW_ROW_NARROW(1, 8)
DWW_ROW_NARROW(3, 4)
DWW_ROW_NARROW(5, 2)
DWW_ROW_NARROW(7, 2)

/* The same for any kernel width, one output column at a time. */
TARGETS static void dww_row_any(const float *dy, const float *x, Py_ssize_t ow, Py_ssize_t s1,
                                Py_ssize_t d1, Py_ssize_t kw, v16 *sums)
{
    for (Py_ssize_t j = 0; j < kw; j++) {
        v16 acc = {0};
        for (Py_ssize_t v = 0; v < ow; v++) {
            acc += *(const v16 *)(dy + v * 16) * *(const v16 *)(x + (v * s1 + j * d1) * 16);
        }
        sums[j] += acc;
    }
}

/* Fill `buf` (rows x pitch vectors) with input rows [r0, r0 + rows) of the padded planes of
 * channels [c0, c0 + lanes) of sample n (row r is image row r - p0; column k is image column
 * k - p1), zeros outside the image. */
TARGETS static void dww_fill_input(const struct conv *cv, Py_ssize_t n, Py_ssize_t c0, int lanes,
                                   Py_ssize_t r0, Py_ssize_t rows, Py_ssize_t pitch, float *buf)
{
    const Py_ssize_t hw = cv->h * cv->w, p0 = cv->pad[0], p1 = cv->pad[1];
    const float *planes = cv->x + (n * cv->c + c0) * hw;
    Py_ssize_t first = r0 - p0, last = r0 + rows - p0; /* image rows [first, last) */
    first = first < 0 ? 0 : first;
    last = last > cv->h ? cv->h : last;
    for (Py_ssize_t r = 0; r < rows; r++) {
        const Py_ssize_t ih = r0 + r - p0;
        float *row = buf + r * pitch * 16;
        if (ih < first || ih >= last) {
            memset(row, 0, sizeof(float) * 16 * (size_t)pitch);
            continue;
        }
        const Py_ssize_t right = pitch - p1 - cv->w;
        memset(row, 0, sizeof(float) * 16 * (size_t)(p1 < pitch ? p1 : pitch));
        if (right > 0) {
            memset(row + (p1 + cv->w) * 16, 0, sizeof(float) * 16 * (size_t)right);
        }
    }
    if (last <= first) {
        return;
    }
    /* the image rows' values, flattened, 16 positions at a time */
    float block[16 * 16] __attribute__((aligned(64)));
    const Py_ssize_t start = first * cv->w, end = last * cv->w;
    const Py_ssize_t width = pitch - p1 < cv->w ? pitch - p1 : cv->w; /* columns kept */
    Py_ssize_t iw = 0;
    float *row = buf + (first + p0 - r0) * pitch * 16 + p1 * 16; /* column 0 of the image row */
    for (Py_ssize_t k = start; k < end; k += 16) {
        const Py_ssize_t count = end - k < 16 ? end - k : 16;
        dww_gather(planes + k, hw, lanes, count, block);
        for (Py_ssize_t e = 0; e < count; e++) {
            if (iw < width) {
                *(v16 *)(row + iw * 16) = *(const v16 *)(block + e * 16);
            }
            if (++iw == cv->w) {
                iw = 0;
                row += pitch * 16;
            }
        }
    }
}

/* Fill `buf` with output rows [u0, u0 + rows) of the output gradient's planes of channels
 * [c0, c0 + lanes) of sample n, one vector per position (zeros in the other lanes). */
TARGETS static void dww_fill_grads(const struct conv *cv, Py_ssize_t n, Py_ssize_t c0, int lanes,
                                   Py_ssize_t u0, Py_ssize_t rows, float *buf)
{
    const Py_ssize_t plane = cv->oh * cv->ow, count = rows * cv->ow;
    const float *g = cv->dy + (n * cv->c + c0) * plane + u0 * cv->ow;
    for (Py_ssize_t k = 0; k < count; k += 16) {
        dww_gather(g + k, plane, lanes, count - k < 16 ? count - k : 16, buf + k * 16);
    }
}

/* dw = the weight gradient of samples [n0, n1) of the depthwise cv (dww_fits). */
static int dww_samples(const struct conv *cv, float *dw, Py_ssize_t n0, Py_ssize_t n1,
                       struct scratch *scratch)
{
    const Py_ssize_t kh = cv->kh, kw = cv->kw, kk = kh * kw;
    const Py_ssize_t s0 = cv->stride[0], s1 = cv->stride[1], d0 = cv->dilation[0];
    const Py_ssize_t d1 = cv->dilation[1], oh = cv->oh, ow = cv->ow;
    /* the buffer's columns: every column a window of an output row reads */
    const Py_ssize_t pitch = ow > 0 ? (ow - 1) * s1 + (kw - 1) * d1 + 1 : 1;
    /* output rows per band: as many as keep the input band's buffer near DWW_BAND_FLOATS */
    Py_ssize_t band = 1;
    while (band < oh &&
           ((band * s0 + (kh - 1) * d0 + 1) * pitch + (band + 1) * ow) * 16 <= DWW_BAND_FLOATS) {
        band++;
    }
    const Py_ssize_t in_rows = (band - 1) * s0 + (kh - 1) * d0 + 1;
    if (reserve(scratch, (size_t)((in_rows * pitch + band * ow + kk) * 16), 0) < 0) {
        return -1;
    }
    float *buf = scratch->data, *grads = buf + in_rows * pitch * 16;
    v16 *sums = (v16 *)(grads + band * ow * 16);
    for (Py_ssize_t c0 = 0; c0 < cv->c; c0 += DWW_LANES) {
        const int lanes = (int)(cv->c - c0 < DWW_LANES ? cv->c - c0 : DWW_LANES);
        for (Py_ssize_t t = 0; t < kk; t++) {
            sums[t] = (v16){0};
        }
        for (Py_ssize_t n = n0; n < n1; n++) {
            for (Py_ssize_t u0 = 0; u0 < oh; u0 += band) {
                const Py_ssize_t rows = oh - u0 < band ? oh - u0 : band;
                dww_fill_input(cv, n, c0, lanes, u0 * s0, (rows - 1) * s0 + (kh - 1) * d0 + 1,
                               pitch, buf);
                dww_fill_grads(cv, n, c0, lanes, u0, rows, grads);
                for (Py_ssize_t u = 0; u < rows; u++) {
                    const float *dy_row = grads + u * ow * 16;
                    for (Py_ssize_t i = 0; i < kh; i++) {
                        const float *x_row = buf + (u * s0 + i * d0) * pitch * 16;
                        v16 *tap = sums + i * kw;
                        if (narrow_blocks && (kw == 1 || kw == 3 || kw == 5 || kw == 7)) {
                            switch (kw) {
                            case 1: dww_row_narrow_1(dy_row, x_row, ow, s1, d1, tap); break;
                            case 3: dww_row_narrow_3(dy_row, x_row, ow, s1, d1, tap); break;
                            case 5: dww_row_narrow_5(dy_row, x_row, ow, s1, d1, tap); break;
                            default: dww_row_narrow_7(dy_row, x_row, ow, s1, d1, tap); break;
                            }
                            continue;
                        }
                        switch (kw) {
                        case 1: dww_row_1(dy_row, x_row, ow, s1, d1, tap); break;
                        case 3: dww_row_3(dy_row, x_row, ow, s1, d1, tap); break;
                        case 5: dww_row_5(dy_row, x_row, ow, s1, d1, tap); break;
                        case 7: dww_row_7(dy_row, x_row, ow, s1, d1, tap); break;
                        default: dww_row_any(dy_row, x_row, ow, s1, d1, kw, tap); break;
                        }
                    }
                }
            }
        }
        for (int l = 0; l < lanes; l++) {
            for (Py_ssize_t t = 0; t < kk; t++) {
                dw[(c0 + l) * kk + t] = sums[t][l];
            }
        }
    }
    return 0;
}
