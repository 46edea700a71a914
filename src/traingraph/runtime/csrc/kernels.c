/* Native weight gradients of 2-D convolutions for traingraph.runtime.cpu.kernels.conv_grads.
 *
 * For Y = Conv(X, W) with strides s, dilations d, begin pads p and groups g:
 *
 *     dW[m, c, i, j] = sum_{n, u, v} dY[n, m, u, v] * X[n, c', u*s0 + i*d0 - p0, v*s1 + j*d1 - p1]
 *
 * Nothing is unfolded. The padded input of a chunk of samples is split into its stride phases
 * (the rows and columns congruent to a mod s0 and b mod s1), each laid out with the output's
 * row pitch, so that every kernel offset (i, j) reads one phase at a constant shift: the
 * contraction over (n, u, v) becomes one dot product of two contiguous rows per (m, c, i, j),
 * where dY is copied into the same pitch with zeros in the pitch's extra columns. Along an axis
 * of stride 1, neighbouring rows (and samples) share their zero padding, so fewer of the sums'
 * terms are zeros (an 8x8 output with 3x3 windows: 81 places per sample instead of 100); along
 * a column stride of 2 each row is split into its two phases with vector shuffles. The dot
 * products run in 4 x 4 blocks of 16-float vectors, whose 16 sums are reduced together in
 * four levels of shuffles, with the chunk sized to stay in the L2 cache. A 3 x 3 convolution
 * of strides 1 and pads 1 over 8 or more channels and filters, whose height and width suit
 * F(4 x 4, 3 x 3), goes by Winograd's transforms instead (_winograd.h): 36 products per 4 x 4
 * tile and filter pair instead of 144. Samples are split across a pool of persistent worker
 * threads, each summing into its own buffer; the caller adds the buffers at the end.
 *
 * The same pool runs the other kernels here (for traingraph.runtime.cpu.segments): a max-pool
 * gradient's routing, the gradient of a training-mode batch normalization, the keep masks
 * of lowered Dropouts, the columns of strided convolutions' input gradients added into
 * their images, and the unfolds whose products with output gradients are small planes' weight
 * gradients.
 *
 * Plain CPython C API and the buffer protocol; the computation runs without the GIL.
 */
#define PY_SSIZE_T_CLEAN
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* sched_getcpu, pthread_setaffinity_np */
#endif
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__) && defined(__GLIBC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define TARGETS __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
#endif
#ifndef TARGETS
#define TARGETS
#endif

#define MAX_THREADS 64
#define CHUNK_BYTES (768 * 1024) /* the working set of one chunk: about an L2 cache */
#define ROUTE_PER_THREAD (1 << 16) /* elements below which one thread routes (or masks) them all */
#define CHUNK_FLOATS 2048        /* enough positions per chunk to amortize each block's sums */

#include "pool.h"

/* pool_run(share, arg, threads) without the GIL. Returns the thread count used, or -1 with a
 * MemoryError set where a share could not allocate its scratch memory. */
static int run_pool(int (*share)(const void *, int, int), const void *arg, int threads)
{
    int used;
    Py_BEGIN_ALLOW_THREADS
    used = pool_run(share, arg, threads);
    Py_END_ALLOW_THREADS
    if (used < 0) {
        PyErr_NoMemory();
    }
    return used;
}

/* run_pool on one thread for less than ROUTE_PER_THREAD elements of work (waking a worker
 * costs more than it saves). */
static int run_shares(int (*share)(const void *, int, int), const void *arg, Py_ssize_t work,
                      int threads)
{
    return run_pool(share, arg, work < ROUTE_PER_THREAD ? 1 : threads);
}

typedef float v16 __attribute__((vector_size(64), aligned(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
/* Half a v16, for the blocks of narrow_blocks: GCC splits a 64-byte vector's operations into
 * poor AVX2 code (lanes moved through general registers), so those blocks take each v16 of
 * the wide blocks as two of these, lane i of the v16 being lane i % 8 of half i / 8. */
typedef float v8 __attribute__((vector_size(32), aligned(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef int v8i __attribute__((vector_size(32)));

/* Register blocks for 16 vector registers instead of 32. A v16 fills one AVX-512 register and
 * two AVX2 ones: the blocks of sums sized for the 32 AVX-512 registers would spill to memory
 * on every product where AVX-512 is missing, so the products go in smaller blocks there. A
 * block's size changes no sum's order: the results are the same either way. Set once, when
 * the module loads (narrow_blocks_default); `_set_narrow_blocks` overrides it for tests. */
static int narrow_blocks;

static int narrow_blocks_default(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    return !__builtin_cpu_supports("avx512f");
#else
    return 1;
#endif
}

struct conv {
    const float *x, *dy;
    float *dw;
    Py_ssize_t n, c, h, w, m, kh, kw, oh, ow;
    Py_ssize_t stride[2], pad[2], dilation[2], group;
    Py_ssize_t size;  /* elements of dw */
    float *partial; /* (threads - 1) buffers of dw's size, for workers 1.. */
};

/* ------------------------------------------------------------------ dot-product blocks */

static inline float hsum(v16 a)
{
    float s = 0.0f;
    for (int i = 0; i < 16; i++) {
        s += a[i];
    }
    return s;
}

#if defined(__GNUC__) && !defined(__clang__)
typedef int v16i __attribute__((vector_size(64)));

/* The 16 lane sums of a[0..15] in one vector, lane i holding a[rev(i)] (rev reverses the 4
 * bits of i): four levels of pairwise shuffles and adds, halving the partial sums each time,
 * instead of 16 sums of 16 lanes one by one. */
static inline __attribute__((always_inline)) v16 reduce16(const v16 *a)
{
    const v16i h1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const v16i h2 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const v16i h3 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const v16i h4 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    v16 c[8], e[4], f[2];
    for (int j = 0; j < 8; j++) {
        c[j] = __builtin_shuffle(a[2 * j], a[2 * j + 1], h1) +
               __builtin_shuffle(a[2 * j], a[2 * j + 1], h1 + 8);
    }
    for (int j = 0; j < 4; j++) {
        e[j] = __builtin_shuffle(c[2 * j], c[2 * j + 1], h2) +
               __builtin_shuffle(c[2 * j], c[2 * j + 1], h2 + 4);
    }
    for (int j = 0; j < 2; j++) {
        f[j] = __builtin_shuffle(e[2 * j], e[2 * j + 1], h3) +
               __builtin_shuffle(e[2 * j], e[2 * j + 1], h3 + 2);
    }
    return __builtin_shuffle(f[0], f[1], h4) + __builtin_shuffle(f[0], f[1], h4 + 1);
}
#endif

/* The r x c block (r, c <= 4) at a and boff of dot_rows' sums, one accumulator each. */
static inline __attribute__((always_inline)) void dot_tile(const float *a, Py_ssize_t lda,
                                                           const float *b, const Py_ssize_t *boff,
                                                           float *d, Py_ssize_t ldd,
                                                           Py_ssize_t len, const int r, const int c)
{
    v16 s[4][4];
    const float *p[4], *q[4];
    for (int i = 0; i < r; i++) {
        p[i] = a + i * lda;
        for (int k = 0; k < c; k++) {
            s[i][k] = (v16){0};
        }
    }
    for (int k = 0; k < c; k++) {
        q[k] = b + boff[k];
    }
    for (Py_ssize_t l = 0; l < len; l += 16) {
        v16 x[4], y[4];
        for (int i = 0; i < r; i++) {
            x[i] = *(const v16 *)(p[i] + l);
        }
        for (int k = 0; k < c; k++) {
            y[k] = *(const v16u *)(q[k] + l);
        }
        for (int i = 0; i < r; i++) {
            for (int k = 0; k < c; k++) {
                s[i][k] += x[i] * y[k];
            }
        }
    }
    for (int i = 0; i < r; i++) {
        for (int k = 0; k < c; k++) {
            d[i * ldd + k] += hsum(s[i][k]);
        }
    }
}

typedef void (*dot_tile_fn)(const float *, Py_ssize_t, const float *, const Py_ssize_t *, float *,
                            Py_ssize_t, Py_ssize_t);
#define DOT_TILE(r, c)                                                                            \
    TARGETS static void dot_tile_##r##_##c(const float *a, Py_ssize_t lda, const float *b,       \
                                           const Py_ssize_t *boff, float *d, Py_ssize_t ldd,     \
                                           Py_ssize_t len)                                       \
    {                                                                                             \
        dot_tile(a, lda, b, boff, d, ldd, len, r, c);                                             \
    }
#define DOT_TILES(r) DOT_TILE(r, 1) DOT_TILE(r, 2) DOT_TILE(r, 3) DOT_TILE(r, 4)
DOT_TILES(1) DOT_TILES(2) DOT_TILES(3) DOT_TILES(4)
#define DOT_TILE_ROW(r) {dot_tile_##r##_1, dot_tile_##r##_2, dot_tile_##r##_3, dot_tile_##r##_4}
/* dot_tiles[r - 1][c - 1]: the edges of dot_rows' 4 x 4 blocks */
static const dot_tile_fn dot_tiles[4][4] = {
    DOT_TILE_ROW(1), DOT_TILE_ROW(2), DOT_TILE_ROW(3), DOT_TILE_ROW(4),
};

/* The sums of 16 lanes held as two v8 halves, in hsum's order. */
static inline __attribute__((always_inline)) float hsum8x2(v8 lo, v8 hi)
{
    float s = 0.0f;
    for (int i = 0; i < 8; i++) {
        s += lo[i];
    }
    for (int i = 0; i < 8; i++) {
        s += hi[i];
    }
    return s;
}

/* The lanes of the v16 whose halves are lo and hi summed in reduce16's order (lanes i and
 * i + 8, then of those i and i + 4, i and i + 2, and the last two), or in hsum's. */
static inline __attribute__((always_inline)) float sum8x2(v8 lo, v8 hi, const int tree)
{
    if (!tree) {
        return hsum8x2(lo, hi);
    }
    const v8 t = lo + hi;
    float u[4];
    for (int i = 0; i < 4; i++) {
        u[i] = t[i] + t[i + 4];
    }
    return (u[0] + u[2]) + (u[1] + u[3]);
}

/* The r x c block (r, c <= 2) at a and boff of dot_rows' sums for narrow_blocks, each v16
 * accumulator of dot_tile as two v8 halves, its lanes summed as dot_rows sums them there. */
static inline __attribute__((always_inline)) void dot_tile_narrow(
    const float *a, Py_ssize_t lda, const float *b, const Py_ssize_t *boff, float *d,
    Py_ssize_t ldd, Py_ssize_t len, const int r, const int c, const int tree)
{
    v8 s[2][2][2];
    const float *p[2], *q[2];
    for (int i = 0; i < r; i++) {
        p[i] = a + i * lda;
        for (int k = 0; k < c; k++) {
            s[i][k][0] = s[i][k][1] = (v8){0};
        }
    }
    for (int k = 0; k < c; k++) {
        q[k] = b + boff[k];
    }
    for (Py_ssize_t l = 0; l < len; l += 16) {
        for (int h = 0; h < 2; h++) {
            v8 x[2], y[2];
            for (int i = 0; i < r; i++) {
                x[i] = *(const v8 *)(p[i] + l + 8 * h);
            }
            for (int k = 0; k < c; k++) {
                y[k] = *(const v8u *)(q[k] + l + 8 * h);
            }
            for (int i = 0; i < r; i++) {
                for (int k = 0; k < c; k++) {
                    s[i][k][h] += x[i] * y[k];
                }
            }
        }
    }
    for (int i = 0; i < r; i++) {
        for (int k = 0; k < c; k++) {
            d[i * ldd + k] += sum8x2(s[i][k][0], s[i][k][1], tree);
        }
    }
}

#define DOT_NARROW(t, r, c)                                                                       \
    TARGETS static void dot_narrow_##t##_##r##_##c(const float *a, Py_ssize_t lda,              \
                                                   const float *b, const Py_ssize_t *boff,       \
                                                   float *d, Py_ssize_t ldd, Py_ssize_t len)     \
    {                                                                                             \
        dot_tile_narrow(a, lda, b, boff, d, ldd, len, r, c, t);                                   \
    }
#define DOT_NARROWS(t) DOT_NARROW(t, 1, 1) DOT_NARROW(t, 1, 2) DOT_NARROW(t, 2, 1) DOT_NARROW(t, 2, 2)
DOT_NARROWS(0) DOT_NARROWS(1)
#define DOT_NARROW_OF(t) {{dot_narrow_##t##_1_1, dot_narrow_##t##_1_2}, {dot_narrow_##t##_2_1, dot_narrow_##t##_2_2}}
/* dot_narrow[tree][r - 1][c - 1] */
static const dot_tile_fn dot_narrow[2][2][2] = {DOT_NARROW_OF(0), DOT_NARROW_OF(1)};

/* dot_rows for narrow_blocks: the same sums in blocks of 2 x 2, those within dot_rows' 4 x 4
 * blocks summed in reduce16's order as there, the others in hsum's. */
static void dot_rows_narrow(const float *a, Py_ssize_t lda, const float *b,
                            const Py_ssize_t *boff, float *d, Py_ssize_t ldd, Py_ssize_t rows,
                            Py_ssize_t cols, Py_ssize_t len)
{
#if defined(__GNUC__) && !defined(__clang__)
    const Py_ssize_t rows4 = rows / 4 * 4, cols4 = cols / 4 * 4;
#else
    const Py_ssize_t rows4 = 0, cols4 = 0;
#endif
    for (Py_ssize_t m = 0; m < rows; m += 2) {
        const Py_ssize_t r = rows - m < 2 ? rows - m : 2;
        for (Py_ssize_t k = 0; k < cols; k += 2) {
            const Py_ssize_t c = cols - k < 2 ? cols - k : 2;
            const int tree = m < rows4 && k < cols4;
            dot_narrow[tree][r - 1][c - 1](a + m * lda, lda, b, boff + k, d + m * ldd + k, ldd,
                                           len);
        }
    }
}

/* d[m * ldd + k] += sum_{l < len} a[m * lda + l] * b[boff[k] + l] for m < rows, k < cols.
 * a is 64-byte aligned with lda and len multiples of 16; b's rows may start anywhere. */
TARGETS static void dot_rows(const float *a, Py_ssize_t lda, const float *b, const Py_ssize_t *boff,
                             float *d, Py_ssize_t ldd, Py_ssize_t rows, Py_ssize_t cols,
                             Py_ssize_t len)
{
    if (narrow_blocks) {
        dot_rows_narrow(a, lda, b, boff, d, ldd, rows, cols, len);
        return;
    }
    Py_ssize_t m = 0;
    for (; m + 4 <= rows; m += 4) {
        const float *p0 = a + m * lda, *p1 = p0 + lda, *p2 = p1 + lda, *p3 = p2 + lda;
        Py_ssize_t k = 0;
        for (; k + 4 <= cols; k += 4) {
            const float *q0 = b + boff[k], *q1 = b + boff[k + 1];
            const float *q2 = b + boff[k + 2], *q3 = b + boff[k + 3];
            v16 s00 = {0}, s01 = {0}, s02 = {0}, s03 = {0}, s10 = {0}, s11 = {0}, s12 = {0};
            v16 s13 = {0}, s20 = {0}, s21 = {0}, s22 = {0}, s23 = {0}, s30 = {0}, s31 = {0};
            v16 s32 = {0}, s33 = {0};
            for (Py_ssize_t l = 0; l < len; l += 16) {
                const v16 x0 = *(const v16 *)(p0 + l), x1 = *(const v16 *)(p1 + l);
                const v16 x2 = *(const v16 *)(p2 + l), x3 = *(const v16 *)(p3 + l);
                const v16 y0 = *(const v16u *)(q0 + l), y1 = *(const v16u *)(q1 + l);
                const v16 y2 = *(const v16u *)(q2 + l), y3 = *(const v16u *)(q3 + l);
                s00 += x0 * y0; s01 += x0 * y1; s02 += x0 * y2; s03 += x0 * y3;
                s10 += x1 * y0; s11 += x1 * y1; s12 += x1 * y2; s13 += x1 * y3;
                s20 += x2 * y0; s21 += x2 * y1; s22 += x2 * y2; s23 += x2 * y3;
                s30 += x3 * y0; s31 += x3 * y1; s32 += x3 * y2; s33 += x3 * y3;
            }
#if defined(__GNUC__) && !defined(__clang__)
            /* in bit-reversed order, which the reduction turns into row-major lanes */
            const v16 sums[16] = {s00, s20, s10, s30, s02, s22, s12, s32,
                                  s01, s21, s11, s31, s03, s23, s13, s33};
            const v16 r = reduce16(sums);
            for (int i = 0; i < 16; i++) {
                d[(m + i / 4) * ldd + k + i % 4] += r[i];
            }
#else
            const v16 sums[16] = {s00, s01, s02, s03, s10, s11, s12, s13,
                                  s20, s21, s22, s23, s30, s31, s32, s33};
            for (int i = 0; i < 16; i++) {
                d[(m + i / 4) * ldd + k + i % 4] += hsum(sums[i]);
            }
#endif
        }
        if (k < cols) {
            dot_tiles[3][cols - k - 1](p0, lda, b, boff + k, d + m * ldd + k, ldd, len);
        }
    }
    if (m < rows) { /* the last rows in blocks of them by 4 columns */
        for (Py_ssize_t k = 0; k < cols; k += 4) {
            const Py_ssize_t c = cols - k < 4 ? cols - k : 4;
            dot_tiles[rows - m - 1][c - 1](a + m * lda, lda, b, boff + k, d + m * ldd + k, ldd,
                                           len);
        }
    }
}

/* ------------------------------------------------------------ one conv, some samples */

struct scratch {
    float *data;
    size_t capacity; /* floats */
    Py_ssize_t *offsets;
    size_t offsets_capacity;
};

static int reserve(struct scratch *s, size_t floats, size_t offsets)
{
    if (floats > s->capacity) {
        free(s->data);
        s->data = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        s->capacity = s->data ? floats : 0;
        if (s->data == NULL) {
            return -1;
        }
    }
    if (offsets > s->offsets_capacity) {
        free(s->offsets);
        s->offsets = malloc(offsets * sizeof(Py_ssize_t));
        s->offsets_capacity = s->offsets ? offsets : 0;
        if (s->offsets == NULL) {
            return -1;
        }
    }
    return 0;
}

static inline Py_ssize_t round16(Py_ssize_t v) { return (v + 15) & ~(Py_ssize_t)15; }

/* Along a column stride of 2: the rows of channel `ch`'s samples [n, n + count), row phase
 * a, split into the even and odd column phases outs[0] and outs[1] (either NULL where the
 * kernel reads no such phase), each row of `pitch` with zeros outside the image: phase b's
 * place v holds column 2 v + b - p1. `line` holds 2 round16(pitch) + 32 floats. */
TARGETS static void split_rows(const struct conv *cv, float *outs[2], float *line, Py_ssize_t ch,
                               Py_ssize_t n, Py_ssize_t count, Py_ssize_t a, Py_ssize_t rows,
                               Py_ssize_t pitch, Py_ssize_t area, Py_ssize_t plane)
{
    const Py_ssize_t hw = cv->h * cv->w, p1 = cv->pad[1], span = 2 * round16(pitch);
    /* line[j] = column j - p1 of the row, 0 outside it */
    const Py_ssize_t lo = p1 < span ? p1 : span;
    Py_ssize_t hi = cv->w + p1 < span ? cv->w + p1 : span;
    hi = hi > lo ? hi : lo;
    memset(line, 0, sizeof(float) * (size_t)(span + 32));
    for (Py_ssize_t t = 0; t < count; t++) {
        const float *src = cv->x + ((n + t) * cv->c + ch) * hw;
        for (Py_ssize_t u = 0; u < rows; u++) {
            const Py_ssize_t ih = u * cv->stride[0] + a - cv->pad[0];
            float *dst[2];
            for (int b = 0; b < 2; b++) {
                dst[b] = outs[b] != NULL ? outs[b] + t * area + u * pitch : NULL;
            }
            if (ih < 0 || ih >= cv->h) {
                for (int b = 0; b < 2; b++) {
                    if (dst[b] != NULL) {
                        memset(dst[b], 0, sizeof(float) * (size_t)pitch);
                    }
                }
                continue;
            }
            memcpy(line + lo, src + ih * cv->w + lo - p1, sizeof(float) * (size_t)(hi - lo));
            Py_ssize_t v = 0;
#if defined(__GNUC__) && !defined(__clang__)
            const v16i evens = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
            for (; v + 16 <= pitch; v += 16) {
                const v16 x0 = *(const v16u *)(line + 2 * v), x1 = *(const v16u *)(line + 2 * v + 16);
                if (dst[0] != NULL) {
                    *(v16u *)(dst[0] + v) = __builtin_shuffle(x0, x1, evens);
                }
                if (dst[1] != NULL) {
                    *(v16u *)(dst[1] + v) = __builtin_shuffle(x0, x1, evens + 1);
                }
            }
#endif
            for (; v < pitch; v++) {
                for (int b = 0; b < 2; b++) {
                    if (dst[b] != NULL) {
                        dst[b][v] = line[2 * v + b];
                    }
                }
            }
        }
    }
    for (int b = 0; b < 2; b++) {
        if (outs[b] != NULL) {
            memset(outs[b] + count * area, 0, sizeof(float) * (size_t)(plane - count * area));
        }
    }
}

/* dw (zeroed here) = the weight gradient of samples [n0, n1) of `cv`. */
static int conv_samples(const struct conv *cv, float *dw, Py_ssize_t n0, Py_ssize_t n1,
                        struct scratch *scratch)
{
    const Py_ssize_t g_count = cv->group, cg = cv->c / g_count, mg = cv->m / g_count;
    const Py_ssize_t s0 = cv->stride[0], s1 = cv->stride[1];
    const Py_ssize_t kk = cv->kh * cv->kw, k_count = cg * kk;
    memset(dw, 0, sizeof(float) * (size_t)(cv->m * k_count));
    if (n1 <= n0 || cv->oh <= 0 || cv->ow <= 0) {
        return 0;
    }
    /* The phases the kernel reads, their slot numbers, and the furthest shift in each. */
    int slot[64], used = 0;
    for (int i = 0; i < s0 * s1 && i < 64; i++) {
        slot[i] = -1;
    }
    Py_ssize_t reach0 = 0, reach1 = 0;
    for (Py_ssize_t i = 0; i < cv->kh; i++) {
        for (Py_ssize_t j = 0; j < cv->kw; j++) {
            const Py_ssize_t r = i * cv->dilation[0], q = j * cv->dilation[1];
            const int phase = (int)((r % s0) * s1 + q % s1);
            if (slot[phase] < 0) {
                slot[phase] = used++;
            }
            reach0 = r / s0 > reach0 ? r / s0 : reach0;
            reach1 = q / s1 > reach1 ? q / s1 : reach1;
        }
    }
    /* Along an axis of stride 1, neighbouring rows (and samples) share their padding: a row's
     * end padding is the next one's begin padding, which a read past the row's end lands on. */
    Py_ssize_t rows = cv->oh + reach0, pitch = cv->ow + reach1;
    if (s0 == 1) {
        const Py_ssize_t end = rows - cv->h - cv->pad[0];
        rows -= end < cv->pad[0] ? (end > 0 ? end : 0) : cv->pad[0];
    }
    if (s1 == 1) {
        const Py_ssize_t end = pitch - cv->w - cv->pad[1];
        pitch -= end < cv->pad[1] ? (end > 0 ? end : 0) : cv->pad[1];
    }
    const Py_ssize_t area = rows * pitch;
    const Py_ssize_t slack = reach0 * pitch + reach1 + 16;
    Py_ssize_t per_chunk = CHUNK_FLOATS / area > 1 ? CHUNK_FLOATS / area : 1;
    while (per_chunk > 1 && (size_t)(per_chunk * area + slack) * (size_t)(used * cg + mg) *
                                    sizeof(float) > CHUNK_BYTES) {
        per_chunk--;
    }
    const Py_ssize_t plane = round16(round16(per_chunk * area) + slack);
    const Py_ssize_t max_len = round16(per_chunk * area);
    const Py_ssize_t line_len = 2 * round16(pitch) + 32; /* a padded input row (s1 = 2) */
    if (reserve(scratch, (size_t)(plane * used * cg + max_len * mg + line_len),
                (size_t)k_count) < 0) {
        return -1;
    }
    float *planes = scratch->data, *grads = planes + plane * used * cg;
    float *line_buffer = grads + max_len * mg;
    Py_ssize_t *offsets = scratch->offsets;
    const Py_ssize_t hw = cv->h * cv->w, ohw = cv->oh * cv->ow;
    for (Py_ssize_t g = 0; g < g_count; g++) {
        for (Py_ssize_t n = n0; n < n1; n += per_chunk) {
            const Py_ssize_t count = n1 - n < per_chunk ? n1 - n : per_chunk;
            const Py_ssize_t len = round16(count * area);
            for (Py_ssize_t c = 0; c < cg && s1 == 2; c++) {
                for (Py_ssize_t a = 0; a < s0; a++) {
                    float *outs[2] = {NULL, NULL};
                    for (int b = 0; b < 2; b++) {
                        outs[b] = slot[a * 2 + b] < 0 ? NULL
                                                      : planes + (c * used + slot[a * 2 + b]) * plane;
                    }
                    if (outs[0] != NULL || outs[1] != NULL) {
                        split_rows(cv, outs, line_buffer, g * cg + c, n, count, a, rows, pitch,
                                   area, plane);
                    }
                }
            }
            for (Py_ssize_t c = 0; c < cg && s1 != 2; c++) {
                for (Py_ssize_t a = 0; a < s0; a++) {
                    for (Py_ssize_t b = 0; b < s1; b++) {
                        const int k = slot[a * s1 + b];
                        if (k < 0) {
                            continue;
                        }
                        float *out = planes + (c * used + k) * plane;
                        for (Py_ssize_t t = 0; t < count; t++) {
                            const float *src = cv->x + ((n + t) * cv->c + g * cg + c) * hw;
                            for (Py_ssize_t u = 0; u < rows; u++) {
                                float *row = out + t * area + u * pitch;
                                const Py_ssize_t ih = u * s0 + a - cv->pad[0];
                                if (ih < 0 || ih >= cv->h) {
                                    memset(row, 0, sizeof(float) * (size_t)pitch);
                                    continue;
                                }
                                const float *line = src + ih * cv->w;
                                if (s1 == 1) { /* one copy between zeros */
                                    const Py_ssize_t p1 = cv->pad[1];
                                    const Py_ssize_t lo = p1 < pitch ? p1 : pitch;
                                    Py_ssize_t hi = cv->w + p1 < pitch ? cv->w + p1 : pitch;
                                    hi = hi > lo ? hi : lo;
                                    memset(row, 0, sizeof(float) * (size_t)lo);
                                    memcpy(row + lo, line + lo - p1, sizeof(float) * (size_t)(hi - lo));
                                    memset(row + hi, 0, sizeof(float) * (size_t)(pitch - hi));
                                    continue;
                                }
                                /* columns v with 0 <= v * s1 + b - pad < w: [lo, hi) */
                                const Py_ssize_t shift = b - cv->pad[1];
                                Py_ssize_t lo = shift >= 0 ? 0 : (-shift + s1 - 1) / s1;
                                Py_ssize_t hi = cv->w - 1 - shift < 0 ? 0 : (cv->w - 1 - shift) / s1 + 1;
                                lo = lo < pitch ? lo : pitch;
                                hi = hi < pitch ? hi : pitch;
                                hi = hi > lo ? hi : lo;
                                memset(row, 0, sizeof(float) * (size_t)lo);
                                const float *first = line + shift;
                                for (Py_ssize_t v = lo; v < hi; v++) {
                                    row[v] = first[v * s1];
                                }
                                memset(row + hi, 0, sizeof(float) * (size_t)(pitch - hi));
                            }
                        }
                        memset(out + count * area, 0, sizeof(float) * (size_t)(plane - count * area));
                    }
                }
            }
            for (Py_ssize_t m = 0; m < mg; m++) {
                float *out = grads + m * len;
                for (Py_ssize_t t = 0; t < count; t++) {
                    const float *src = cv->dy + ((n + t) * cv->m + g * mg + m) * ohw;
                    float *dst = out + t * area;
                    for (Py_ssize_t u = 0; u < cv->oh; u++) {
                        memcpy(dst + u * pitch, src + u * cv->ow, sizeof(float) * (size_t)cv->ow);
                        memset(dst + u * pitch + cv->ow, 0, sizeof(float) * (size_t)(pitch - cv->ow));
                    }
                    memset(dst + cv->oh * pitch, 0, sizeof(float) * (size_t)(area - cv->oh * pitch));
                }
                memset(out + count * area, 0, sizeof(float) * (size_t)(len - count * area));
            }
            for (Py_ssize_t c = 0; c < cg; c++) {
                for (Py_ssize_t i = 0; i < cv->kh; i++) {
                    for (Py_ssize_t j = 0; j < cv->kw; j++) {
                        const Py_ssize_t r = i * cv->dilation[0], q = j * cv->dilation[1];
                        const int k = slot[(r % s0) * s1 + q % s1];
                        offsets[(c * cv->kh + i) * cv->kw + j] =
                            (c * used + k) * plane + (r / s0) * pitch + q / s1;
                    }
                }
            }
            dot_rows(grads, len, planes, offsets, dw + g * mg * k_count, k_count, mg, k_count,
                     len);
        }
    }
    return 0;
}

/* Each thread's buffers for the weight gradients. */
static struct scratch conv_scratch[MAX_THREADS];

/* Weight gradients by Winograd's F(4 x 4, 3 x 3), where they fit (_winograd.h). */
static int wino_weight_fits(const struct conv *cv);
static int wino_weight_samples(const struct conv *cv, float *dw, Py_ssize_t n0, Py_ssize_t n1,
                               struct scratch *scratch);

/* Weight gradients of depthwise convolutions, channels in vector lanes (depthwise_weight.h). */
static int dww_fits(const struct conv *cv);
static int dww_samples(const struct conv *cv, float *dw, Py_ssize_t n0, Py_ssize_t n1,
                       struct scratch *scratch);

struct conv_batch {
    const struct conv *convs;
    Py_ssize_t count;
};

/* Thread t sums its share of the samples of every conv into dw (t = 0) or its partial. */
static int conv_share(const void *arg, int t, int threads)
{
    const struct conv_batch *batch = arg;
    int failed = 0;
    for (Py_ssize_t i = 0; i < batch->count; i++) {
        const struct conv *cv = &batch->convs[i];
        float *out = t == 0 ? cv->dw : cv->partial + (t - 1) * cv->size;
        const Py_ssize_t n0 = cv->n * t / threads, n1 = cv->n * (t + 1) / threads;
        const int by_winograd = wino_weight_fits(cv);
        int (*samples)(const struct conv *, float *, Py_ssize_t, Py_ssize_t, struct scratch *) =
            dww_fits(cv) ? dww_samples : by_winograd ? wino_weight_samples : conv_samples;
        if (samples(cv, out, n0, n1, &conv_scratch[t]) < 0) {
            failed = 1;
        }
    }
    return failed ? -1 : 0;
}

/* ------------------------------------------------------------------------- Python */

/* A float32 C-contiguous buffer of rank ndim; errors name the call (what), the entry (index)
 * and the argument (name). */
static int float32_array(PyObject *obj, Py_buffer *view, int ndim, int writable, const char *what,
                         Py_ssize_t index, const char *name)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_RECORDS_RO) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s %zd: %s must be a numpy array; got %.200s", what,
                     index, name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    const char *format = view->format ? view->format : "B";
    if (*format == '=' || *format == '<' || *format == '@') {
        format++;
    }
    const char *problem = NULL;
    if (strcmp(format, "f") != 0 || view->itemsize != 4) {
        problem = "is not float32";
    }
    else if (ndim >= 0 && view->ndim != ndim) {
        problem = ndim == 4 ? "is not 4-D" : "is not 1-D";
    }
    else if (!PyBuffer_IsContiguous(view, 'C')) {
        problem = "is not C-contiguous";
    }
    else if (writable && view->readonly) {
        problem = "is read-only";
    }
    if (problem != NULL) {
        PyErr_Format(PyExc_ValueError, "%s %zd: %s %s", what, index, name, problem);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static void release_views(Py_buffer *views, Py_ssize_t held)
{
    for (Py_ssize_t k = 0; k < held; k++) {
        PyBuffer_Release(&views[k]);
    }
}

/* Release the views among the first ``count`` whose ``held`` flag is set. */
static void release_held(Py_buffer *views, const int *held, int count)
{
    for (int k = 0; k < count; k++) {
        if (held[k]) {
            PyBuffer_Release(&views[k]);
        }
    }
}

/* The values per channel of ``x`` ``[N, C, ...]`` other than N (the product of the dimensions
 * after C) into ``*s``; -1 with a ValueError naming ``function`` where a channel holds none. */
static int channel_values(const Py_buffer *x, const char *function, Py_ssize_t *s)
{
    *s = 1;
    for (int d = 2; d < x->ndim; d++) {
        *s *= x->shape[d];
    }
    if (x->shape[0] * *s == 0) {
        PyErr_Format(PyExc_ValueError, "%s: x has no elements per channel", function);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(weight_grads_doc,
"weight_grads(convs, threads)\n--\n\n"
"Write the weight gradient of each 2-D convolution in ``convs`` into its ``dw``.\n\n"
"Each entry is ``(x, dy, dw, strides, pads, dilations, group)``: the float32 C-contiguous\n"
"input ``x [N, C, H, W]``, output gradient ``dy [N, M, OH, OW]`` and gradient\n"
"``dw [M, C / group, KH, KW]``, with ``strides``, begin ``pads`` and ``dilations`` as pairs.\n"
"``threads`` threads share the samples. 3 x 3 convolutions of strides 1 and pads 1 over 8+\n"
"channels and filters, H and W multiples of 4 and W 8, 16, 32 or a multiple of 64, go by\n"
"Winograd's F(4 x 4, 3 x 3).");

static PyObject *weight_grads(PyObject *self, PyObject *args)
{
    PyObject *sequence;
    int threads;
    if (!PyArg_ParseTuple(args, "Oi:weight_grads", &sequence, &threads)) {
        return NULL;
    }
    threads = pool_threads(threads);
    PyObject *items = PySequence_Fast(sequence, "weight_grads: convs must be a sequence");
    if (items == NULL) {
        return NULL;
    }
    const Py_ssize_t count = PySequence_Fast_GET_SIZE(items);
    struct conv *convs = calloc((size_t)(count ? count : 1), sizeof(struct conv));
    Py_buffer *views = calloc((size_t)(3 * count + 1), sizeof(Py_buffer));
    float *partials = NULL;
    Py_ssize_t held = 0, partial_size = 0;
    PyObject *result = NULL;
    if (convs == NULL || views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *arrays[3];
        Py_ssize_t st[2], pd[2], dl[2], group;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(items, i), "OOO(nn)(nn)(nn)n", &arrays[0],
                              &arrays[1], &arrays[2], &st[0], &st[1], &pd[0], &pd[1], &dl[0],
                              &dl[1], &group)) {
            goto done;
        }
        static const char *names[3] = {"x", "dy", "dw"};
        for (int k = 0; k < 3; k++) {
            if (float32_array(arrays[k], &views[held], 4, k == 2, "weight_grads: conv", i,
                              names[k]) < 0) {
                goto done;
            }
            held++;
        }
        const Py_ssize_t *xs = views[held - 3].shape, *ys = views[held - 2].shape;
        const Py_ssize_t *ws = views[held - 1].shape;
        struct conv *cv = &convs[i];
        *cv = (struct conv){
            .x = views[held - 3].buf, .dy = views[held - 2].buf, .dw = views[held - 1].buf,
            .n = xs[0], .c = xs[1], .h = xs[2], .w = xs[3], .m = ys[1], .kh = ws[2],
            .kw = ws[3], .oh = ys[2], .ow = ys[3], .stride = {st[0], st[1]},
            .pad = {pd[0], pd[1]}, .dilation = {dl[0], dl[1]}, .group = group,
        };
        const int bad_geometry = st[0] < 1 || st[1] < 1 || st[0] * st[1] > 64 || dl[0] < 1 ||
                                 dl[1] < 1 || pd[0] < 0 || pd[1] < 0 || group < 1 ||
                                 cv->c % group || cv->m % group;
        if (bad_geometry || ys[0] != cv->n || ws[0] != cv->m || ws[1] * group != cv->c) {
            PyErr_Format(PyExc_ValueError,
                         "weight_grads: conv %zd: x [%zd, %zd, %zd, %zd], dy [%zd, %zd, %zd, %zd],"
                         " dw [%zd, %zd, %zd, %zd], strides (%zd, %zd), pads (%zd, %zd),"
                         " dilations (%zd, %zd) and group %zd do not form a convolution",
                         i, xs[0], xs[1], xs[2], xs[3], ys[0], ys[1], ys[2], ys[3], ws[0], ws[1],
                         ws[2], ws[3], st[0], st[1], pd[0], pd[1], dl[0], dl[1], group);
            goto done;
        }
        cv->size = cv->m * ws[1] * cv->kh * cv->kw;
        partial_size += cv->size;
    }
    if (threads > 1 && partial_size) {
        partials = malloc(sizeof(float) * (size_t)(partial_size * (threads - 1)));
        if (partials == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        float *next = partials;
        for (Py_ssize_t i = 0; i < count; i++) {
            convs[i].partial = next;
            next += convs[i].size * (threads - 1);
        }
    }
    int used;
    const struct conv_batch batch = {convs, count};
    Py_BEGIN_ALLOW_THREADS
    used = pool_run(conv_share, &batch, threads);
    for (Py_ssize_t i = 0; i < count && used > 1; i++) {
        const struct conv *cv = &convs[i];
        for (int t = 1; t < used; t++) {
            const float *part = cv->partial + (t - 1) * cv->size;
            for (Py_ssize_t k = 0; k < cv->size; k++) {
                cv->dw[k] += part[k];
            }
        }
    }
    Py_END_ALLOW_THREADS
    if (used < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    release_views(views, held);
    free(partials);
    free(views);
    free(convs);
    Py_DECREF(items);
    return result;
}

/* ------------------------------------------------------------- max-pool routing */

/* The gradient dp[n, c, i, j] of window (i, j) goes to the window's first maximum of y
 * (row-major, as ArgMax and MaxPool pick it), where that maximum is above 0 or relu is 0; every
 * other element of dy is 0. bias[c] (when given) = the sum of what went to channel c. */
struct route {
    const float *y, *dp;
    float *dy, *bias;
    Py_ssize_t n, c, h, w, oh, ow, kh, kw;
    int relu;
};

/* One plane's windows of 2 x 2, branch-free: each of the four places gets dp times 1 or 0
 * (as the graph's product with its mask: -0 for a negative dp, NaN for an infinite one).
 * Compiled for the baseline only: GCC 12's AVX-512 form of this loop runs at half the speed. */
static double route_plane_2x2(const float *yp, const float *g, float *d, Py_ssize_t oh,
                                      Py_ssize_t ow, Py_ssize_t w, int relu)
{
    double sum = 0.0;
    for (Py_ssize_t i = 0; i < oh; i++) {
        const float *y0 = yp + 2 * i * w, *y1 = y0 + w, *gi = g + i * ow;
        float *d0 = d + 2 * i * w, *d1 = d0 + w;
        float row = 0.0f;
        for (Py_ssize_t j = 0; j < ow; j++) {
            const float a = y0[2 * j], b = y0[2 * j + 1], c = y1[2 * j], e = y1[2 * j + 1];
            /* a later place wins only where strictly greater; products with 0 or 1 rather
             * than selects, which compile to branches that random data mispredicts */
            const int gb = b > a;
            const float m1 = gb ? b : a;
            const int gc = c > m1;
            const float m2 = gc ? c : m1;
            const int ge = e > m2;
            const float best = ge ? e : m2;
            /* (the places as named ints: written inline, GCC 12 branches on them) */
            const int at3 = ge, at2 = gc & !ge, at1 = gb & !gc & !ge, at0 = !(gb | gc | ge);
            const float v = gi[j] * (float)(!relu | (best > 0.0f));
            d0[2 * j] = v * (float)at0;
            d0[2 * j + 1] = v * (float)at1;
            d1[2 * j] = v * (float)at2;
            d1[2 * j + 1] = v * (float)at3;
            /* the window's four products, as the graph sums them: v, and NaN for an
             * infinite v (0 times it) */
            row += (d0[2 * j] + d0[2 * j + 1]) + (d1[2 * j] + d1[2 * j + 1]);
        }
        for (Py_ssize_t k = 2 * ow; k < w; k++) {
            d0[k] = d1[k] = 0.0f;
        }
        sum += row;
    }
    return sum;
}

static double route_plane(const struct route *r, const float *yp, const float *g, float *d)
{
    double sum = 0.0;
    for (Py_ssize_t i = 0; i < r->oh; i++) {
        for (Py_ssize_t a = 0; a < r->kh; a++) {
            memset(d + (i * r->kh + a) * r->w, 0, sizeof(float) * (size_t)r->w);
        }
        for (Py_ssize_t j = 0; j < r->ow; j++) {
            Py_ssize_t at = i * r->kh * r->w + j * r->kw;
            float best = yp[at];
            for (Py_ssize_t a = 0; a < r->kh; a++) {
                const Py_ssize_t row = (i * r->kh + a) * r->w + j * r->kw;
                for (Py_ssize_t b = 0; b < r->kw; b++) {
                    if (yp[row + b] > best) {
                        best = yp[row + b];
                        at = row + b;
                    }
                }
            }
            /* every place of the window gets v times 1 or 0, as the graph's product with
             * its mask (NaN for an infinite v), and the bias their sum */
            const float v = g[i * r->ow + j] * (float)(!r->relu | (best > 0.0f));
            for (Py_ssize_t a = 0; a < r->kh; a++) {
                const Py_ssize_t row = (i * r->kh + a) * r->w + j * r->kw;
                for (Py_ssize_t b = 0; b < r->kw; b++) {
                    d[row + b] = v * (float)(row + b == at);
                    sum += d[row + b];
                }
            }
        }
    }
    return sum;
}

/* Thread t routes the planes of its share of the channels. */
static int route_share(const void *arg, int t, int threads)
{
    const struct route *r = arg;
    const Py_ssize_t plane = r->h * r->w, rows = r->oh * r->kh;
    for (Py_ssize_t c = r->c * t / threads; c < r->c * (t + 1) / threads; c++) {
        double sum = 0.0;
        for (Py_ssize_t n = 0; n < r->n; n++) {
            const Py_ssize_t p = n * r->c + c;
            const float *yp = r->y + p * plane, *g = r->dp + p * r->oh * r->ow;
            float *d = r->dy + p * plane;
            sum += r->kh == 2 && r->kw == 2
                       ? route_plane_2x2(yp, g, d, r->oh, r->ow, r->w, r->relu)
                       : route_plane(r, yp, g, d);
            memset(d + rows * r->w, 0, sizeof(float) * (size_t)((r->h - rows) * r->w));
        }
        if (r->bias != NULL) {
            r->bias[c] = (float)sum;
        }
    }
    return 0;
}

PyDoc_STRVAR(route_max_pool_doc,
"route_max_pool(y, dp, dy, bias, kernel, relu, threads)\n--\n\n"
"Write the gradient of ``MaxPool(y)`` into ``dy`` given that of its output, ``dp``.\n\n"
"``y`` and ``dy`` are float32 C-contiguous ``[N, C, H, W]``, ``dp`` is ``[N, C, OH, OW]``: the\n"
"windows are ``kernel`` (a pair, also the strides), unpadded, and tile the first ``OH * KH``\n"
"rows and ``OW * KW`` columns. Each window's ``dp`` goes to its first maximum (row-major);\n"
"with ``relu`` true, only where that maximum is above 0 (the gradient through a Relu whose\n"
"output ``y`` is). ``bias``, a float32 ``[C]`` array or None, receives the sum of ``dy`` per\n"
"channel. ``threads`` threads share the channels.");

static PyObject *route_max_pool(PyObject *self, PyObject *args)
{
    PyObject *objects[4];
    Py_ssize_t kh, kw;
    int relu, threads;
    if (!PyArg_ParseTuple(args, "OOOO(nn)pi:route_max_pool", &objects[0], &objects[1],
                          &objects[2], &objects[3], &kh, &kw, &relu, &threads)) {
        return NULL;
    }
    static const char *names[4] = {"y", "dp", "dy", "bias"};
    const int count = objects[3] == Py_None ? 3 : 4;
    Py_buffer views[4];
    int held = 0;
    PyObject *result = NULL;
    for (; held < count; held++) {
        if (float32_array(objects[held], &views[held], held == 3 ? 1 : 4, held >= 2,
                          "route_max_pool: argument", held, names[held]) < 0) {
            goto done;
        }
    }
    const Py_ssize_t *ys = views[0].shape, *ps = views[1].shape, *ds = views[2].shape;
    int fits = kh >= 1 && kw >= 1 && ps[0] == ys[0] && ps[1] == ys[1] && ps[2] * kh <= ys[2] &&
               ps[3] * kw <= ys[3];
    for (int k = 0; k < 4; k++) {
        fits = fits && ds[k] == ys[k];
    }
    if (count == 4) {
        fits = fits && views[3].shape[0] == ys[1];
    }
    if (!fits) {
        PyErr_Format(PyExc_ValueError,
                     "route_max_pool: y [%zd, %zd, %zd, %zd], dp [%zd, %zd, %zd, %zd] and dy"
                     " [%zd, %zd, %zd, %zd] do not fit windows of (%zd, %zd)%s",
                     ys[0], ys[1], ys[2], ys[3], ps[0], ps[1], ps[2], ps[3], ds[0], ds[1], ds[2],
                     ds[3], kh, kw, count == 4 ? " with a bias of the channels" : "");
        goto done;
    }
    const struct route r = {
        .y = views[0].buf, .dp = views[1].buf, .dy = views[2].buf,
        .bias = count == 4 ? views[3].buf : NULL, .n = ys[0], .c = ys[1], .h = ys[2],
        .w = ys[3], .oh = ps[2], .ow = ps[3], .kh = kh, .kw = kw, .relu = relu,
    };
    run_shares(route_share, &r, r.n * r.c * r.h * r.w, threads);
    result = Py_NewRef(Py_None);
done:
    release_views(views, held);
    return result;
}

/* ---------------------------------------------------------- batch-norm gradient */

/* The training-mode BatchNormalization gradient over x [n, c, s], optionally behind a Relu
 * whose output is y: with g = dy where y > 0 (dy itself without a Relu), per channel
 *     dscale = rstd * sum(g * (x - mean)),   dbias = sum(g),
 *     dx = a g - (k (x - mean) + cc),   a = scale rstd,   k = a rstd dscale / M,   cc = a dbias / M
 * with the batch statistics recomputed (in double, the sums shifted by the mean of the
 * channel's first plane) and x - mean taken before k scales it. */
struct bn {
    const float *x, *dy, *y, *scale;
    float *dx, *dscale, *dbias;
    Py_ssize_t n, c, s;
    double eps;
};

#if !defined(__GNUC__) || defined(__clang__)
typedef int v16i __attribute__((vector_size(64)));
#endif

/* The graph's Relu gradient, dy * Cast(y > 0): dy where y > 0, else dy * 0 (0, -0 for a
 * negative dy, NaN for an infinite or NaN one), y NaN included. */
static inline v16 relu_gate(v16 dy, v16 y)
{
    const v16 zero = {0}, one = zero + 1.0f;
    return dy * (v16)((v16i)one & (y > zero));
}

static inline float relu_gate1(float dy, float y)
{
    return dy * (float)(y > 0.0f);
}

/* onnxruntime's Relu, max(v, 0) with NaN kept. */
static inline __attribute__((always_inline)) v16 relu_max(v16 v)
{
    /* From the bits b with integer operations, not float comparisons: GCC compiles a
     * comparison of 64-byte vectors lane by lane (a scalar compare and a branch each) where
     * AVX-512 is missing (the x86-64-v3 clone of a TARGETS function), while these take two
     * AVX2 instructions there and one with AVX-512. b >> 31 is -1 where the sign is set, and
     * (0x7f800000 - |b|) >> 31 where the float is a NaN (neither overflows): -0 gives +0, and a
     * NaN of either sign stays. */
    const v16i b = (v16i)v;
    return (v16)(b & (~(b >> 31) | ((0x7f800000 - (b & 0x7fffffff)) >> 31)));
}

/* onnxruntime's Relu on a v8, as relu_max */
static inline __attribute__((always_inline)) v8 relu_max8(v8 v)
{
    const v8i b = (v8i)v;
    return (v8)(b & (~(b >> 31) | ((0x7f800000 - (b & 0x7fffffff)) >> 31)));
}

static inline float relu_max1(float v)
{
    return v > 0.0f || v != v ? v : 0.0f;
}

static inline float finite_or_zero(float v)
{
    return v - v == 0.0f ? v : 0.0f;
}

TARGETS static void bn_sums(const struct bn *b, Py_ssize_t c, float x0, double sums[4])
{
    const v16 shift = x0 - (v16){0};
    for (Py_ssize_t n = 0; n < b->n; n++) {
        const Py_ssize_t off = (n * b->c + c) * b->s;
        const float *x = b->x + off, *dy = b->dy + off, *y = b->y ? b->y + off : NULL;
        v16 sd = {0}, sdd = {0}, sg = {0}, sgd = {0};
        Py_ssize_t i = 0;
        for (; i + 16 <= b->s; i += 16) {
            const v16 d = *(const v16u *)(x + i) - shift;
            v16 g = *(const v16u *)(dy + i);
            if (y != NULL) {
                g = relu_gate(g, *(const v16u *)(y + i));
            }
            sd += d;
            sdd += d * d;
            sg += g;
            sgd += g * d;
        }
        float tail[4] = {0};
        for (; i < b->s; i++) {
            const float d = x[i] - x0, g = y != NULL ? relu_gate1(dy[i], y[i]) : dy[i];
            tail[0] += d;
            tail[1] += d * d;
            tail[2] += g;
            tail[3] += g * d;
        }
        sums[0] += (double)hsum(sd) + tail[0];
        sums[1] += (double)hsum(sdd) + tail[1];
        sums[2] += (double)hsum(sg) + tail[2];
        sums[3] += (double)hsum(sgd) + tail[3];
    }
}

TARGETS static void bn_apply(const struct bn *b, Py_ssize_t c, float a, float k, float mean,
                             float bias)
{
    /* dx = a g - k (x - mean) + bias: x centered first, so that the rounding of k is not
     * multiplied by x's (possibly large) mean */
    const v16 av = a - (v16){0}, kv = k - (v16){0}, mv = mean - (v16){0};
    const v16 bv = bias - (v16){0};
    for (Py_ssize_t n = 0; n < b->n; n++) {
        const Py_ssize_t off = (n * b->c + c) * b->s;
        const float *x = b->x + off, *dy = b->dy + off, *y = b->y ? b->y + off : NULL;
        float *dx = b->dx + off;
        Py_ssize_t i = 0;
        for (; i + 16 <= b->s; i += 16) {
            v16 g = *(const v16u *)(dy + i);
            if (y != NULL) {
                g = relu_gate(g, *(const v16u *)(y + i));
            }
            *(v16u *)(dx + i) = av * g - kv * (*(const v16u *)(x + i) - mv) + bv;
        }
        for (; i < b->s; i++) {
            const float g = y != NULL ? relu_gate1(dy[i], y[i]) : dy[i];
            dx[i] = a * g - k * (x[i] - mean) + bias;
        }
    }
}

/* relu_gate on a v8 */
static inline __attribute__((always_inline)) v8 relu_gate8(v8 dy, v8 y)
{
    const v8 zero = {0}, one = zero + 1.0f;
    return dy * (v8)((v8i)one & (y > zero));
}

/* bn_sums for narrow_blocks: each v16 as two v8 halves, the same sums */
TARGETS static void bn_sums_narrow(const struct bn *b, Py_ssize_t c, float x0, double sums[4])
{
    const v8 shift = x0 - (v8){0};
    for (Py_ssize_t n = 0; n < b->n; n++) {
        const Py_ssize_t off = (n * b->c + c) * b->s;
        const float *x = b->x + off, *dy = b->dy + off, *y = b->y ? b->y + off : NULL;
        v8 sd[2] = {{0}}, sdd[2] = {{0}}, sg[2] = {{0}}, sgd[2] = {{0}};
        Py_ssize_t i = 0;
        for (; i + 16 <= b->s; i += 16) {
            for (int h = 0; h < 2; h++) {
                const v8 d = *(const v8u *)(x + i + 8 * h) - shift;
                v8 g = *(const v8u *)(dy + i + 8 * h);
                if (y != NULL) {
                    g = relu_gate8(g, *(const v8u *)(y + i + 8 * h));
                }
                sd[h] += d;
                sdd[h] += d * d;
                sg[h] += g;
                sgd[h] += g * d;
            }
        }
        float tail[4] = {0};
        for (; i < b->s; i++) {
            const float d = x[i] - x0, g = y != NULL ? relu_gate1(dy[i], y[i]) : dy[i];
            tail[0] += d;
            tail[1] += d * d;
            tail[2] += g;
            tail[3] += g * d;
        }
        sums[0] += (double)hsum8x2(sd[0], sd[1]) + tail[0];
        sums[1] += (double)hsum8x2(sdd[0], sdd[1]) + tail[1];
        sums[2] += (double)hsum8x2(sg[0], sg[1]) + tail[2];
        sums[3] += (double)hsum8x2(sgd[0], sgd[1]) + tail[3];
    }
}

/* bn_apply for narrow_blocks, in v8 halves of bn_apply's v16 */
TARGETS static void bn_apply_narrow(const struct bn *b, Py_ssize_t c, float a, float k,
                                    float mean, float bias)
{
    const v8 av = a - (v8){0}, kv = k - (v8){0}, mv = mean - (v8){0}, bv = bias - (v8){0};
    for (Py_ssize_t n = 0; n < b->n; n++) {
        const Py_ssize_t off = (n * b->c + c) * b->s;
        const float *x = b->x + off, *dy = b->dy + off, *y = b->y ? b->y + off : NULL;
        float *dx = b->dx + off;
        Py_ssize_t i = 0;
        for (; i + 16 <= b->s; i += 16) {
            for (int h = 0; h < 2; h++) {
                const Py_ssize_t j = i + 8 * h;
                v8 g = *(const v8u *)(dy + j);
                if (y != NULL) {
                    g = relu_gate8(g, *(const v8u *)(y + j));
                }
                *(v8u *)(dx + j) = av * g - kv * (*(const v8u *)(x + j) - mv) + bv;
            }
        }
        for (; i < b->s; i++) {
            const float g = y != NULL ? relu_gate1(dy[i], y[i]) : dy[i];
            dx[i] = a * g - k * (x[i] - mean) + bias;
        }
    }
}

/* The mean of the first plane of a channel (its first s values), the shift of its sums: near
 * the channel's mean, so that sum(g (x - x0)) - mean(x - x0) sum(g) cancels little; 0 where it
 * is not finite (an Inf shift would make NaN). */
static float bn_plane_mean(const float *x, Py_ssize_t s)
{
    double sum = 0.0;
    for (Py_ssize_t i = 0; i < s; i++) {
        sum += x[i];
    }
    return finite_or_zero((float)(sum / (double)s));
}

static int bn_share(const void *arg, int t, int threads)
{
    const struct bn *b = arg;
    const double count = (double)b->n * (double)b->s;
    for (Py_ssize_t c = b->c * t / threads; c < b->c * (t + 1) / threads; c++) {
        const float x0 = bn_plane_mean(b->x + c * b->s, b->s);
        double sums[4] = {0, 0, 0, 0};
        (narrow_blocks ? bn_sums_narrow : bn_sums)(b, c, x0, sums);
        const double shifted_mean = sums[0] / count;
        double var = sums[1] / count - shifted_mean * shifted_mean;
        var = var < 0.0 ? 0.0 : var; /* NaN stays NaN */
        const double mean = x0 + shifted_mean, rstd = 1.0 / sqrt(var + b->eps);
        const double sum_g = sums[2], sum_gc = sums[3] - shifted_mean * sums[2];
        const double dscale = rstd * sum_gc, a = b->scale[c] * rstd;
        const double k = a * rstd * dscale / count, cc = a * sum_g / count;
        if (b->dscale != NULL) {
            b->dscale[c] = (float)dscale;
        }
        b->dbias[c] = (float)sum_g;
        if (b->dx != NULL) {
            /* the graph's dx = a g - (k xc + c - k e), xc = x - mean rounded to float and
             * e = mean(xc) its shift from the mean */
            const float mean_f = (float)mean;
            (narrow_blocks ? bn_apply_narrow : bn_apply)(
                b, c, (float)a, (float)k, mean_f, (float)(k * (mean - (double)mean_f) - cc));
        }
    }
    return 0;
}

PyDoc_STRVAR(batch_norm_grad_doc,
"batch_norm_grad(x, dy, y, scale, dx, dscale, dbias, epsilon, threads)\n--\n\n"
"The gradient of a training-mode BatchNormalization of ``x`` (float32, C-contiguous,\n"
"``[N, C, ...]``) with ``scale`` ``[C]``, given ``dy``, the gradient of its output, or with\n"
"``y`` (not None) the gradient of ``y = Relu(output)``. Writes ``dx`` (``x``'s shape) and\n"
"``dscale``, ``dbias`` (``[C]``), each of ``dx`` and ``dscale`` unless it is None;\n"
"``threads`` threads share the channels.");

static PyObject *batch_norm_grad(PyObject *self, PyObject *args)
{
    PyObject *objects[7];
    double eps;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOOOOOdi:batch_norm_grad", &objects[0], &objects[1],
                          &objects[2], &objects[3], &objects[4], &objects[5], &objects[6], &eps,
                          &threads)) {
        return NULL;
    }
    static const char *names[7] = {"x", "dy", "y", "scale", "dx", "dscale", "dbias"};
    Py_buffer views[7];
    int held[7] = {0};
    PyObject *result = NULL;
    for (int k = 0; k < 7; k++) {
        if ((k == 2 || k == 4 || k == 5) && objects[k] == Py_None) {
            continue; /* no Relu; dx or dscale not wanted */
        }
        if (float32_array(objects[k], &views[k], k == 3 || k >= 5 ? 1 : -1, k >= 4,
                          "batch_norm_grad: argument", k, names[k]) < 0) {
            goto done;
        }
        held[k] = 1;
    }
    const Py_buffer *x = &views[0];
    int fits = x->ndim >= 2;
    for (int k = 1; k < 5 && fits; k++) {
        if (!held[k] || k == 3) {
            continue;
        }
        fits = views[k].ndim == x->ndim;
        for (int d = 0; d < x->ndim && fits; d++) {
            fits = views[k].shape[d] == x->shape[d];
        }
    }
    for (int k = 3; k < 7 && fits; k++) {
        fits = k == 4 || !held[k] || views[k].shape[0] == x->shape[1];
    }
    if (!fits) {
        PyErr_SetString(PyExc_ValueError,
                        "batch_norm_grad: x, dy, y and dx must have one shape [N, C, ...] (rank"
                        " 2 or more) and scale, dscale and dbias the shape [C]");
        goto done;
    }
    struct bn b = {
        .x = x->buf, .dy = views[1].buf, .y = held[2] ? views[2].buf : NULL,
        .scale = views[3].buf, .dx = held[4] ? views[4].buf : NULL,
        .dscale = held[5] ? views[5].buf : NULL,
        .dbias = views[6].buf, .n = x->shape[0], .c = x->shape[1], .eps = eps,
    };
    if (channel_values(x, "batch_norm_grad", &b.s) < 0) {
        goto done;
    }
    run_pool(bn_share, &b, threads);
    result = Py_NewRef(Py_None);
done:
    release_held(views, held, 7);
    return result;
}

/* ------------------------------------------------------- batch normalization forward */

/* A training-mode BatchNormalization's forward pass, a channel at a time: the batch mean and
 * (biased) variance of the channel in one pass (sums shifted by its first element, in double),
 * then y = a x + b (+ addend) (then Relu) with a = scale / sqrt(var + eps), b = bias - a mean,
 * while the channel's planes are still in the cache. */
struct bnf {
    const float *x, *scale, *bias, *addend;
    float *y, *mean, *var;
    Py_ssize_t n, c, s;
    double eps;
    int relu;
};

/* The float32 lanes hold the sums of at most this many values of a plane before they are
 * added into the double sums: a long plane (a BatchNorm over one sample, as over a
 * standardized filter's 4608 taps) would otherwise round its sums over thousands of terms. */
#define BNF_BLOCK 256

TARGETS static void bnf_sums(const struct bnf *b, Py_ssize_t c, float x0, double sums[2])
{
    const v16 shift = x0 - (v16){0};
    for (Py_ssize_t n = 0; n < b->n; n++) {
        const float *x = b->x + (n * b->c + c) * b->s;
        Py_ssize_t i = 0;
        for (; i + 16 <= b->s;) {
            v16 sd = {0}, sdd = {0};
            const Py_ssize_t end = i + BNF_BLOCK < b->s ? i + BNF_BLOCK : b->s;
            for (; i + 16 <= end; i += 16) {
                const v16 d = *(const v16u *)(x + i) - shift;
                sd += d;
                sdd += d * d;
            }
            sums[0] += (double)hsum(sd);
            sums[1] += (double)hsum(sdd);
        }
        float tail[2] = {0};
        for (; i < b->s; i++) {
            const float d = x[i] - x0;
            tail[0] += d;
            tail[1] += d * d;
        }
        sums[0] += tail[0];
        sums[1] += tail[1];
    }
}

TARGETS static void bnf_apply(const struct bnf *b, Py_ssize_t c, float a, float shift)
{
    const v16 av = a - (v16){0}, bv = shift - (v16){0};
    for (Py_ssize_t n = 0; n < b->n; n++) {
        const Py_ssize_t off = (n * b->c + c) * b->s;
        const float *x = b->x + off, *r = b->addend ? b->addend + off : NULL;
        float *y = b->y + off;
        Py_ssize_t i = 0;
        for (; i + 16 <= b->s; i += 16) {
            v16 v = av * *(const v16u *)(x + i) + bv;
            if (r != NULL) {
                v += *(const v16u *)(r + i);
            }
            *(v16u *)(y + i) = b->relu ? relu_max(v) : v;
        }
        for (; i < b->s; i++) {
            float v = a * x[i] + shift + (r != NULL ? r[i] : 0.0f);
            y[i] = b->relu ? relu_max1(v) : v;
        }
    }
}

/* bnf_sums for narrow_blocks: each v16 as two v8 halves, the same sums */
TARGETS static void bnf_sums_narrow(const struct bnf *b, Py_ssize_t c, float x0, double sums[2])
{
    const v8 shift = x0 - (v8){0};
    for (Py_ssize_t n = 0; n < b->n; n++) {
        const float *x = b->x + (n * b->c + c) * b->s;
        Py_ssize_t i = 0;
        for (; i + 16 <= b->s;) {
            v8 sd[2] = {{0}}, sdd[2] = {{0}};
            const Py_ssize_t end = i + BNF_BLOCK < b->s ? i + BNF_BLOCK : b->s;
            for (; i + 16 <= end; i += 16) {
                for (int h = 0; h < 2; h++) {
                    const v8 d = *(const v8u *)(x + i + 8 * h) - shift;
                    sd[h] += d;
                    sdd[h] += d * d;
                }
            }
            sums[0] += (double)hsum8x2(sd[0], sd[1]);
            sums[1] += (double)hsum8x2(sdd[0], sdd[1]);
        }
        float tail[2] = {0};
        for (; i < b->s; i++) {
            const float d = x[i] - x0;
            tail[0] += d;
            tail[1] += d * d;
        }
        sums[0] += tail[0];
        sums[1] += tail[1];
    }
}

/* bnf_apply for narrow_blocks, in v8 halves of bnf_apply's v16 */
TARGETS static void bnf_apply_narrow(const struct bnf *b, Py_ssize_t c, float a, float shift)
{
    const v8 av = a - (v8){0}, bv = shift - (v8){0};
    for (Py_ssize_t n = 0; n < b->n; n++) {
        const Py_ssize_t off = (n * b->c + c) * b->s;
        const float *x = b->x + off, *r = b->addend ? b->addend + off : NULL;
        float *y = b->y + off;
        Py_ssize_t i = 0;
        for (; i + 16 <= b->s; i += 16) {
            for (int h = 0; h < 2; h++) {
                const Py_ssize_t j = i + 8 * h;
                v8 v = av * *(const v8u *)(x + j) + bv;
                if (r != NULL) {
                    v += *(const v8u *)(r + j);
                }
                *(v8u *)(y + j) = b->relu ? relu_max8(v) : v;
            }
        }
        for (; i < b->s; i++) {
            float v = a * x[i] + shift + (r != NULL ? r[i] : 0.0f);
            y[i] = b->relu ? relu_max1(v) : v;
        }
    }
}

static int bnf_share(const void *arg, int t, int threads)
{
    const struct bnf *b = arg;
    const double count = (double)b->n * (double)b->s;
    for (Py_ssize_t c = b->c * t / threads; c < b->c * (t + 1) / threads; c++) {
        const float x0 = finite_or_zero(b->x[c * b->s]); /* an Inf shift would make NaN */
        double sums[2] = {0, 0};
        (narrow_blocks ? bnf_sums_narrow : bnf_sums)(b, c, x0, sums);
        const double shifted_mean = sums[0] / count;
        double var = sums[1] / count - shifted_mean * shifted_mean;
        var = var < 0.0 ? 0.0 : var; /* NaN stays NaN */
        const double mean = x0 + shifted_mean, a = b->scale[c] / sqrt(var + b->eps);
        b->mean[c] = (float)mean;
        b->var[c] = (float)var;
        (narrow_blocks ? bnf_apply_narrow : bnf_apply)(b, c, (float)a,
                                                       (float)(b->bias[c] - a * mean));
    }
    return 0;
}

PyDoc_STRVAR(batch_norm_forward_doc,
"batch_norm_forward(x, scale, bias, addend, y, mean, var, epsilon, relu, threads)\n--\n\n"
"A training-mode BatchNormalization of ``x`` (float32, C-contiguous, ``[N, C, ...]``): writes\n"
"the batch ``mean`` and biased ``var`` (``[C]`` each) and ``y`` (``x``'s shape), the\n"
"normalized ``x`` times ``scale`` plus ``bias`` (``[C]``), plus ``addend`` (``x``'s shape,\n"
"or None), then Relu where ``relu``. ``threads`` threads share the channels.");

static PyObject *batch_norm_forward(PyObject *self, PyObject *args)
{
    PyObject *objects[7];
    double eps;
    int relu, threads;
    if (!PyArg_ParseTuple(args, "OOOOOOOdpi:batch_norm_forward", &objects[0], &objects[1],
                          &objects[2], &objects[3], &objects[4], &objects[5], &objects[6], &eps,
                          &relu, &threads)) {
        return NULL;
    }
    static const char *names[7] = {"x", "scale", "bias", "addend", "y", "mean", "var"};
    static const int ranks[7] = {-1, 1, 1, -1, -1, 1, 1};
    Py_buffer views[7];
    int held[7] = {0};
    PyObject *result = NULL;
    for (int k = 0; k < 7; k++) {
        if (k == 3 && objects[k] == Py_None) {
            continue;
        }
        if (float32_array(objects[k], &views[k], ranks[k], k >= 4, "batch_norm_forward: argument",
                          k, names[k]) < 0) {
            goto done;
        }
        held[k] = 1;
    }
    const Py_buffer *x = &views[0];
    int fits = x->ndim >= 2;
    for (int k = 3; k < 5 && fits; k++) {
        if (!held[k]) {
            continue;
        }
        fits = views[k].ndim == x->ndim;
        for (int d = 0; d < x->ndim && fits; d++) {
            fits = views[k].shape[d] == x->shape[d];
        }
    }
    for (int k = 1; k < 7 && fits; k++) {
        fits = k == 3 || k == 4 || views[k].shape[0] == x->shape[1];
    }
    if (!fits) {
        PyErr_SetString(PyExc_ValueError,
                        "batch_norm_forward: x, addend and y must have one shape [N, C, ...]"
                        " (rank 2 or more) and scale, bias, mean and var the shape [C]");
        goto done;
    }
    struct bnf b = {
        .x = x->buf, .scale = views[1].buf, .bias = views[2].buf,
        .addend = held[3] ? views[3].buf : NULL, .y = views[4].buf, .mean = views[5].buf,
        .var = views[6].buf, .n = x->shape[0], .c = x->shape[1], .eps = eps,
        .relu = relu,
    };
    if (channel_values(x, "batch_norm_forward", &b.s) < 0) {
        goto done;
    }
    run_pool(bnf_share, &b, threads);
    result = Py_NewRef(Py_None);
done:
    release_held(views, held, 7);
    return result;
}

/* ------------------------------------------------------------------ dropout masks */

/* The scaled keep mask of a Dropout lowered by traingraph.ir.random: element i is ``scale``
 * where the hash of (i G + seed) mod 2^32 is below ``threshold``, else 0. */
struct mask {
    float *out;
    Py_ssize_t size;
    uint32_t seed, golden, mix, threshold;
    float scale;
};

typedef uint32_t v16w __attribute__((vector_size(64)));

static inline uint32_t mask_hash(uint32_t h, uint32_t mix)
{
    h *= h + 1u;
    h += h >> 16;
    h *= mix;
    return h + (h >> 16);
}

TARGETS static void mask_range(const void *arg, Py_ssize_t i0, Py_ssize_t i1)
{
    const struct mask *m = arg;
    const v16w lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16i scale = (v16i)(m->scale - (v16){0});
    Py_ssize_t i = i0;
    for (; i + 16 <= i1; i += 16) {
        v16w h = ((uint32_t)i + lanes) * m->golden + m->seed;
        h *= h + 1u;
        h += h >> 16;
        h *= m->mix;
        h += h >> 16;
        *(v16u *)(m->out + i) = (v16)((v16i)(h < m->threshold) & scale);
    }
    for (; i < i1; i++) {
        const uint32_t h = mask_hash((uint32_t)i * m->golden + m->seed, m->mix);
        m->out[i] = h < m->threshold ? m->scale : 0.0f;
    }
}

PyDoc_STRVAR(dropout_mask_doc,
"dropout_mask(out, seed, golden, mix, threshold, scale, threads)\n--\n\n"
"Write the scaled keep mask of a Dropout lowered by ``traingraph.ir.random`` into ``out``\n"
"(float32, C-contiguous, any shape): element ``i`` (row-major) is ``scale`` where\n"
"``hash((i * golden + seed) mod 2**32) < threshold``, else 0, with the hash ``h *= h + 1;\n"
"h += h >> 16; h *= mix; h += h >> 16`` on unsigned 32-bit integers. ``threads`` threads\n"
"share the elements (one below 64K elements).");

static PyObject *dropout_mask(PyObject *self, PyObject *args)
{
    PyObject *object;
    unsigned long seed, golden, mix, threshold;
    float scale;
    int threads;
    if (!PyArg_ParseTuple(args, "Okkkkfi:dropout_mask", &object, &seed, &golden, &mix,
                          &threshold, &scale, &threads)) {
        return NULL;
    }
    Py_buffer view;
    if (float32_array(object, &view, -1, 1, "dropout_mask: argument", 0, "out") < 0) {
        return NULL;
    }
    struct mask m = {
        .out = view.buf, .size = view.len / 4, .seed = (uint32_t)seed,
        .golden = (uint32_t)golden, .mix = (uint32_t)mix, .threshold = (uint32_t)threshold,
        .scale = scale,
    };
    run_elementwise(mask_range, &m, m.size, threads);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------- column sums */

/* out[n, c] = (addends + the sum over terms of col2im(cols)) where gate > 0, else 0. Column
 * l = u * ow + v of kernel offset (i, j) of a term goes to image position
 * (u s0 + i d0 - p0, v s1 + j d1 - p1), dropped outside the image.
 *
 * A plane is built in the cache. A term's columns are added row by row, whole rows of ow, into
 * phase planes: along a stride s1 the image columns congruent to b mod s1 form phase b, where
 * each kernel offset's columns land contiguously; each phase row has room on both sides for
 * the columns that fall outside the image, so that no row is cut short (a partial vector
 * written and then read whole stalls). The phases are then interleaved into the plane. A
 * stride-1 term whose columns all land inside the image is added into the plane directly. */
struct col2im_run;

struct col2im_term {
    const float *cols; /* [n, c * kh * kw, oh * ow] */
    Py_ssize_t kh, kw, oh, ow, stride[2], pad[2], dilation[2];
    /* set by col2im_layout */
    const struct col2im_run *runs;
    Py_ssize_t run_count;
    Py_ssize_t pitch, left; /* phase rows: pitch floats, image column b + s1 k at left + k */
    int direct;             /* added into the plane itself (pitch w, left 0) */
};

/* Rows [u0, u1) of one kernel offset's columns (at `src` in the plane's columns) are added at
 * `dst` + u * `step` in the phase planes. */
struct col2im_run {
    Py_ssize_t src, dst, u0, u1, step;
};

struct col2im {
    float *out; /* [n, c, h, w] */
    const struct col2im_term *terms;
    Py_ssize_t term_count;
    const float **addends; /* each [n, c, h, w] */
    Py_ssize_t addend_count;
    const float *gate; /* [n, c, h, w] or NULL */
    Py_ssize_t n, c, h, w;
};

static struct scratch col2im_scratch[MAX_THREADS];


static inline __attribute__((always_inline)) void add_row(float *restrict d,
                                                          const float *restrict s,
                                                          Py_ssize_t count)
{
    Py_ssize_t k = 0;
    for (; k + 16 <= count; k += 16) {
        *(v16u *)(d + k) += *(const v16u *)(s + k);
    }
    if (k + 8 <= count) {
        *(v8u *)(d + k) += *(const v8u *)(s + k);
        k += 8;
    }
    for (; k < count; k++) {
        d[k] += s[k];
    }
}

static inline Py_ssize_t floor_div(Py_ssize_t a, Py_ssize_t b)
{
    return a >= 0 ? a / b : -((-a + b - 1) / b);
}

/* Term t's phase layout and runs (written to `runs`, kh * kw at most) for an image h x w. */
static void col2im_layout(struct col2im_term *t, Py_ssize_t h, Py_ssize_t w,
                          struct col2im_run *runs)
{
    const Py_ssize_t s0 = t->stride[0], s1 = t->stride[1], l = t->oh * t->ow;
    /* image column v s1 + off = s1 (v + q) + b: phase b, place v + q for v < ow */
    Py_ssize_t low = 0, high = (w + s1 - 1) / s1;
    for (Py_ssize_t j = 0; j < t->kw; j++) {
        const Py_ssize_t q = floor_div(j * t->dilation[1] - t->pad[1], s1);
        low = q < low ? q : low;
        high = q + t->ow > high ? q + t->ow : high;
    }
    t->direct = s1 == 1 && low == 0 && high == w;
    t->left = -low;
    t->pitch = t->direct ? w : high - low;
    t->runs = runs;
    t->run_count = 0;
    for (Py_ssize_t i = 0; i < t->kh; i++) {
        /* rows u with 0 <= u s0 + r < h */
        const Py_ssize_t r = i * t->dilation[0] - t->pad[0];
        const Py_ssize_t u0 = r >= 0 ? 0 : (-r + s0 - 1) / s0;
        Py_ssize_t u1 = h - 1 - r < 0 ? 0 : (h - 1 - r) / s0 + 1;
        u1 = u1 < t->oh ? u1 : t->oh;
        if (u1 <= u0) {
            continue;
        }
        for (Py_ssize_t j = 0; j < t->kw; j++) {
            const Py_ssize_t off = j * t->dilation[1] - t->pad[1];
            const Py_ssize_t q = floor_div(off, s1), b = off - q * s1;
            runs[t->run_count++] = (struct col2im_run){
                .src = (i * t->kw + j) * l, .dst = (b * h + r) * t->pitch + t->left + q,
                .u0 = u0, .u1 = u1, .step = s0 * t->pitch,
            };
        }
    }
}

/* Plane p's columns of term t added into `phases` along its runs. */
TARGETS static void col2im_phases(const struct col2im_term *t, Py_ssize_t p, float *phases)
{
    const Py_ssize_t ow = t->ow;
    const float *base = t->cols + p * t->kh * t->kw * t->oh * ow;
    for (Py_ssize_t k = 0; k < t->run_count; k++) {
        const struct col2im_run *run = &t->runs[k];
        const float *src = base + run->src;
        float *dst = phases + run->dst;
        for (Py_ssize_t u = run->u0; u < run->u1; u++) {
            add_row(dst + u * run->step, src + u * ow, ow);
        }
    }
}

/* plane += the phases of term t interleaved. */
TARGETS static void interleave_add(const struct col2im_term *t, float *plane,
                                   const float *phases, Py_ssize_t h, Py_ssize_t w)
{
    const Py_ssize_t s1 = t->stride[1], pitch = t->pitch;
    for (Py_ssize_t y = 0; y < h; y++) {
        float *row = plane + y * w;
        const float *first = phases + y * pitch + t->left;
        if (s1 == 1) {
            add_row(row, first, w);
            continue;
        }
        Py_ssize_t v = 0;
        if (s1 == 2) {
            const float *even = first, *odd = first + h * pitch;
#if defined(__GNUC__) && !defined(__clang__)
            const v16i low = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
            const v16i high = low + 8;
            for (; 2 * v + 32 <= w; v += 16) {
                const v16 e = *(const v16u *)(even + v), o = *(const v16u *)(odd + v);
                *(v16u *)(row + 2 * v) += __builtin_shuffle(e, o, low);
                *(v16u *)(row + 2 * v + 16) += __builtin_shuffle(e, o, high);
            }
            typedef int v8i __attribute__((vector_size(32)));
            const v8i low8 = {0, 8, 1, 9, 2, 10, 3, 11}, high8 = low8 + 4;
            for (; 2 * v + 16 <= w; v += 8) {
                const v8u e = *(const v8u *)(even + v), o = *(const v8u *)(odd + v);
                *(v8u *)(row + 2 * v) += __builtin_shuffle(e, o, low8);
                *(v8u *)(row + 2 * v + 8) += __builtin_shuffle(e, o, high8);
            }
#endif
            for (; 2 * v + 1 < w; v++) {
                row[2 * v] += even[v];
                row[2 * v + 1] += odd[v];
            }
            v *= 2;
        }
        for (Py_ssize_t x = v; x < w; x++) {
            row[x] += first[(x % s1) * h * pitch + x / s1];
        }
    }
}

TARGETS static void gate_plane(float *plane, const float *gate, Py_ssize_t size)
{
    for (Py_ssize_t x = 0; x < size; x++) {
        plane[x] *= (float)(gate[x] > 0.0f);
    }
}

static int col2im_share(const void *arg, int t, int threads)
{
    const struct col2im *cm = arg;
    const Py_ssize_t planes = cm->n * cm->c, hw = cm->h * cm->w;
    Py_ssize_t widest = 1;
    for (Py_ssize_t k = 0; k < cm->term_count; k++) {
        const struct col2im_term *term = &cm->terms[k];
        const Py_ssize_t size = term->direct ? 1 : term->stride[1] * cm->h * term->pitch;
        widest = size > widest ? size : widest;
    }
    if (reserve(&col2im_scratch[t], (size_t)widest, 0) < 0) {
        return -1;
    }
    float *phases = col2im_scratch[t].data;
    for (Py_ssize_t p = planes * t / threads; p < planes * (t + 1) / threads; p++) {
        float *plane = cm->out + p * hw;
        if (cm->addend_count == 0) {
            memset(plane, 0, sizeof(float) * (size_t)hw);
        }
        else {
            memcpy(plane, cm->addends[0] + p * hw, sizeof(float) * (size_t)hw);
            for (Py_ssize_t a = 1; a < cm->addend_count; a++) {
                add_row(plane, cm->addends[a] + p * hw, hw);
            }
        }
        for (Py_ssize_t k = 0; k < cm->term_count; k++) {
            const struct col2im_term *term = &cm->terms[k];
            if (term->direct) {
                col2im_phases(term, p, plane);
                continue;
            }
            memset(phases, 0, sizeof(float) * (size_t)(term->stride[1] * cm->h * term->pitch));
            col2im_phases(term, p, phases);
            interleave_add(term, plane, phases, cm->h, cm->w);
        }
        if (cm->gate != NULL) {
            gate_plane(plane, cm->gate + p * hw, hw);
        }
    }
    return 0;
}

PyDoc_STRVAR(col2im_sum_doc,
"col2im_sum(out, terms, addends, gate, threads)\n--\n\n"
"Write into ``out`` (float32, C-contiguous, ``[N, C, H, W]``) the sum of the ``addends``\n"
"(arrays of ``out``'s shape) and of each term's columns added into the image (ONNX Col2Im),\n"
"kept where ``gate`` (an array of ``out``'s shape, or None) is above 0 and 0 elsewhere.\n\n"
"Each term is ``(cols, kernel, grid, strides, pads, dilations)``: ``cols``\n"
"``[N, C * KH * KW, OH * OW]``, the pairs ``kernel`` (KH, KW), ``grid`` (OH, OW), strides,\n"
"begin pads and dilations; column ``u * OW + v`` of kernel offset ``(i, j)`` goes to image\n"
"position ``(u * s0 + i * d0 - p0, v * s1 + j * d1 - p1)``, or nowhere outside the image.\n"
"``threads`` threads share the planes.");

static PyObject *col2im_sum(PyObject *self, PyObject *args)
{
    PyObject *out_obj, *term_seq, *addend_seq, *gate_obj;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOOi:col2im_sum", &out_obj, &term_seq, &addend_seq, &gate_obj,
                          &threads)) {
        return NULL;
    }
    PyObject *terms = PySequence_Fast(term_seq, "col2im_sum: terms must be a sequence");
    PyObject *addends = terms ? PySequence_Fast(addend_seq, "col2im_sum: addends must be a sequence")
                              : NULL;
    const Py_ssize_t term_count = terms ? PySequence_Fast_GET_SIZE(terms) : 0;
    const Py_ssize_t addend_count = addends ? PySequence_Fast_GET_SIZE(addends) : 0;
    const Py_ssize_t view_count = 2 + term_count + addend_count;
    Py_buffer *views = calloc((size_t)view_count, sizeof(Py_buffer));
    struct col2im_term *ts = calloc((size_t)(term_count + 1), sizeof(struct col2im_term));
    const float **as = calloc((size_t)(addend_count + 1), sizeof(float *));
    struct col2im_run *runs = NULL;
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    if (terms == NULL || addends == NULL) {
        goto done;
    }
    if (views == NULL || ts == NULL || as == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (float32_array(out_obj, &views[held], 4, 1, "col2im_sum: argument", 0, "out") < 0) {
        goto done;
    }
    held++;
    const Py_ssize_t *os = views[0].shape;
    struct col2im cm = {
        .out = views[0].buf, .terms = ts, .term_count = term_count, .addends = as,
        .addend_count = addend_count, .n = os[0], .c = os[1], .h = os[2], .w = os[3],
    };
    for (Py_ssize_t i = 0; i < term_count; i++) {
        PyObject *cols;
        Py_ssize_t kh, kw, oh, ow, st[2], pd[2], dl[2];
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(terms, i), "O(nn)(nn)(nn)(nn)(nn)", &cols,
                              &kh, &kw, &oh, &ow, &st[0], &st[1], &pd[0], &pd[1], &dl[0], &dl[1])) {
            goto done;
        }
        if (float32_array(cols, &views[held], 3, 0, "col2im_sum: term", i, "cols") < 0) {
            goto done;
        }
        const Py_ssize_t *cs = views[held].shape;
        ts[i] = (struct col2im_term){
            .cols = views[held].buf, .kh = kh, .kw = kw, .oh = oh, .ow = ow,
            .stride = {st[0], st[1]}, .pad = {pd[0], pd[1]}, .dilation = {dl[0], dl[1]},
        };
        held++;
        const int fits = kh >= 1 && kw >= 1 && oh >= 0 && ow >= 0 && st[0] >= 1 && st[1] >= 1 &&
                         dl[0] >= 1 && dl[1] >= 1 && cs[0] == cm.n && cs[1] == cm.c * kh * kw &&
                         cs[2] == oh * ow;
        if (!fits) {
            PyErr_Format(PyExc_ValueError,
                         "col2im_sum: term %zd: cols [%zd, %zd, %zd] with kernel (%zd, %zd), grid"
                         " (%zd, %zd), strides (%zd, %zd) and dilations (%zd, %zd) do not fill"
                         " out [%zd, %zd, %zd, %zd]; cols must be [N, C * KH * KW, OH * OW]",
                         i, cs[0], cs[1], cs[2], kh, kw, oh, ow, st[0], st[1], dl[0], dl[1],
                         os[0], os[1], os[2], os[3]);
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i <= addend_count; i++) {
        PyObject *obj = i < addend_count ? PySequence_Fast_GET_ITEM(addends, i) : gate_obj;
        if (obj == Py_None && i == addend_count) {
            break;
        }
        const char *name = i < addend_count ? "addend" : "gate";
        if (float32_array(obj, &views[held], 4, 0, "col2im_sum: argument", i, name) < 0) {
            goto done;
        }
        const Py_ssize_t *s = views[held].shape;
        held++;
        if (s[0] != os[0] || s[1] != os[1] || s[2] != os[2] || s[3] != os[3]) {
            PyErr_Format(PyExc_ValueError,
                         "col2im_sum: %s [%zd, %zd, %zd, %zd] does not have out's shape"
                         " [%zd, %zd, %zd, %zd]", name, s[0], s[1], s[2], s[3], os[0], os[1],
                         os[2], os[3]);
            goto done;
        }
        if (i < addend_count) {
            as[i] = views[held - 1].buf;
        }
        else {
            cm.gate = views[held - 1].buf;
        }
    }
    Py_ssize_t offsets = 0;
    for (Py_ssize_t i = 0; i < term_count; i++) {
        offsets += ts[i].kh * ts[i].kw;
    }
    runs = malloc(sizeof(struct col2im_run) * (size_t)(offsets + 1));
    if (runs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0, at = 0; i < term_count; i++) {
        col2im_layout(&ts[i], cm.h, cm.w, runs + at);
        at += ts[i].run_count;
    }
    if (run_shares(col2im_share, &cm, cm.n * cm.c * cm.h * cm.w, threads) < 0) {
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    release_views(views, held);
    free(runs);
    free(views);
    free(ts);
    free(as);
    Py_XDECREF(terms);
    Py_XDECREF(addends);
    return result;
}

/* ------------------------------------------------------------ direct convolution forward */

/* y = Conv(x, w, b) (then Relu where `relu`) with strides and dilations 1 and one group,
 * computed directly: each output row is a sum over (c, i, j) of an input row shifted by j,
 * times a filter tap. A block of up to 8 filters by up to 32 columns stays in 16 vector
 * registers while the taps stream by, every input vector loaded once for the 8 filters. The
 * rows a unit of work reads are copied with their zero padding into a slab first, so no load
 * needs a bound. For the few input channels of a network's first layer, where onnxruntime's
 * blocked convolution pads the filters to its block and reorders its output. */
struct direct {
    const float *x, *b;
    float *y;
    const float *taps; /* [ceil(M / 8)][C][KH][KW][8], zeros past M */
    Py_ssize_t n, c, h, w, m, kh, kw, oh, ow, pad_top, pad_left;
    Py_ssize_t rows;     /* output rows per unit of work */
    Py_ssize_t pitch;    /* floats per slab row */
    Py_ssize_t channels; /* channels summed in one run, the runs' sums then added */
    int relu;
};

#define DIRECT_FILTERS 8
#define DIRECT_VECTORS 2
/* the block where vector registers are narrow (narrow_blocks): 4 filters by 16 columns, the
 * runs' sums in registers and the totals they are added to in memory */
#define DIRECT_NARROW_FILTERS 4
/* products summed in one run: the rounding error of a run grows with its length, so the
 * channels go in runs of about this many products whose sums are then added */
#define DIRECT_RUN 64

static struct scratch direct_scratch[MAX_THREADS];

/* Filters [m0, m0 + mb) and columns [x0, x0 + valid) of an output row, at `out` for filter m0,
 * from row `srow` of the slab on (mb <= 8; vb vectors cover valid <= 16 vb columns). */
static inline __attribute__((always_inline)) void direct_block(
    const struct direct *d, const float *slab, Py_ssize_t srow, const float *taps, float *out,
    Py_ssize_t m0, Py_ssize_t x0, Py_ssize_t valid, const int mb, const int vb)
{
    v16 acc[DIRECT_FILTERS][DIRECT_VECTORS];
    for (int f = 0; f < mb; f++) {
        for (int v = 0; v < vb; v++) {
            acc[f][v] = (v16){0};
        }
    }
    const Py_ssize_t srows = d->rows + d->kh - 1;
    for (Py_ssize_t c0 = 0; c0 < d->c; c0 += d->channels) {
        const Py_ssize_t c1 = d->c - c0 < d->channels ? d->c : c0 + d->channels;
        v16 run[DIRECT_FILTERS][DIRECT_VECTORS];
        for (int f = 0; f < mb; f++) {
            for (int v = 0; v < vb; v++) {
                run[f][v] = (v16){0};
            }
        }
        for (Py_ssize_t c = c0; c < c1; c++) {
            for (Py_ssize_t i = 0; i < d->kh; i++) {
                const float *row = slab + (c * srows + srow + i) * d->pitch + x0;
                const float *tap = taps + (c * d->kh + i) * d->kw * DIRECT_FILTERS;
                for (Py_ssize_t j = 0; j < d->kw; j++) {
                    v16 in[DIRECT_VECTORS];
                    for (int v = 0; v < vb; v++) {
                        in[v] = *(const v16u *)(row + j + 16 * v);
                    }
                    for (int f = 0; f < mb; f++) {
                        const float t = tap[j * DIRECT_FILTERS + f];
                        for (int v = 0; v < vb; v++) {
                            run[f][v] += in[v] * t;
                        }
                    }
                }
            }
        }
        for (int f = 0; f < mb; f++) {
            for (int v = 0; v < vb; v++) {
                acc[f][v] += run[f][v];
            }
        }
    }
    const Py_ssize_t plane = d->oh * d->ow;
    for (int f = 0; f < mb; f++) {
        const float bias = d->b != NULL ? d->b[m0 + f] : 0.0f;
        float *dst = out + f * plane + x0;
        for (int v = 0; v < vb; v++) {
            v16 r = acc[f][v] + bias;
            if (d->relu) {
                r = relu_max(r);
            }
            const Py_ssize_t left = valid - 16 * v;
            if (left >= 16) {
                *(v16u *)(dst + 16 * v) = r;
            }
            else {
                float tail[16] __attribute__((aligned(64)));
                *(v16 *)tail = r;
                memcpy(dst + 16 * v, tail, sizeof(float) * (size_t)left);
            }
        }
    }
}


/* direct_block for narrow_blocks: filters [m0, m0 + mb) (mb <= 4) and columns [x0, x0 + valid)
 * (valid <= 16) of an output row, each v16 of sums as two v8 halves (the same sums). */
static inline __attribute__((always_inline)) void direct_block_narrow(
    const struct direct *d, const float *slab, Py_ssize_t srow, const float *taps, float *out,
    Py_ssize_t m0, Py_ssize_t x0, Py_ssize_t valid, const int mb)
{
    float acc[DIRECT_NARROW_FILTERS][16] __attribute__((aligned(32)));
    for (int f = 0; f < mb; f++) {
        *(v8 *)acc[f] = *(v8 *)(acc[f] + 8) = (v8){0};
    }
    const Py_ssize_t srows = d->rows + d->kh - 1;
    for (Py_ssize_t c0 = 0; c0 < d->c; c0 += d->channels) {
        const Py_ssize_t c1 = d->c - c0 < d->channels ? d->c : c0 + d->channels;
        v8 run[DIRECT_NARROW_FILTERS][2];
        for (int f = 0; f < mb; f++) {
            run[f][0] = run[f][1] = (v8){0};
        }
        for (Py_ssize_t c = c0; c < c1; c++) {
            for (Py_ssize_t i = 0; i < d->kh; i++) {
                const float *row = slab + (c * srows + srow + i) * d->pitch + x0;
                const float *tap = taps + (c * d->kh + i) * d->kw * DIRECT_FILTERS;
                for (Py_ssize_t j = 0; j < d->kw; j++) {
                    const v8 in0 = *(const v8u *)(row + j), in1 = *(const v8u *)(row + j + 8);
                    for (int f = 0; f < mb; f++) {
                        const float t = tap[j * DIRECT_FILTERS + f];
                        run[f][0] += in0 * t;
                        run[f][1] += in1 * t;
                    }
                }
            }
        }
        for (int f = 0; f < mb; f++) {
            *(v8 *)acc[f] += run[f][0];
            *(v8 *)(acc[f] + 8) += run[f][1];
        }
    }
    const Py_ssize_t plane = d->oh * d->ow;
    for (int f = 0; f < mb; f++) {
        const float bias = d->b != NULL ? d->b[m0 + f] : 0.0f;
        float r[16] __attribute__((aligned(32)));
        for (int h = 0; h < 2; h++) {
            const v8 v = *(const v8 *)(acc[f] + 8 * h) + bias;
            *(v8 *)(r + 8 * h) = d->relu ? relu_max8(v) : v;
        }
        memcpy(out + f * plane + x0, r, sizeof(float) * (size_t)valid);
    }
}

#define DIRECT_NARROW(mb)                                                                         \
    TARGETS static void direct_narrow_##mb(const struct direct *d, const float *slab,            \
                                           Py_ssize_t srow, const float *taps, float *out,        \
                                           Py_ssize_t m0, Py_ssize_t x0, Py_ssize_t valid)        \
    {                                                                                             \
        direct_block_narrow(d, slab, srow, taps, out, m0, x0, valid, mb);                         \
    }
DIRECT_NARROW(1) DIRECT_NARROW(2) DIRECT_NARROW(3) DIRECT_NARROW(4)

#define DIRECT_BLOCK(mb, vb)                                                                      \
    TARGETS static void direct_block_##mb##_##vb(const struct direct *d, const float *slab,      \
                                                 Py_ssize_t srow, const float *taps, float *out,  \
                                                 Py_ssize_t m0, Py_ssize_t x0, Py_ssize_t valid)  \
    {                                                                                             \
        direct_block(d, slab, srow, taps, out, m0, x0, valid, mb, vb);                            \
    }
#define DIRECT_BLOCKS(mb) DIRECT_BLOCK(mb, 1) DIRECT_BLOCK(mb, 2)
DIRECT_BLOCKS(1) DIRECT_BLOCKS(2) DIRECT_BLOCKS(3) DIRECT_BLOCKS(4)
DIRECT_BLOCKS(5) DIRECT_BLOCKS(6) DIRECT_BLOCKS(7) DIRECT_BLOCKS(8)

typedef void (*direct_fn)(const struct direct *, const float *, Py_ssize_t, const float *,
                          float *, Py_ssize_t, Py_ssize_t, Py_ssize_t);
#define DIRECT_ROW(mb) {direct_block_##mb##_1, direct_block_##mb##_2}
static const direct_fn direct_blocks[DIRECT_FILTERS][DIRECT_VECTORS] = {
    DIRECT_ROW(1), DIRECT_ROW(2), DIRECT_ROW(3), DIRECT_ROW(4),
    DIRECT_ROW(5), DIRECT_ROW(6), DIRECT_ROW(7), DIRECT_ROW(8),
};
static const direct_fn direct_narrow[DIRECT_NARROW_FILTERS] = {
    direct_narrow_1, direct_narrow_2, direct_narrow_3, direct_narrow_4,
};

/* The slab of sample n for output rows [oy0, oy0 + rows): the input rows they read, each at
 * column pad_left of a zeroed row of `pitch`, zero rows outside the image. */
static void direct_slab(const struct direct *d, float *slab, Py_ssize_t n, Py_ssize_t oy0)
{
    const Py_ssize_t srows = d->rows + d->kh - 1;
    for (Py_ssize_t c = 0; c < d->c; c++) {
        const float *plane = d->x + (n * d->c + c) * d->h * d->w;
        for (Py_ssize_t r = 0; r < srows; r++) {
            float *dst = slab + (c * srows + r) * d->pitch;
            const Py_ssize_t iy = oy0 + r - d->pad_top;
            memset(dst, 0, sizeof(float) * (size_t)d->pitch);
            if (iy >= 0 && iy < d->h) {
                memcpy(dst + d->pad_left, plane + iy * d->w, sizeof(float) * (size_t)d->w);
            }
        }
    }
}

static int direct_share(const void *arg, int t, int threads)
{
    const struct direct *d = arg;
    const Py_ssize_t per_sample = (d->oh + d->rows - 1) / d->rows, units = d->n * per_sample;
    const Py_ssize_t srows = d->rows + d->kh - 1;
    if (reserve(&direct_scratch[t], (size_t)(d->c * srows * d->pitch), 0) < 0) {
        return -1;
    }
    float *slab = direct_scratch[t].data;
    const Py_ssize_t blocks = (d->m + DIRECT_FILTERS - 1) / DIRECT_FILTERS;
    /* the filters and columns of one call: a whole block of the taps' layout, or part of one */
    const Py_ssize_t part = narrow_blocks ? DIRECT_NARROW_FILTERS : DIRECT_FILTERS;
    const Py_ssize_t span = narrow_blocks ? 16 : 16 * DIRECT_VECTORS;
    for (Py_ssize_t u = units * t / threads; u < units * (t + 1) / threads; u++) {
        const Py_ssize_t n = u / per_sample, oy0 = u % per_sample * d->rows;
        const Py_ssize_t oy1 = oy0 + d->rows < d->oh ? oy0 + d->rows : d->oh;
        direct_slab(d, slab, n, oy0);
        for (Py_ssize_t blk = 0; blk < blocks; blk++) {
            const Py_ssize_t m0 = blk * DIRECT_FILTERS;
            const Py_ssize_t mb = d->m - m0 < DIRECT_FILTERS ? d->m - m0 : DIRECT_FILTERS;
            const float *taps = d->taps + blk * d->c * d->kh * d->kw * DIRECT_FILTERS;
            for (Py_ssize_t oy = oy0; oy < oy1; oy++) {
                for (Py_ssize_t f0 = 0; f0 < mb; f0 += part) {
                    const Py_ssize_t fb = mb - f0 < part ? mb - f0 : part;
                    float *out = d->y + ((n * d->m + m0 + f0) * d->oh + oy) * d->ow;
                    for (Py_ssize_t x0 = 0; x0 < d->ow; x0 += span) {
                        const Py_ssize_t valid = d->ow - x0 < span ? d->ow - x0 : span;
                        const direct_fn block =
                            narrow_blocks ? direct_narrow[fb - 1] : direct_blocks[fb - 1][valid > 16];
                        block(d, slab, oy - oy0, taps + f0, out, m0 + f0, x0, valid);
                    }
                }
            }
        }
    }
    return 0;
}

PyDoc_STRVAR(conv_direct_doc,
"conv_direct(x, w, b, y, pads, relu, threads)\n--\n\n"
"Write into ``y`` (float32, C-contiguous, ``[N, M, OH, OW]``) the convolution of ``x``\n"
"``[N, C, H, W]`` with the filters ``w`` ``[M, C, KH, KW]`` and the bias ``b`` ``[M]`` (or\n"
"None), strides and dilations 1, one group, begin ``pads`` (top, left); then Relu where\n"
"``relu``. ``y``'s shape sets the end pads: ``OH = H + top + bottom - KH + 1``, likewise\n"
"``OW``. ``threads`` threads share the samples and rows.");

static PyObject *conv_direct(PyObject *self, PyObject *args)
{
    PyObject *objects[4];
    Py_ssize_t top, left;
    int relu, threads;
    if (!PyArg_ParseTuple(args, "OOOO(nn)pi:conv_direct", &objects[0], &objects[1], &objects[2],
                          &objects[3], &top, &left, &relu, &threads)) {
        return NULL;
    }
    static const char *names[4] = {"x", "w", "b", "y"};
    static const int ranks[4] = {4, 4, 1, 4};
    Py_buffer views[4];
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    float *taps = NULL;
    for (int k = 0; k < 4; k++) {
        if (objects[k] == Py_None && k == 2) {
            continue;
        }
        if (float32_array(objects[k], &views[held], ranks[k], k == 3, "conv_direct: argument", k,
                          names[k]) < 0) {
            goto done;
        }
        held++;
    }
    const int has_bias = objects[2] != Py_None;
    const Py_ssize_t *xs = views[0].shape, *ws = views[1].shape;
    const Py_ssize_t *ys = views[has_bias ? 3 : 2].shape;
    const Py_ssize_t n = xs[0], c = xs[1], h = xs[2], w = xs[3], m = ws[0], kh = ws[2], kw = ws[3];
    const Py_ssize_t oh = ys[2], ow = ys[3];
    /* any end pads: the slab's rows and columns past the image are zeros */
    const int fits = ws[1] == c && ys[0] == n && ys[1] == m && kh >= 1 && kw >= 1 && top >= 0 &&
                     left >= 0 && oh >= 1 && ow >= 1 && (!has_bias || views[2].shape[0] == m);
    if (!fits) {
        PyErr_Format(PyExc_ValueError,
                     "conv_direct: x [%zd, %zd, %zd, %zd], w [%zd, %zd, %zd, %zd], y [%zd, %zd,"
                     " %zd, %zd] and begin pads (%zd, %zd) are not one convolution; y must be"
                     " [N, M, OH, OW] with w [M, C, KH, KW], b [M] and pads >= 0",
                     n, c, h, w, ws[0], ws[1], kh, kw, ys[0], ys[1], oh, ow, top, left);
        goto done;
    }
    const Py_ssize_t blocks = (m + DIRECT_FILTERS - 1) / DIRECT_FILTERS, area = c * kh * kw;
    taps = calloc((size_t)(blocks * area * DIRECT_FILTERS + 1), sizeof(float));
    if (taps == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const float *wv = views[1].buf;
    for (Py_ssize_t f = 0; f < m; f++) {
        float *dst = taps + f / DIRECT_FILTERS * area * DIRECT_FILTERS + f % DIRECT_FILTERS;
        for (Py_ssize_t k = 0; k < area; k++) {
            dst[k * DIRECT_FILTERS] = wv[f * area + k];
        }
    }
    Py_ssize_t pitch = round16(ow) + kw - 1;
    pitch = round16(pitch > left + w ? pitch : left + w);
    if (n * m * oh * ow < ROUTE_PER_THREAD / 4 || threads < 1) {
        threads = 1;
    }
    /* enough units for the threads, each slab within about half an L2 cache */
    Py_ssize_t per_sample = (4 * threads + n - 1) / n;
    Py_ssize_t rows = (oh + per_sample - 1) / per_sample;
    const Py_ssize_t fit = (CHUNK_BYTES / 2 / (Py_ssize_t)sizeof(float)) / (c * pitch) - kh + 1;
    rows = rows < fit ? rows : fit;
    rows = rows > 1 ? rows : 1;
    struct direct d = {
        .x = views[0].buf, .b = has_bias ? views[2].buf : NULL, .y = views[held - 1].buf,
        .taps = taps, .n = n, .c = c, .h = h, .w = w, .m = m, .kh = kh, .kw = kw, .oh = oh,
        .ow = ow, .pad_top = top, .pad_left = left, .rows = rows, .pitch = pitch,
        .channels = (DIRECT_RUN + kh * kw - 1) / (kh * kw), .relu = relu,
    };
    result = run_pool(direct_share, &d, threads) < 0 ? NULL : Py_NewRef(Py_None);
done:
    release_views(views, held);
    free(taps);
    return result;
}

#include "winograd.h"
#include "gelu.h"
#include "layernorm.h"
#include "permute.h"
#include "clip.h"
#include "maxpool.h"
#include "activation_grads.h"
#include "lstm_cell.h"
#include "depthwise.h"
#include "depthwise_weight.h"
#include "unfold.h"

/* ------------------------------------------------ row scatter-add (an embedding's gradient) */

/* out = data (or zeros); out[index[i]] += updates[i] for i in order: ScatterElements(axis=0,
 * reduction="add") of indices constant along each row. The threads split the rows of out; each
 * writes its rows' start, then walks every index in order and adds the updates of those in its
 * rows, so that each row's sum is taken in the graph's order. */
struct scatter_rows {
    const int64_t *index; /* [m], each in [-d, d) */
    const float *updates; /* [m, r] */
    const float *data;    /* [d, r], or NULL for zeros */
    float *out;           /* [d, r] */
    Py_ssize_t m, d, r;
};

/* o += u over r floats as onnxruntime's x86 build adds them (o + u, where two NaNs give the
 * first's): a NaN of o stays (quieted, as o + o gives it), so that the payload and sign of a NaN
 * already in a row do not depend on the operand order the compiler picks. */
static inline __attribute__((always_inline)) void scatter_row_add(float *restrict o,
                                                                  const float *restrict u,
                                                                  Py_ssize_t r)
{
    Py_ssize_t k = 0;
    for (; k + 16 <= r; k += 16) {
        const v16 a = *(const v16u *)(o + k);
        *(v16u *)(o + k) = a + gelu_select_16(a == a, *(const v16u *)(u + k), a);
    }
    for (; k < r; k++) {
        const float a = o[k];
        o[k] = a + (a == a ? u[k] : a);
    }
}

TARGETS static int scatter_rows_share(const void *arg, int t, int threads)
{
    const struct scatter_rows *s = arg;
    const Py_ssize_t r0 = s->d * t / threads, r1 = s->d * (t + 1) / threads, r = s->r;
    if (r1 <= r0) {
        return 0;
    }
    float *out = s->out + r0 * r;
    const size_t bytes = sizeof(float) * (size_t)((r1 - r0) * r);
    if (s->data == NULL) {
        memset(out, 0, bytes);
    }
    else if (s->data != s->out) {
        memcpy(out, s->data + r0 * r, bytes);
    }
    for (Py_ssize_t i = 0; i < s->m; i++) {
        const int64_t v = s->index[i];
        const int64_t row = v < 0 ? v + s->d : v;
        if (row >= r0 && row < r1) {
            scatter_row_add(s->out + row * r, s->updates + i * r, r);
        }
    }
    return 0;
}

PyDoc_STRVAR(scatter_add_rows_doc,
"scatter_add_rows(index, updates, data, out, threads)\n--\n\n"
"Write ``data`` (zeros where it is None) into ``out`` ``[D, R]``, then add row ``updates[i]``\n"
"into row ``index[i]`` for each ``i`` in order: ``ScatterElements(data, indices, updates,\n"
"axis=0, reduction=\"add\")`` where every element of row ``i`` of ``indices`` is ``index[i]``.\n"
"``index`` int64 ``[M]`` (a negative index counts from the end; each within ``[-D, D)``, else\n"
"IndexError), ``updates`` float32 ``[M, R]``, ``data`` and ``out`` float32 ``[D, R]``, all\n"
"C-contiguous. ``threads`` threads share the rows of ``out``.");

static PyObject *scatter_add_rows(PyObject *self, PyObject *args)
{
    PyObject *objects[4];
    int threads;
    if (!PyArg_ParseTuple(args, "OOOOi:scatter_add_rows", &objects[0], &objects[1], &objects[2],
                          &objects[3], &threads)) {
        return NULL;
    }
    Py_buffer views[4];
    int held[4] = {0};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(objects[0], &views[0], PyBUF_RECORDS_RO) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "scatter_add_rows: index must be a numpy array; got %.200s",
                     Py_TYPE(objects[0])->tp_name);
        return NULL;
    }
    held[0] = 1;
    const char *format = views[0].format ? views[0].format : "B";
    if (*format == '=' || *format == '<' || *format == '@') {
        format++;
    }
    if ((strcmp(format, "q") != 0 && strcmp(format, "l") != 0) || views[0].itemsize != 8 ||
        views[0].ndim != 1 || !PyBuffer_IsContiguous(&views[0], 'C')) {
        PyErr_Format(PyExc_ValueError,
                     "scatter_add_rows: index has format %s and %d dimensions; expected a"
                     " C-contiguous int64 vector",
                     format, views[0].ndim);
        goto done;
    }
    static const char *const names[4] = {"index", "updates", "data", "out"};
    for (int k = 1; k < 4; k++) {
        if (k == 2 && objects[k] == Py_None) {
            continue;
        }
        if (float32_array(objects[k], &views[k], -1, k == 3, "scatter_add_rows: array", k,
                          names[k]) < 0) {
            goto done;
        }
        held[k] = 1;
        if (views[k].ndim != 2) {
            PyErr_Format(PyExc_ValueError,
                         "scatter_add_rows: %s has %d dimensions; expected 2", names[k],
                         views[k].ndim);
            goto done;
        }
    }
    const Py_ssize_t m = views[0].shape[0], d = views[3].shape[0], r = views[3].shape[1];
    if (views[1].shape[0] != m || views[1].shape[1] != r ||
        (held[2] && (views[2].shape[0] != d || views[2].shape[1] != r))) {
        PyErr_Format(PyExc_ValueError,
                     "scatter_add_rows: index [%zd], updates [%zd, %zd], data [%zd, %zd] and out"
                     " [%zd, %zd]; expected index [M], updates [M, R], data and out [D, R]",
                     m, views[1].shape[0], views[1].shape[1], held[2] ? views[2].shape[0] : d,
                     held[2] ? views[2].shape[1] : r, d, r);
        goto done;
    }
    const int64_t *index = views[0].buf;
    for (Py_ssize_t i = 0; i < m; i++) {
        if (index[i] < -(int64_t)d || index[i] >= (int64_t)d) {
            PyErr_Format(PyExc_IndexError,
                         "scatter_add_rows: index %lld (at position %zd) is out of range for %zd"
                         " rows; expected -%zd <= index < %zd",
                         (long long)index[i], i, d, d, d);
            goto done;
        }
    }
    struct scatter_rows s = {.index = index, .updates = views[1].buf,
                             .data = held[2] ? views[2].buf : NULL, .out = views[3].buf,
                             .m = m, .d = d, .r = r};
    if (run_shares(scatter_rows_share, &s, d * r + m * r, threads) >= 0) {
        result = Py_NewRef(Py_None);
    }
done:
    release_held(views, held, 4);
    return result;
}

PyDoc_STRVAR(set_narrow_blocks_doc,
"_set_narrow_blocks(narrow)\n--\n\n"
"Use the register blocks sized for 16 vector registers (``narrow`` true) or for 32 (false,\n"
"AVX-512's); None restores the machine's choice. Returns the previous setting. The blocks\n"
"change the kernels' speed, not their results.");

static PyObject *set_narrow_blocks(PyObject *self, PyObject *arg)
{
    (void)self;
    const int previous = narrow_blocks;
    if (arg == Py_None) {
        narrow_blocks = narrow_blocks_default();
    }
    else {
        const int narrow = PyObject_IsTrue(arg);
        if (narrow < 0) {
            return NULL;
        }
        narrow_blocks = narrow;
    }
    return PyBool_FromLong(previous);
}

PyDoc_STRVAR(narrow_blocks_doc,
"narrow_blocks()\n--\n\n"
"Whether the kernels run their forms for 16 vector registers (AVX2; no AVX-512 here).");

static PyObject *get_narrow_blocks(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyBool_FromLong(narrow_blocks);
}

static PyMethodDef methods[] = {
    {"_set_narrow_blocks", set_narrow_blocks, METH_O, set_narrow_blocks_doc},
    {"narrow_blocks", get_narrow_blocks, METH_NOARGS, narrow_blocks_doc},
    {"weight_grads", weight_grads, METH_VARARGS, weight_grads_doc},
    {"route_max_pool", route_max_pool, METH_VARARGS, route_max_pool_doc},
    {"batch_norm_grad", batch_norm_grad, METH_VARARGS, batch_norm_grad_doc},
    {"batch_norm_forward", batch_norm_forward, METH_VARARGS, batch_norm_forward_doc},
    {"dropout_mask", dropout_mask, METH_VARARGS, dropout_mask_doc},
    {"col2im_sum", col2im_sum, METH_VARARGS, col2im_sum_doc},
    {"conv_direct", conv_direct, METH_VARARGS, conv_direct_doc},
    {"conv_winograd", conv_winograd, METH_VARARGS, conv_winograd_doc},
    {"gelu", gelu, METH_VARARGS, gelu_doc},
    {"layer_norm_grad", layer_norm_grad, METH_VARARGS, layer_norm_grad_doc},
    {"permute", permute, METH_VARARGS, permute_doc},
    {"clip_grad", clip_grad, METH_VARARGS, clip_grad_doc},
    {"max_pool_grad", max_pool_grad, METH_VARARGS, max_pool_grad_doc},
    {"hardswish_grad", hardswish_grad, METH_VARARGS, hardswish_grad_doc},
    {"hardswish", hardswish, METH_VARARGS, hardswish_doc},
    {"silu_grad", silu_grad, METH_VARARGS, silu_grad_doc},
    {"relu_grad", relu_grad, METH_VARARGS, relu_grad_doc},
    {"lstm_cell", lstm_cell, METH_VARARGS, lstm_cell_doc},
    {"lstm_cell_grad", lstm_cell_grad, METH_VARARGS, lstm_cell_grad_doc},
    {"depthwise_conv_transpose", depthwise_conv_transpose, METH_VARARGS,
     depthwise_conv_transpose_doc},
    {"scatter_add_rows", scatter_add_rows, METH_VARARGS, scatter_add_rows_doc},
    {"unfold", unfold, METH_VARARGS, unfold_doc},
    {NULL, NULL, 0, NULL},
};

PyMODINIT_FUNC PyInit__convc(void)
{
    narrow_blocks = narrow_blocks_default();
    return pool_module("traingraph.runtime._convc",
                       "Native kernels of traingraph's CPU training step over float32 arrays: 2-D"
                       " convolutions' weight gradients, max-pool gradient routing, batch-norm"
                       " gradients, Dropout masks, column sums, Winograd convolutions, GELU and"
                       " layer-norm gradients, axis permutations, Clip, HardSwish and SiLU gradients, depthwise"
                       " transposed convolutions, convolution unfolds.",
                       methods);
}
