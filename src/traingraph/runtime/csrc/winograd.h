/* 3 x 3 convolutions of stride 1 and pads 1 by Winograd's F(2 x 2, 3 x 3) and F(4 x 4, 3 x 3)
 * (below), for _convc.c.
 *
 * Each 2 x 2 block of outputs (a tile) of filter k is
 *
 *     Y = A^T [ sum_c (G g[k, c] G^T) * (B^T d[c] B) ] A
 *
 * where d[c] is the 4 x 4 patch of channel c the tile reads and * multiplies element by
 * element: 16 products per tile and channel pair instead of 36. The 16 places of the
 * transformed patches (frequencies) are 16 independent matrix products over the channels.
 *
 *     B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1]
 *     G   = [1 0 0; 1/2 1/2 1/2; 1/2 -1/2 1/2; 0 0 1]
 *     A^T = [1 1 1 0; 0 1 -1 -1]
 *
 * The tiles lie along the vector lanes: a block of whole tile rows is transformed into
 * V[frequency][channel][tile], multiplied into M[frequency][filter][tile] (8 filters by 48
 * tiles of sums in registers, the transformed filters broadcast), and M is transformed back
 * into the output rows. A block's V and M stay within a fraction of an L2 cache; the threads
 * take the blocks in turn. A tile's four input columns are shuffled out of the row's even and
 * odd columns (with the pad's zeros at both ends).
 */

#define WINO_FILTERS 8
#define WINO_MAX_ROWS 256 /* tile rows per block */
#define WINO_VECTORS 3
/* the block of sums where vector registers are narrow (narrow_blocks): 6 filters by 16 tiles */
#define WINO_NARROW_FILTERS 6
#define WINO_BLOCK_BYTES (256 * 1024) /* where the L2 cache's size is not known */

/* Bytes of a block's V and M for transformed filters of `u_bytes`. Each block reads all of
 * them: where they fit in a core's L2 cache (sysconf) with the block, WINO_BLOCK_BYTES; where
 * they do not, blocks the size of the L2 cache (within 4 MiB), so that they are read fewer
 * times from farther out while the block's patches and sums stay in L2. */
static Py_ssize_t wino_block_bytes(Py_ssize_t u_bytes)
{
    static Py_ssize_t l2;
    if (l2 == 0) {
        long size = -1;
#ifdef _SC_LEVEL2_CACHE_SIZE
        size = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
        l2 = size <= 0 ? WINO_BLOCK_BYTES : (Py_ssize_t)size;
        l2 = l2 < WINO_BLOCK_BYTES ? WINO_BLOCK_BYTES : l2;
        l2 = l2 > 4096 * 1024 ? 4096 * 1024 : l2;
    }
    return u_bytes + WINO_BLOCK_BYTES <= l2 ? WINO_BLOCK_BYTES : l2;
}
#define WINO_CHANNELS 64  /* channels summed in one run (wino_dot) */

struct wino {
    const float *x, *b, *addend;
    const float *dy; /* the output gradient, for weight gradients */
    float *y;
    const float *u; /* transformed filters [freqs][C][K] */
    Py_ssize_t n, c, h, w, k;
    int tile;          /* outputs along each side of a tile: 2 or 4 */
    int freqs;         /* places of a transformed patch: (tile + 2)^2 */
    Py_ssize_t th, tw; /* tile rows and columns: h / tile, w / tile */
    Py_ssize_t rows;   /* tile rows per block */
    Py_ssize_t tiles;  /* rows * tw rounded up to 16: the block's tile pitch */
    /* floats between the frequencies of V and M: a cache line over c tiles and k tiles, so
     * that a tile's frequencies do not all fall into one set of the L1 cache */
    Py_ssize_t v_pitch, m_pitch;
    atomic_long *next; /* the next block a thread takes */
};

static struct scratch wino_scratch[MAX_THREADS];

/* Each tile row q < units of the block from unit0 on: the image row its patches start at
 * (first[q], `shift` from the tile's first row), and where that row lies in channel 0 of
 * `src` (base[q]; `channels` planes per sample). */
static void wino_rows(const struct wino *p, const float *src, Py_ssize_t channels, int shift,
                      Py_ssize_t unit0, Py_ssize_t units, Py_ssize_t *first, const float **base)
{
    for (Py_ssize_t q = 0; q < units; q++) {
        const Py_ssize_t n = (unit0 + q) / p->th, i = (unit0 + q) % p->th;
        first[q] = p->tile * i + shift;
        base[q] = src + n * channels * p->h * p->w + first[q] * p->w;
    }
}

/* Filter (k, c) of the filters g: g[k, c], or with `flipped` (g holds [C, K, 3, 3]) g[c, k]
 * turned by 180 degrees, copied into `turned` (the filters of a Conv's input gradient). */
static inline const float *wino_filter(const float *g, Py_ssize_t kk, Py_ssize_t cc, Py_ssize_t k,
                                       Py_ssize_t c, int flipped, float turned[9])
{
    if (!flipped) {
        return g + (kk * c + cc) * 9;
    }
    const float *s = g + (cc * k + kk) * 9;
    for (int q = 0; q < 9; q++) {
        turned[q] = s[8 - q];
    }
    return turned;
}

/* The first `count` lanes of v at dst. */
static inline __attribute__((always_inline)) void wino_store_lanes(float *dst, v16 v, int count)
{
    if (count == 16) {
        *(v16u *)dst = v;
    }
    else {
        memcpy(dst, &v, sizeof(float) * (size_t)count);
    }
}

/* U[f][c][k] = (G g[k, c] G^T)[f / 4][f % 4] for the filters g [K, C, 3, 3] and the channels
 * c0 <= c < c1 (see wino_filter for `flipped`); `row` holds 16 k floats: one channel's 16 rows
 * of U, written together (U's planes lie a multiple of 4 KiB apart, where stores scattered over
 * them stall). Runs of 16 filters are transformed in vector lanes, their taps gathered into
 * `taps` first (each filter lies in its own cache line); a last run of fewer leaves its other
 * lanes 0 and unwritten. */
TARGETS static void wino_filters(const float *g, float *u, float *row, Py_ssize_t k, Py_ssize_t c,
                                 int flipped, Py_ssize_t c0, Py_ssize_t c1)
{
    v16 taps[9];
    float *lanes = (float *)taps;
    for (Py_ssize_t cc = c0; cc < c1; cc++) {
        for (Py_ssize_t k0 = 0; k0 < k; k0 += 16) {
            const int count = k - k0 < 16 ? (int)(k - k0) : 16;
            if (count < 16) {
                memset(taps, 0, sizeof(taps));
            }
            for (int l = 0; l < count; l++) {
                float turned[9];
                const float *t = wino_filter(g, k0 + l, cc, k, c, flipped, turned);
                for (int q = 0; q < 9; q++) {
                    lanes[q * 16 + l] = t[q];
                }
            }
            v16 gt[4][3]; /* G g */
            for (int j = 0; j < 3; j++) {
                gt[0][j] = taps[j];
                gt[1][j] = 0.5f * (taps[j] + taps[3 + j] + taps[6 + j]);
                gt[2][j] = 0.5f * (taps[j] - taps[3 + j] + taps[6 + j]);
                gt[3][j] = taps[6 + j];
            }
            for (int r = 0; r < 4; r++) { /* (G g) G^T */
                float *at = row + r * 4 * k + k0;
                wino_store_lanes(at, gt[r][0], count);
                wino_store_lanes(at + k, 0.5f * (gt[r][0] + gt[r][1] + gt[r][2]), count);
                wino_store_lanes(at + 2 * k, 0.5f * (gt[r][0] - gt[r][1] + gt[r][2]), count);
                wino_store_lanes(at + 3 * k, gt[r][2], count);
            }
        }
        for (int f = 0; f < 16; f++) {
            memcpy(u + (f * c + cc) * k, row + f * k, sizeof(float) * (size_t)k);
        }
    }
}

/* The four columns of tile j of a padded row (place 0 the pad's zero, place 1 + x column x):
 * places 2j, 2j + 1, 2j + 2 and 2j + 3, each in its own array at the tile's index. */
enum { WINO_E0, WINO_O0, WINO_E1, WINO_O1 };

/* B^T along the patch rows: the 16 frequencies of 16 tiles from u[r][s], the patch rows
 * already transformed along their columns, stored at dst + f * stride. */
static inline __attribute__((always_inline)) void wino_rows_out(const v16 u[4][4], float *dst,
                                                                 Py_ssize_t stride)
{
    for (int s = 0; s < 4; s++) {
        *(v16 *)(dst + (0 * 4 + s) * stride) = u[0][s] - u[2][s];
        *(v16 *)(dst + (1 * 4 + s) * stride) = u[1][s] + u[2][s];
        *(v16 *)(dst + (2 * 4 + s) * stride) = u[2][s] - u[1][s];
        *(v16 *)(dst + (3 * 4 + s) * stride) = u[1][s] - u[3][s];
    }
}

/* Row `src` (w = 2 tw floats) split into the columns of its tiles at `at` in cols[0..3]: the
 * odd columns (2j + 1: places 2j + 2 and, one tile on, 2j + 1 + 2) and the even ones. The
 * first tile's place 0 and the last's place 2 tw + 1 are set later (they are zeros): the
 * shifted stores overwrite a neighbouring row's. */
static inline __attribute__((always_inline)) void wino_split(const float *restrict src,
                                                              float *const cols[4],
                                                              Py_ssize_t at, Py_ssize_t tw)
{
    const v16i evens = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const v16i odds = evens + 1;
    float *e0 = cols[WINO_E0] + at, *o0 = cols[WINO_O0] + at;
    float *e1 = cols[WINO_E1] + at, *o1 = cols[WINO_O1] + at;
    Py_ssize_t m = 0;
    for (; m + 16 <= tw; m += 16) {
        const v16 a = *(const v16u *)(src + 2 * m), b = *(const v16u *)(src + 2 * m + 16);
        const v16 even = __builtin_shuffle(a, b, evens), odd = __builtin_shuffle(a, b, odds);
        *(v16u *)(o0 + m) = even;
        *(v16u *)(o1 + m - 1) = even;
        *(v16u *)(e1 + m) = odd;
        *(v16u *)(e0 + m + 1) = odd;
    }
    for (; m < tw; m++) {
        o0[m] = o1[m - 1] = src[2 * m];
        e1[m] = e0[m + 1] = src[2 * m + 1];
    }
}

/* wino_rows_out over 8 tiles, for narrow_blocks. */
static inline __attribute__((always_inline)) void wino_rows_out8(const v8 u[4][4], float *dst,
                                                                  Py_ssize_t stride)
{
    for (int s = 0; s < 4; s++) {
        *(v8 *)(dst + (0 * 4 + s) * stride) = u[0][s] - u[2][s];
        *(v8 *)(dst + (1 * 4 + s) * stride) = u[1][s] + u[2][s];
        *(v8 *)(dst + (2 * 4 + s) * stride) = u[2][s] - u[1][s];
        *(v8 *)(dst + (3 * 4 + s) * stride) = u[1][s] - u[3][s];
    }
}

/* wino_in's transform of one channel's column arrays for narrow_blocks: 8 tiles at a time (its
 * 16 sums fit 16 registers), the same lanes (up to a whole vector of 16) and the same sums. */
TARGETS static void wino_in_narrow(const float *cols, Py_ssize_t span, float *dst,
                                   Py_ssize_t used, Py_ssize_t stride)
{
    const Py_ssize_t end = (used + 15) / 16 * 16;
    for (Py_ssize_t t = 0; t < end; t += 8) {
        v8 u[4][4];
        for (int r = 0; r < 4; r++) {
            const float *at = cols + 4 * r * span + 16 + t;
            const v8 e0 = *(const v8 *)at, o0 = *(const v8 *)(at + span);
            const v8 e1 = *(const v8 *)(at + 2 * span), o1 = *(const v8 *)(at + 3 * span);
            u[r][0] = e0 - e1;
            u[r][1] = o0 + e1;
            u[r][2] = e1 - o0;
            u[r][3] = o0 - o1;
        }
        wino_rows_out8(u, dst + t, stride);
    }
}

/* The block's transformed patches V[f][c][t] for its tiles t = q * tw + j (tile row unit0 + q,
 * column j), whole vectors along t. `cols` holds 16 arrays of `span` floats, 16 from their
 * start: the four column arrays of each of the patch's rows. */
TARGETS static void wino_in(const struct wino *p, float *restrict v, float *restrict cols,
                            Py_ssize_t span, Py_ssize_t unit0, Py_ssize_t units)
{
    const Py_ssize_t tw = p->tw, plane = p->h * p->w, used = units * tw;
    const Py_ssize_t stride = p->v_pitch; /* between frequencies */
    Py_ssize_t first[WINO_MAX_ROWS]; /* each tile row's first patch row, from the image */
    const float *base[WINO_MAX_ROWS];
    wino_rows(p, p->x, p->c, -1, unit0, units, first, base);
    for (Py_ssize_t c = 0; c < p->c; c++) {
        for (int r = 0; r < 4; r++) {
            float *const rc[4] = {cols + (4 * r + 0) * span + 16, cols + (4 * r + 1) * span + 16,
                                  cols + (4 * r + 2) * span + 16, cols + (4 * r + 3) * span + 16};
            for (Py_ssize_t q = 0; q < units; q++) {
                const Py_ssize_t row = first[q] + r;
                if (row >= 0 && row < p->h) {
                    wino_split(base[q] + c * plane + r * p->w, rc, q * tw, tw);
                }
                else {
                    for (int k = 0; k < 4; k++) {
                        memset(rc[k] + q * tw, 0, sizeof(float) * (size_t)tw);
                    }
                }
            }
            for (Py_ssize_t q = 0; q < units; q++) {
                rc[WINO_E0][q * tw] = 0.0f;
                rc[WINO_O1][q * tw + tw - 1] = 0.0f;
            }
        }
        float *dst = v + c * p->tiles;
        if (narrow_blocks) {
            wino_in_narrow(cols, span, dst, used, stride);
            continue;
        }
        for (Py_ssize_t t = 0; t < used; t += 16) {
            v16 u[4][4];
            for (int r = 0; r < 4; r++) {
                const float *at = cols + 4 * r * span + 16 + t;
                const v16 e0 = *(const v16 *)at, o0 = *(const v16 *)(at + span);
                const v16 e1 = *(const v16 *)(at + 2 * span), o1 = *(const v16 *)(at + 3 * span);
                u[r][0] = e0 - e1;
                u[r][1] = o0 + e1;
                u[r][2] = e1 - o0;
                u[r][3] = o0 - o1;
            }
            wino_rows_out(u, dst + t, stride);
        }
    }
}

/* Whether wino_in_lanes takes rows of tw tiles: whole vectors of a row, or rows of 8 or 4
 * tiles packed two or four to a vector. */
static inline int wino_lanes(Py_ssize_t tw) { return tw % 16 == 0 || tw == 8 || tw == 4; }

static const float wino_zeros[32] __attribute__((aligned(64)));

/* Row r of the patches of tile row q (or zeros outside the image and past the block). */
static inline const float *wino_row(const struct wino *p, const float *const *base,
                                    const Py_ssize_t *first, Py_ssize_t q, Py_ssize_t units,
                                    int r, Py_ssize_t c)
{
    const Py_ssize_t row = first[q] + r;
    if (q >= units || row < 0 || row >= p->h) {
        return NULL;
    }
    return base[q] + c * p->h * p->w + r * p->w;
}

/* wino_in for wino_lanes(tw), without the column arrays: each vector's four tile columns are
 * shuffled out of the 32 input columns it covers, in registers. */
TARGETS static void wino_in_lanes(const struct wino *p, float *restrict v, Py_ssize_t unit0,
                                  Py_ssize_t units)
{
    const v16i evens = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const v16i odds = evens + 1;
    const v16i right = {16, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14};
    const v16i left = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
    const Py_ssize_t tw = p->tw, used = units * tw;
    const Py_ssize_t stride = p->v_pitch; /* between frequencies */
    v16i keep_first = {0}, keep_last = {0}; /* lanes whose tile has a left / right neighbour */
    for (int l = 0; l < 16; l++) {
        keep_first[l] = tw >= 16 || l % tw != 0 ? -1 : 0;
        keep_last[l] = tw >= 16 || l % tw != tw - 1 ? -1 : 0;
    }
    Py_ssize_t first[WINO_MAX_ROWS + 3];
    const float *base[WINO_MAX_ROWS + 3];
    wino_rows(p, p->x, p->c, -1, unit0, units, first, base);
    for (Py_ssize_t c = 0; c < p->c; c++) {
        float *dst = v + c * p->tiles;
        for (Py_ssize_t t = 0; t < used; t += 16) {
            const Py_ssize_t q = t / tw, m = t % tw;
            v16 u[4][4];
            for (int r = 0; r < 4; r++) {
                v16 a, b, prev = {0}, next = {0};
                if (tw >= 16) {
                    const float *src = wino_row(p, base, first, q, units, r, c);
                    if (src == NULL) {
                        a = b = (v16){0};
                    }
                    else {
                        a = *(const v16u *)(src + 2 * m);
                        b = *(const v16u *)(src + 2 * m + 16);
                        prev[0] = m > 0 ? src[2 * m - 1] : 0.0f;
                        next[0] = m + 16 < tw ? src[2 * m + 32] : 0.0f;
                    }
                }
                else if (tw == 8) {
                    const float *s0 = wino_row(p, base, first, q, units, r, c);
                    const float *s1 = wino_row(p, base, first, q + 1, units, r, c);
                    a = *(const v16u *)(s0 != NULL ? s0 : wino_zeros);
                    b = *(const v16u *)(s1 != NULL ? s1 : wino_zeros);
                }
                else {
                    v8u h[4];
                    for (int k = 0; k < 4; k++) {
                        const float *s = wino_row(p, base, first, q + k, units, r, c);
                        h[k] = *(const v8u *)(s != NULL ? s : wino_zeros);
                    }
                    a = __builtin_shufflevector(h[0], h[1], 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                12, 13, 14, 15);
                    b = __builtin_shufflevector(h[2], h[3], 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                12, 13, 14, 15);
                }
                /* padded places 2j, 2j + 1, 2j + 2, 2j + 3: columns 2j - 1 .. 2j + 2 */
                const v16 d1 = __builtin_shuffle(a, b, evens), d2 = __builtin_shuffle(a, b, odds);
                const v16 d0 = (v16)((v16i)__builtin_shuffle(d2, prev, right) & keep_first);
                const v16 d3 = (v16)((v16i)__builtin_shuffle(d1, next, left) & keep_last);
                u[r][0] = d0 - d2;
                u[r][1] = d1 + d2;
                u[r][2] = d2 - d1;
                u[r][3] = d1 - d3;
            }
            wino_rows_out(u, dst + t, stride);
        }
    }
}

/* M[f][k0 + a][t0 + 16 b] for a < kb, b < vb: the sums over the channels, in blocks of
 * WINO_CHANNELS channels whose sums are added into M in turn (the rounding error of a run
 * grows with its length: 64 + C / 64 additions to each sum instead of C). */
static inline __attribute__((always_inline)) void wino_dot(const struct wino *p, const float *v,
                                                            const float *u, float *m,
                                                            Py_ssize_t k0, Py_ssize_t t0,
                                                            const int kb, const int vb)
{
    for (Py_ssize_t c0 = 0; c0 < p->c; c0 += WINO_CHANNELS) {
        const Py_ssize_t c1 = p->c - c0 < WINO_CHANNELS ? p->c : c0 + WINO_CHANNELS;
        v16 acc[WINO_FILTERS][WINO_VECTORS];
        for (int a = 0; a < kb; a++) {
            for (int b = 0; b < vb; b++) {
                acc[a][b] = (v16){0};
            }
        }
        for (Py_ssize_t c = c0; c < c1; c++) {
            v16 in[WINO_VECTORS];
            for (int b = 0; b < vb; b++) {
                in[b] = *(const v16 *)(v + c * p->tiles + t0 + 16 * b);
            }
            for (int a = 0; a < kb; a++) {
                const float f = u[c * p->k + k0 + a];
                for (int b = 0; b < vb; b++) {
                    acc[a][b] += in[b] * f;
                }
            }
        }
        for (int a = 0; a < kb; a++) {
            for (int b = 0; b < vb; b++) {
                v16 *at = (v16 *)(m + (k0 + a) * p->tiles + t0 + 16 * b);
                *at = c0 == 0 ? acc[a][b] : *at + acc[a][b];
            }
        }
    }
}

/* wino_dot for narrow_blocks: kb filters by 16 tiles, each v16 of sums as two v8 halves (the
 * same sums). */
static inline __attribute__((always_inline)) void wino_dot_narrow(const struct wino *p,
                                                                   const float *v, const float *u,
                                                                   float *m, Py_ssize_t k0,
                                                                   Py_ssize_t t0, const int kb)
{
    for (Py_ssize_t c0 = 0; c0 < p->c; c0 += WINO_CHANNELS) {
        const Py_ssize_t c1 = p->c - c0 < WINO_CHANNELS ? p->c : c0 + WINO_CHANNELS;
        v8 acc[WINO_NARROW_FILTERS][2];
        for (int a = 0; a < kb; a++) {
            acc[a][0] = acc[a][1] = (v8){0};
        }
        for (Py_ssize_t c = c0; c < c1; c++) {
            const v8 in0 = *(const v8 *)(v + c * p->tiles + t0);
            const v8 in1 = *(const v8 *)(v + c * p->tiles + t0 + 8);
            for (int a = 0; a < kb; a++) {
                const float f = u[c * p->k + k0 + a];
                acc[a][0] += in0 * f;
                acc[a][1] += in1 * f;
            }
        }
        for (int a = 0; a < kb; a++) {
            v8 *at = (v8 *)(m + (k0 + a) * p->tiles + t0);
            at[0] = c0 == 0 ? acc[a][0] : at[0] + acc[a][0];
            at[1] = c0 == 0 ? acc[a][1] : at[1] + acc[a][1];
        }
    }
}

#define WINO_DOT_NARROW(kb)                                                                       \
    TARGETS static void wino_dot_narrow_##kb(const struct wino *p, const float *v,               \
                                             const float *u, float *m, Py_ssize_t k0,             \
                                             Py_ssize_t t0)                                       \
    {                                                                                             \
        wino_dot_narrow(p, v, u, m, k0, t0, kb);                                                  \
    }
WINO_DOT_NARROW(1) WINO_DOT_NARROW(2) WINO_DOT_NARROW(3)
WINO_DOT_NARROW(4) WINO_DOT_NARROW(5) WINO_DOT_NARROW(6)

#define WINO_DOT(kb, vb)                                                                          \
    TARGETS static void wino_dot_##kb##_##vb(const struct wino *p, const float *v,               \
                                             const float *u, float *m, Py_ssize_t k0,             \
                                             Py_ssize_t t0)                                       \
    {                                                                                             \
        wino_dot(p, v, u, m, k0, t0, kb, vb);                                                     \
    }
#define WINO_DOTS(kb) WINO_DOT(kb, 1) WINO_DOT(kb, 2) WINO_DOT(kb, 3)
#define WINO_ROW_OF(kb) {wino_dot_##kb##_1, wino_dot_##kb##_2, wino_dot_##kb##_3}
WINO_DOTS(1) WINO_DOTS(2) WINO_DOTS(3) WINO_DOTS(4)
WINO_DOTS(5) WINO_DOTS(6) WINO_DOTS(7) WINO_DOTS(8)

typedef void (*wino_fn)(const struct wino *, const float *, const float *, float *, Py_ssize_t,
                        Py_ssize_t);
static const wino_fn wino_dots[WINO_FILTERS][WINO_VECTORS] = {
    WINO_ROW_OF(1), WINO_ROW_OF(2), WINO_ROW_OF(3), WINO_ROW_OF(4),
    WINO_ROW_OF(5), WINO_ROW_OF(6), WINO_ROW_OF(7), WINO_ROW_OF(8),
};
static const wino_fn wino_dots_narrow[WINO_NARROW_FILTERS] = {
    wino_dot_narrow_1, wino_dot_narrow_2, wino_dot_narrow_3,
    wino_dot_narrow_4, wino_dot_narrow_5, wino_dot_narrow_6,
};

/* Output row `row` (w floats) into y at `at`, plus the addend's row there. */
static inline void wino_store(const struct wino *p, Py_ssize_t at, const float *restrict row)
{
    float *restrict y = p->y + at;
    if (p->addend != NULL) {
        const float *a = p->addend + at;
        for (Py_ssize_t j = 0; j < p->w; j++) {
            y[j] = row[j] + a[j];
        }
    }
    else {
        memcpy(y, row, sizeof(float) * (size_t)p->w);
    }
}

/* wino_out's two output rows of each tile of one filter for narrow_blocks: 8 tiles at a time,
 * the same sums, the even and odd columns interleaved by 8-float permutes. */
TARGETS static void wino_out_narrow(const float *src, Py_ssize_t stride, Py_ssize_t used,
                                    float b, float *top, float *bottom)
{
    const v8i low = {0, 8, 1, 9, 2, 10, 3, 11};
    const v8i high = low + 4;
    const v8 bias = b + (v8){0};
    for (Py_ssize_t t = 0; t < used; t += 8) {
        v8 h[2][4];
        for (int s = 0; s < 4; s++) {
            const v8 m0 = *(const v8 *)(src + (0 * 4 + s) * stride + t);
            const v8 m1 = *(const v8 *)(src + (1 * 4 + s) * stride + t);
            const v8 m2 = *(const v8 *)(src + (2 * 4 + s) * stride + t);
            const v8 m3 = *(const v8 *)(src + (3 * 4 + s) * stride + t);
            h[0][s] = m0 + m1 + m2;
            h[1][s] = m1 - m2 - m3;
        }
        float *rows[2] = {top + 2 * t, bottom + 2 * t};
        for (int a = 0; a < 2; a++) {
            const v8 even = h[a][0] + h[a][1] + h[a][2] + bias;
            const v8 odd = h[a][1] - h[a][2] - h[a][3] + bias;
            *(v8 *)rows[a] = __builtin_shuffle(even, odd, low);
            *(v8 *)(rows[a] + 8) = __builtin_shuffle(even, odd, high);
        }
    }
}

/* wino_out's two output rows of each tile of one filter, 16 tiles at a time. */
TARGETS static void wino_out_wide(const float *src, Py_ssize_t stride, Py_ssize_t used, float b,
                                  float *top, float *bottom)
{
    const v16i low = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
    const v16i high = low + 8;
    const v16 bias = b + (v16){0};
    for (Py_ssize_t t = 0; t < used; t += 16) {
        v16 h[2][4];
        for (int s = 0; s < 4; s++) {
            const v16 m0 = *(const v16 *)(src + (0 * 4 + s) * stride + t);
            const v16 m1 = *(const v16 *)(src + (1 * 4 + s) * stride + t);
            const v16 m2 = *(const v16 *)(src + (2 * 4 + s) * stride + t);
            const v16 m3 = *(const v16 *)(src + (3 * 4 + s) * stride + t);
            h[0][s] = m0 + m1 + m2;
            h[1][s] = m1 - m2 - m3;
        }
        float *rows[2] = {top + 2 * t, bottom + 2 * t};
        for (int a = 0; a < 2; a++) {
            const v16 even = h[a][0] + h[a][1] + h[a][2] + bias;
            const v16 odd = h[a][1] - h[a][2] - h[a][3] + bias;
            *(v16 *)rows[a] = __builtin_shuffle(even, odd, low);
            *(v16 *)(rows[a] + 16) = __builtin_shuffle(even, odd, high);
        }
    }
}

/* The outputs of the block's tile rows from M[f][k][t] (plus bias and addend), whole vectors
 * along t: tile row q's two output rows go to top and bottom at 2 q tw = q w first, then to y.
 * `top` and `bottom` hold 2 tiles floats. */
static void wino_out(const struct wino *p, const float *restrict m, float *restrict top,
                     float *restrict bottom, Py_ssize_t unit0, Py_ssize_t units)
{
    const Py_ssize_t used = units * p->tw, stride = p->m_pitch, plane = p->h * p->w;
    for (Py_ssize_t k = 0; k < p->k; k++) {
        const float *src = m + k * p->tiles;
        const float b = p->b != NULL ? p->b[k] : 0.0f;
        if (narrow_blocks) {
            wino_out_narrow(src, stride, used, b, top, bottom);
        }
        else {
            wino_out_wide(src, stride, used, b, top, bottom);
        }
        for (Py_ssize_t q = 0; q < units; q++) {
            const Py_ssize_t n = (unit0 + q) / p->th, i = (unit0 + q) % p->th;
            const Py_ssize_t at = (n * p->k + k) * plane + 2 * i * p->w;
            wino_store(p, at, top + q * p->w);
            wino_store(p, at + p->w, bottom + q * p->w);
        }
    }
}

/* ------------------------------------------------ F(4 x 4, 3 x 3): 36 products per 16 outputs
 *
 *     B^T = [4 0 -5 0 1 0; 0 -4 -4 1 1 0; 0 4 -4 -1 1 0; 0 -2 -1 2 1 0; 0 2 -1 -2 1 0;
 *            0 4 0 -5 0 1]
 *     G   = [1/4 0 0; -1/6 -1/6 -1/6; -1/6 1/6 -1/6; 1/24 1/12 1/6; 1/24 -1/12 1/6; 0 0 1]
 *     A^T = [1 1 1 1 1 0; 0 1 -1 2 -2 0; 0 1 1 4 4 0; 0 1 -1 8 -8 1]
 *
 * Used where the height and width are multiples of 4 and a row's tiles fill whole vectors or
 * divide one (rows of 8, 16, 32 or a multiple of 64 columns): 2.25 products per output instead
 * of 4, and fewer additions per output in the transforms. */

/* G t for the three taps t[0], t[stride], t[2 stride]. */
static inline void wino4_taps(const float *t, Py_ssize_t stride, float out[6])
{
    const float sixth = 1.0f / 6.0f;
    const float a = t[0], b = t[stride], c = t[2 * stride], ac = a * 0.25f + c;
    out[0] = 0.25f * a;
    out[1] = -sixth * (a + b + c);
    out[2] = -sixth * (a - b + c);
    out[3] = sixth * (ac + 0.5f * b);
    out[4] = sixth * (ac - 0.5f * b);
    out[5] = c;
}

/* U[f][c][k] = (G g[k, c] G^T)[f / 6][f % 6] for c0 <= c < c1; `row` holds 36 k floats (as in
 * wino_filters). */
TARGETS static void wino4_filters(const float *g, float *u, float *row, Py_ssize_t k,
                                  Py_ssize_t c, int flipped, Py_ssize_t c0, Py_ssize_t c1)
{
    for (Py_ssize_t cc = c0; cc < c1; cc++) {
        for (Py_ssize_t kk = 0; kk < k; kk++) {
            float turned[9];
            const float *t = wino_filter(g, kk, cc, k, c, flipped, turned);
            float gt[3][6]; /* (G g)^T: column j of G g */
            for (int j = 0; j < 3; j++) {
                wino4_taps(t + j, 3, gt[j]);
            }
            for (int r = 0; r < 6; r++) {
                float out[6];
                const float col[3] = {gt[0][r], gt[1][r], gt[2][r]};
                wino4_taps(col, 1, out);
                for (int s = 0; s < 6; s++) {
                    row[(r * 6 + s) * k + kk] = out[s];
                }
            }
        }
        for (int f = 0; f < 36; f++) {
            memcpy(u + (f * c + cc) * k, row + f * k, sizeof(float) * (size_t)k);
        }
    }
}

/* B^T d for six vectors d. */
static inline __attribute__((always_inline)) void wino4_bt(const v16 d[6], v16 o[6])
{
    const v16 a = d[4] - 4.0f * d[2], b = d[3] - 4.0f * d[1];
    const v16 e = d[4] - d[2], f = 2.0f * (d[3] - d[1]);
    o[0] = 4.0f * d[0] - 5.0f * d[2] + d[4];
    o[1] = a + b;
    o[2] = a - b;
    o[3] = e + f;
    o[4] = e - f;
    o[5] = 4.0f * d[1] - 5.0f * d[3] + d[5];
}

/* A^T m for six vectors m. */
static inline __attribute__((always_inline)) void wino4_at(const v16 m[6], v16 y[4])
{
    const v16 s12 = m[1] + m[2], d12 = m[1] - m[2], s34 = m[3] + m[4], d34 = m[3] - m[4];
    y[0] = m[0] + s12 + s34;
    y[1] = d12 + 2.0f * d34;
    y[2] = s12 + 4.0f * s34;
    y[3] = d12 + 8.0f * d34 + m[5];
}

/* Whether wino4_in takes rows of tw tiles (4 tw columns): whole vectors of 16 tiles, or rows
 * of 8, 4 or 2 tiles packed two, four or eight to a vector. */
static inline int wino4_lanes(Py_ssize_t tw) { return tw % 16 == 0 || tw == 8 || tw == 4 || tw == 2; }

/* The 64 input columns of 16 tiles (t = q * tw + m on) in row r of their patches: x[0..3].
 * `rows` is the number of tile rows per vector (16 / tw), 1 where tw is a multiple of 16. */
static inline __attribute__((always_inline)) void wino4_load(const struct wino *p,
                                                             const float *const *base,
                                                             const Py_ssize_t *first, Py_ssize_t q,
                                                             Py_ssize_t m, Py_ssize_t units, int r,
                                                             Py_ssize_t c, v16 x[4], const int rows)
{
    if (rows == 1) {
        const float *src = wino_row(p, base, first, q, units, r, c);
        for (int k = 0; k < 4; k++) {
            x[k] = src != NULL ? *(const v16u *)(src + 4 * m + 16 * k) : (v16){0};
        }
    }
    else if (rows <= 4) { /* rows of 32 or 16 columns: 2 or 1 vectors each */
        const int per = 4 / rows;
        for (int k = 0; k < rows; k++) {
            const float *src = wino_row(p, base, first, q + k, units, r, c);
            for (int j = 0; j < per; j++) {
                x[k * per + j] = src != NULL ? *(const v16u *)(src + 16 * j) : (v16){0};
            }
        }
    }
    else { /* rows of 8 columns, two to a vector */
        for (int k = 0; k < 4; k++) {
            const float *s0 = wino_row(p, base, first, q + 2 * k, units, r, c);
            const float *s1 = wino_row(p, base, first, q + 2 * k + 1, units, r, c);
            const v8u lo = *(const v8u *)(s0 != NULL ? s0 : wino_zeros);
            const v8u hi = *(const v8u *)(s1 != NULL ? s1 : wino_zeros);
            x[k] = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                           14, 15);
        }
    }
}

/* The four phases of 64 columns x[0..3]: ph[s] holds columns 4 l + s. Even and odd columns
 * first, then their even and odd ones. */
static inline __attribute__((always_inline)) void wino4_phases(const v16 x[4], v16 ph[4])
{
    const v16i evens = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const v16i odds = evens + 1;
    const v16 e0 = __builtin_shuffle(x[0], x[1], evens), e1 = __builtin_shuffle(x[2], x[3], evens);
    const v16 o0 = __builtin_shuffle(x[0], x[1], odds), o1 = __builtin_shuffle(x[2], x[3], odds);
    ph[0] = __builtin_shuffle(e0, e1, evens);
    ph[1] = __builtin_shuffle(o0, o1, evens);
    ph[2] = __builtin_shuffle(e0, e1, odds);
    ph[3] = __builtin_shuffle(o0, o1, odds);
}

/* The block's transformed patches V[f][c][t] for its tiles t = q * tw + j, whole vectors along
 * t: the 64 input columns of 16 tiles are split into their four phases (column 4j + s) in
 * registers, even and odd columns first; the columns 4j - 1 and 4j + 4 are the neighbouring
 * tiles' phases 3 and 0, shifted by a lane (zeros at a row's ends). */
static inline __attribute__((always_inline)) void wino4_in(const struct wino *p,
                                                           float *restrict v, Py_ssize_t unit0,
                                                           Py_ssize_t units, const int rows)
{
    const v16i right = {16, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14};
    const v16i left = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
    const Py_ssize_t tw = p->tw, used = units * tw;
    const Py_ssize_t stride = p->v_pitch; /* between frequencies */
    v16i keep_first = {0}, keep_last = {0}; /* lanes whose tile has a left / right neighbour */
    for (int l = 0; l < 16; l++) {
        keep_first[l] = rows == 1 || l % tw != 0 ? -1 : 0;
        keep_last[l] = rows == 1 || l % tw != tw - 1 ? -1 : 0;
    }
    Py_ssize_t first[WINO_MAX_ROWS + 15];
    const float *base[WINO_MAX_ROWS + 15];
    wino_rows(p, p->x, p->c, -1, unit0, units, first, base);
    for (Py_ssize_t c = 0; c < p->c; c++) {
        float *dst = v + c * p->tiles;
        for (Py_ssize_t t = 0; t < used; t += 16) {
            const Py_ssize_t q = rows == 1 ? t / tw : t / (16 / rows);
            const Py_ssize_t m = rows == 1 ? t % tw : 0;
            v16 h[6][6];
            for (int r = 0; r < 6; r++) {
                v16 x[4], prev = {0}, next = {0};
                wino4_load(p, base, first, q, m, units, r, c, x, rows);
                if (rows == 1) {
                    const float *src = wino_row(p, base, first, q, units, r, c);
                    if (src != NULL) {
                        prev[0] = m > 0 ? src[4 * m - 1] : 0.0f;
                        next[0] = m + 16 < tw ? src[4 * m + 64] : 0.0f;
                    }
                }
                v16 d[6];
                wino4_phases(x, d + 1);
                d[0] = (v16)((v16i)__builtin_shuffle(d[4], prev, right) & keep_first);
                d[5] = (v16)((v16i)__builtin_shuffle(d[1], next, left) & keep_last);
                wino4_bt(d, h[r]);
            }
            for (int s = 0; s < 6; s++) {
                const v16 col[6] = {h[0][s], h[1][s], h[2][s], h[3][s], h[4][s], h[5][s]};
                v16 o[6];
                wino4_bt(col, o);
                for (int r = 0; r < 6; r++) {
                    *(v16 *)(dst + (r * 6 + s) * stride + t) = o[r];
                }
            }
        }
    }
}

#define WINO4_IN(rows)                                                                            \
    TARGETS static void wino4_in_##rows(const struct wino *p, float *restrict v,                \
                                        Py_ssize_t unit0, Py_ssize_t units)                      \
    {                                                                                             \
        wino4_in(p, v, unit0, units, rows);                                                       \
    }
WINO4_IN(1) WINO4_IN(2) WINO4_IN(4) WINO4_IN(8)

typedef void (*wino_block_fn)(const struct wino *, float *restrict, Py_ssize_t, Py_ssize_t);
/* Which of the F(4 x 4, 3 x 3) transforms' instances takes rows of tw tiles: the index of
 * their packing (1, 2, 4 or 8 tile rows to a vector). */
static inline int wino4_packing(Py_ssize_t tw) { return tw >= 16 ? 0 : tw == 8 ? 1 : tw == 4 ? 2 : 3; }
static const wino_block_fn wino4_ins[4] = {wino4_in_1, wino4_in_2, wino4_in_4, wino4_in_8};

/* The outputs of the block's tile rows from M[f][k][t] (plus bias and addend): tile row q's
 * four output rows go to rows[a] at 4 q tw = q w first, then to y. rows[a] holds 4 tiles
 * floats. */
TARGETS static void wino4_out(const struct wino *p, const float *restrict m, float *const rows[4],
                              Py_ssize_t unit0, Py_ssize_t units)
{
    const v16i low = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
    const v16i high = low + 8;
    const v16i pairs = {0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23};
    const v16i pairs_high = pairs + 8;
    const Py_ssize_t used = units * p->tw, stride = p->m_pitch, plane = p->h * p->w;
    for (Py_ssize_t k = 0; k < p->k; k++) {
        const float *src = m + k * p->tiles;
        const v16 bias = (p->b != NULL ? p->b[k] : 0.0f) + (v16){0};
        for (Py_ssize_t t = 0; t < used; t += 16) {
            v16 g[4][6]; /* A^T along the patch rows */
            for (int s = 0; s < 6; s++) {
                v16 col[6], out[4];
                for (int r = 0; r < 6; r++) {
                    col[r] = *(const v16 *)(src + (r * 6 + s) * stride + t);
                }
                wino4_at(col, out);
                for (int a = 0; a < 4; a++) {
                    g[a][s] = out[a];
                }
            }
            for (int a = 0; a < 4; a++) {
                v16 y[4];
                wino4_at(g[a], y);
                for (int b = 0; b < 4; b++) {
                    y[b] += bias;
                }
                /* the four columns of each tile, interleaved */
                const v16 p0 = __builtin_shuffle(y[0], y[1], low);
                const v16 p1 = __builtin_shuffle(y[0], y[1], high);
                const v16 q0 = __builtin_shuffle(y[2], y[3], low);
                const v16 q1 = __builtin_shuffle(y[2], y[3], high);
                float *at = rows[a] + 4 * t;
                *(v16 *)at = __builtin_shuffle(p0, q0, pairs);
                *(v16 *)(at + 16) = __builtin_shuffle(p0, q0, pairs_high);
                *(v16 *)(at + 32) = __builtin_shuffle(p1, q1, pairs);
                *(v16 *)(at + 48) = __builtin_shuffle(p1, q1, pairs_high);
            }
        }
        for (Py_ssize_t q = 0; q < units; q++) {
            const Py_ssize_t n = (unit0 + q) / p->th, i = (unit0 + q) % p->th;
            for (int a = 0; a < 4; a++) {
                const Py_ssize_t at = (n * p->k + k) * plane + (4 * i + a) * p->w;
                wino_store(p, at, rows[a] + q * p->w);
            }
        }
    }
}

/* The filters' transform, the threads sharing the channels (each with its own rows). */
struct wino_transform {
    const float *g;
    float *u, *rows; /* rows: 36 k floats a thread */
    Py_ssize_t k, c;
    int flipped, tile;
};

static int wino_transform_share(const void *arg, int t, int threads)
{
    const struct wino_transform *f = arg;
    const Py_ssize_t c0 = f->c * t / threads, c1 = f->c * (t + 1) / threads;
    float *row = f->rows + (size_t)t * 36 * (size_t)f->k;
    if (f->tile == 4) {
        wino4_filters(f->g, f->u, row, f->k, f->c, f->flipped, c0, c1);
    }
    else {
        wino_filters(f->g, f->u, row, f->k, f->c, f->flipped, c0, c1);
    }
    return 0;
}

static int wino_share(const void *arg, int t, int threads)
{
    const struct wino *p = arg;
    const Py_ssize_t span = p->tiles + 32; /* 16 before the tiles, slack after */
    const size_t v_floats = (size_t)(p->freqs * p->v_pitch);
    const size_t m_floats = (size_t)(p->freqs * p->m_pitch);
    if (reserve(&wino_scratch[t], v_floats + m_floats + (size_t)(16 * span + 16 * p->tiles), 0) < 0) {
        return -1;
    }
    float *v = wino_scratch[t].data, *m = v + v_floats, *cols = m + m_floats;
    float *const rows[4] = {cols + 16 * span, cols + 16 * span + 4 * p->tiles,
                            cols + 16 * span + 8 * p->tiles, cols + 16 * span + 12 * p->tiles};
    /* lanes past the block's tiles are transformed from these and multiplied, never read back */
    memset(cols, 0, sizeof(float) * (size_t)(16 * span));
    const Py_ssize_t units = p->n * p->th, blocks = (units + p->rows - 1) / p->rows;
    (void)threads;
    /* blocks taken in turn: the caller starts on them while the workers wake */
    for (Py_ssize_t blk; (blk = atomic_fetch_add(p->next, 1)) < blocks;) {
        const Py_ssize_t unit0 = blk * p->rows;
        const Py_ssize_t count = units - unit0 < p->rows ? units - unit0 : p->rows;
        const Py_ssize_t used = (count * p->tw + 15) / 16;
        if (p->tile == 4) {
            wino4_ins[wino4_packing(p->tw)](p, v, unit0, count);
        }
        else if (wino_lanes(p->tw)) {
            wino_in_lanes(p, v, unit0, count);
        }
        else {
            wino_in(p, v, cols, span, unit0, count);
        }
        for (int f = 0; f < p->freqs; f++) {
            const float *vf = v + f * p->v_pitch, *uf = p->u + f * p->c * p->k;
            float *mf = m + f * p->m_pitch;
            if (narrow_blocks) {
                for (Py_ssize_t k0 = 0; k0 < p->k; k0 += WINO_NARROW_FILTERS) {
                    const Py_ssize_t kb =
                        p->k - k0 < WINO_NARROW_FILTERS ? p->k - k0 : WINO_NARROW_FILTERS;
                    for (Py_ssize_t b = 0; b < used; b++) {
                        wino_dots_narrow[kb - 1](p, vf, uf, mf, k0, 16 * b);
                    }
                }
                continue;
            }
            for (Py_ssize_t k0 = 0; k0 < p->k; k0 += WINO_FILTERS) {
                const Py_ssize_t kb = p->k - k0 < WINO_FILTERS ? p->k - k0 : WINO_FILTERS;
                for (Py_ssize_t b = 0; b < used; b += WINO_VECTORS) {
                    const Py_ssize_t vb = used - b < WINO_VECTORS ? used - b : WINO_VECTORS;
                    wino_dots[kb - 1][vb - 1](p, vf, uf, mf, k0, 16 * b);
                }
            }
        }
        if (p->tile == 4) {
            wino4_out(p, m, rows, unit0, count);
        }
        else {
            wino_out(p, m, rows[0], rows[1], unit0, count);
        }
    }
    return 0;
}

/* `planes` planes h x w copied into planes he x we (he >= h, we >= w) whose other rows and
 * columns are zeros; NULL where memory runs out. */
static float *wino_padded(const float *src, Py_ssize_t planes, Py_ssize_t h, Py_ssize_t w,
                          Py_ssize_t he, Py_ssize_t we)
{
    float *dst = calloc((size_t)(planes * he * we), sizeof(float));
    if (dst == NULL) {
        return NULL;
    }
    for (Py_ssize_t plane = 0; plane < planes; plane++) {
        for (Py_ssize_t i = 0; i < h; i++) {
            memcpy(dst + (plane * he + i) * we, src + (plane * h + i) * w, sizeof(float) * (size_t)w);
        }
    }
    return dst;
}

PyDoc_STRVAR(conv_winograd_doc,
"conv_winograd(x, w, b, addend, y, threads, tile=0, flipped=False)\n--\n\n"
"Write into ``y`` (float32, C-contiguous, ``[N, K, H, W]``) the convolution of ``x``\n"
"``[N, C, H, W]`` with the 3 x 3 filters ``w`` ``[K, C, 3, 3]``, strides 1 and pads 1, plus\n"
"the bias ``b`` ``[K]`` and ``addend`` (``y``'s shape) where not None. By Winograd's\n"
"F(tile x tile, 3 x 3): ``tile`` 4 where H and W are multiples of 4 and W is 8, 16, 32 or a\n"
"multiple of 64, else 2; 0 picks 4 where it can. An odd H or W is computed over the plane\n"
"one row or column larger, of zeros there (copies of ``x``, ``addend`` and ``y``), with tile 2.\n"
"``threads`` threads share the tile rows. With ``flipped``, ``w`` is ``[C, K, 3, 3]`` and the\n"
"filters are ``w.transpose(1, 0, 2, 3)[:, :, ::-1, ::-1]`` (a Conv's input gradient), read in\n"
"place.");

static PyObject *conv_winograd(PyObject *self, PyObject *args)
{
    PyObject *objects[5];
    int threads, tile = 0, flipped = 0;
    if (!PyArg_ParseTuple(args, "OOOOOi|ip:conv_winograd", &objects[0], &objects[1], &objects[2],
                          &objects[3], &objects[4], &threads, &tile, &flipped)) {
        return NULL;
    }
    static const char *names[5] = {"x", "w", "b", "addend", "y"};
    static const int ranks[5] = {4, 4, 1, 4, 4};
    Py_buffer views[5];
    const float *bufs[5] = {NULL};
    Py_ssize_t held = 0, shapes[5][4] = {{0}};
    PyObject *result = NULL;
    float *u = NULL, *xp = NULL, *ap = NULL, *yp = NULL;
    for (int k = 0; k < 5; k++) {
        if (objects[k] == Py_None && (k == 2 || k == 3)) {
            continue;
        }
        if (float32_array(objects[k], &views[held], ranks[k], k == 4, "conv_winograd: argument",
                          k, names[k]) < 0) {
            goto done;
        }
        bufs[k] = views[held].buf;
        memcpy(shapes[k], views[held].shape, sizeof(Py_ssize_t) * (size_t)ranks[k]);
        held++;
    }
    const Py_ssize_t *xs = shapes[0], *ws = shapes[1], *ys = shapes[4];
    const Py_ssize_t n = xs[0], c = xs[1], h = xs[2], w = xs[3], k = ws[flipped ? 1 : 0];
    int fits = ws[flipped ? 0 : 1] == c && ws[2] == 3 && ws[3] == 3 && ys[0] == n && ys[1] == k && ys[2] == h &&
               ys[3] == w && h >= 1 && w >= 1 && c >= 1 && k >= 1;
    if (bufs[2] != NULL && shapes[2][0] != k) {
        fits = 0;
    }
    if (bufs[3] != NULL && memcmp(shapes[3], ys, sizeof(Py_ssize_t) * 4) != 0) {
        fits = 0;
    }
    if (!fits) {
        PyErr_Format(PyExc_ValueError,
                     "conv_winograd: x [%zd, %zd, %zd, %zd], w [%zd, %zd, %zd, %zd] and y [%zd,"
                     " %zd, %zd, %zd] are not one 3 x 3 convolution of pads 1; y must be [N, K,"
                     " H, W] with w [K, C, 3, 3] ([C, K, 3, 3] flipped), b [K] and addend y's"
                     " shape",
                     n, c, h, w, ws[0], ws[1], ws[2], ws[3], ys[0], ys[1], ys[2], ys[3]);
        goto done;
    }
    /* an odd side: the plane one larger, its last row or column zeros */
    const Py_ssize_t he = h + h % 2, we = w + w % 2;
    const int padded = he != h || we != w;
    const int four = !padded && h % 4 == 0 && w % 4 == 0 && wino4_lanes(w / 4);
    if (tile == 0) {
        tile = four ? 4 : 2;
    }
    if (tile != 2 && (tile != 4 || !four)) {
        PyErr_Format(PyExc_ValueError,
                     "conv_winograd: tile %d over a height %zd and width %zd; pass 2, 4 where"
                     " the height and width are multiples of 4 and the width is 8, 16, 32 or a"
                     " multiple of 64, or 0 to pick",
                     tile, h, w);
        goto done;
    }
    const int freqs = (tile + 2) * (tile + 2);
    /* a few thousand filters make enough work to wake a worker for */
    const int transform_threads = c * k < 4096 ? 1 : pool_threads(threads);
    u = malloc(sizeof(float) * (size_t)(freqs * c * k + 36 * k * transform_threads));
    if (u == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const struct wino_transform transform = {bufs[1], u, u + freqs * c * k, k, c, flipped, tile};
    if (run_pool(wino_transform_share, &transform, transform_threads) < 0) {
        goto done;
    }
    const float *x = bufs[0], *addend = bufs[3];
    float *y = (float *)bufs[4];
    if (padded) {
        xp = wino_padded(x, n * c, h, w, he, we);
        ap = addend != NULL ? wino_padded(addend, n * k, h, w, he, we) : NULL;
        yp = malloc(sizeof(float) * (size_t)(n * k * he * we));
        if (xp == NULL || yp == NULL || (addend != NULL && ap == NULL)) {
            PyErr_NoMemory();
            goto done;
        }
        x = xp, addend = ap, y = yp;
    }
    const Py_ssize_t th = he / tile, tw = we / tile, units = n * th;
    /* the block's V and M within wino_block_bytes, with enough blocks for the threads */
    const Py_ssize_t u_bytes = (Py_ssize_t)sizeof(float) * freqs * c * k;
    Py_ssize_t fit = wino_block_bytes(u_bytes) / (Py_ssize_t)sizeof(float) / (freqs * (c + k)) / tw;
    fit = fit > 1 ? fit : 1;
    fit = fit < WINO_MAX_ROWS ? fit : WINO_MAX_ROWS;
    if (n * k * he * we < ROUTE_PER_THREAD / 4 || threads < 1) {
        threads = 1;
    }
    Py_ssize_t rows = (units + 2 * threads - 1) / (2 * threads);
    rows = rows < fit ? rows : fit;
    if (tw < 16 && 16 % tw == 0) { /* whole vectors of tiles */
        const Py_ssize_t per = 16 / tw;
        rows = (rows + per - 1) / per * per;
    }
    atomic_long next = 0;
    struct wino p = {
        .x = x, .b = bufs[2], .addend = addend, .y = y, .u = u, .n = n,
        .c = c, .h = he, .w = we, .k = k, .tile = tile, .freqs = freqs, .th = th, .tw = tw, .rows = rows,
        .tiles = round16(rows * tw), .v_pitch = c * round16(rows * tw) + 16,
        .m_pitch = k * round16(rows * tw) + 16, .next = &next,
    };
    if (run_pool(wino_share, &p, threads) < 0) {
        goto done;
    }
    if (padded) {
        float *out = (float *)bufs[4];
        for (Py_ssize_t plane = 0; plane < n * k; plane++) {
            for (Py_ssize_t i = 0; i < h; i++) {
                memcpy(out + (plane * h + i) * w, yp + (plane * he + i) * we, sizeof(float) * (size_t)w);
            }
        }
    }
    result = Py_NewRef(Py_None);
done:
    release_views(views, held);
    free(u);
    free(xp);
    free(ap);
    free(yp);
    return result;
}

/* ------------------------------------------ weight gradients by F(4 x 4, 3 x 3)
 *
 * The weight gradient of a 3 x 3 Conv sums, over the 4 x 4 tiles of the output gradient dY,
 * the correlation of each tile with the 6 x 6 input patch it reads; by the same identity as
 * the forward's, read the other way round,
 *
 *     dW[k, c] = G^T [ sum_tiles (A dY[k] A^T) * (B^T X[c] B) ] G
 *
 * with the forward's B, G and A (A = (A^T)^T, 6 x 4): 36 products per tile and filter pair
 * instead of 144, summed over the tiles as 36 matrix products that reduce along the tiles
 * (dot_rows), into sums of 36 x K x C per thread. The input patches are transformed as the
 * forward transforms them (wino4_in). */

/* A y for four vectors y: the six places of the tile's four outputs. */
static inline __attribute__((always_inline)) void wino4_a(const v16 y[4], v16 o[6])
{
    const v16 even = y[0] + y[2], odd = y[1] + y[3];
    const v16 even4 = y[0] + 4.0f * y[2], odd2 = 2.0f * y[1] + 8.0f * y[3];
    o[0] = y[0];
    o[1] = even + odd;
    o[2] = even - odd;
    o[3] = even4 + odd2;
    o[4] = even4 - odd2;
    o[5] = y[3];
}

/* The block's transformed output gradients Z[f][k][t] = (A dY[k] A^T)[f / 6][f % 6] of tile
 * t = q * tw + j, whole vectors along t (zeros in lanes past the block's tiles). */
static inline __attribute__((always_inline)) void wino4_grads(const struct wino *p,
                                                              float *restrict z, Py_ssize_t unit0,
                                                              Py_ssize_t units, const int rows)
{
    const Py_ssize_t tw = p->tw, used = units * tw;
    const Py_ssize_t stride = p->m_pitch; /* between frequencies */
    Py_ssize_t first[WINO_MAX_ROWS + 15];
    const float *base[WINO_MAX_ROWS + 15];
    wino_rows(p, p->dy, p->k, 0, unit0, units, first, base);
    for (Py_ssize_t k = 0; k < p->k; k++) {
        float *dst = z + k * p->tiles;
        for (Py_ssize_t t = 0; t < used; t += 16) {
            const Py_ssize_t q = rows == 1 ? t / tw : t / (16 / rows);
            const Py_ssize_t m = rows == 1 ? t % tw : 0;
            v16 h[4][6];
            for (int r = 0; r < 4; r++) {
                v16 x[4], d[4];
                wino4_load(p, base, first, q, m, units, r, k, x, rows);
                wino4_phases(x, d);
                wino4_a(d, h[r]);
            }
            for (int s = 0; s < 6; s++) {
                const v16 col[4] = {h[0][s], h[1][s], h[2][s], h[3][s]};
                v16 o[6];
                wino4_a(col, o);
                for (int a = 0; a < 6; a++) {
                    *(v16 *)(dst + (a * 6 + s) * stride + t) = o[a];
                }
            }
        }
    }
}

#define WINO4_GRADS(rows)                                                                         \
    TARGETS static void wino4_grads_##rows(const struct wino *p, float *restrict z,             \
                                           Py_ssize_t unit0, Py_ssize_t units)                   \
    {                                                                                             \
        wino4_grads(p, z, unit0, units, rows);                                                    \
    }
WINO4_GRADS(1) WINO4_GRADS(2) WINO4_GRADS(4) WINO4_GRADS(8)
static const wino_block_fn wino4_grads_of[4] = {wino4_grads_1, wino4_grads_2, wino4_grads_4,
                                                wino4_grads_8};

/* Channels and filters from which the weight gradient goes by Winograd's transforms: below,
 * the transforms cost more than the direct sums they save. */
#define WINO_WEIGHT_MIN 8
#define WINO_WEIGHT_BLOCK_BYTES (1024 * 1024)

/* Whether wino_weight_samples takes cv's weight gradient: a 3 x 3 Conv of strides and
 * dilations 1, pads 1 on every side and one group whose output's height and width are
 * F(4 x 4, 3 x 3)'s (as conv_winograd's). */
static int wino_weight_fits(const struct conv *cv)
{
    return cv->kh == 3 && cv->kw == 3 && cv->stride[0] == 1 && cv->stride[1] == 1 &&
           cv->dilation[0] == 1 && cv->dilation[1] == 1 && cv->group == 1 && cv->pad[0] == 1 &&
           cv->pad[1] == 1 && cv->oh == cv->h && cv->ow == cv->w && cv->h % 4 == 0 &&
           cv->w % 4 == 0 && wino4_lanes(cv->w / 4) && cv->c >= WINO_WEIGHT_MIN &&
           cv->m >= WINO_WEIGHT_MIN;
}

/* dw[k][c][3][3] = G^T sums[.][k][c] G for the sums [36][K][C], 16 channels at a time. */
TARGETS static void wino4_weights(const float *sums, float *dw, Py_ssize_t k, Py_ssize_t c)
{
    /* G^T's rows: the 3 taps' weights of the 6 places */
    static const float gt[3][6] = {
        {0.25f, -1.0f / 6, -1.0f / 6, 1.0f / 24, 1.0f / 24, 0.0f},
        {0.0f, -1.0f / 6, 1.0f / 6, 1.0f / 12, -1.0f / 12, 0.0f},
        {0.0f, -1.0f / 6, -1.0f / 6, 1.0f / 6, 1.0f / 6, 1.0f},
    };
    const Py_ssize_t kc = k * c;
    for (Py_ssize_t kk = 0; kk < k; kk++) {
        for (Py_ssize_t c0 = 0; c0 < c; c0 += 16) {
            const Py_ssize_t lanes = c - c0 < 16 ? c - c0 : 16;
            v16 m[36];
            for (int f = 0; f < 36; f++) {
                const float *at = sums + f * kc + kk * c + c0;
                if (lanes == 16) {
                    m[f] = *(const v16u *)at;
                }
                else {
                    float part[16] __attribute__((aligned(64))) = {0};
                    memcpy(part, at, sizeof(float) * (size_t)lanes);
                    m[f] = *(const v16 *)part;
                }
            }
            float taps[9][16] __attribute__((aligned(64)));
            for (int i = 0; i < 3; i++) {
                v16 row[6]; /* (G^T M)[i][b] */
                for (int b = 0; b < 6; b++) {
                    row[b] = (v16){0};
                    for (int a = 0; a < 6; a++) {
                        if (gt[i][a] != 0.0f) {
                            row[b] += gt[i][a] * m[a * 6 + b];
                        }
                    }
                }
                for (int j = 0; j < 3; j++) {
                    v16 out = {0};
                    for (int b = 0; b < 6; b++) {
                        if (gt[j][b] != 0.0f) {
                            out += gt[j][b] * row[b];
                        }
                    }
                    *(v16 *)taps[i * 3 + j] = out;
                }
            }
            float *dst = dw + (kk * c + c0) * 9;
            for (Py_ssize_t l = 0; l < lanes; l++) {
                for (int e = 0; e < 9; e++) {
                    dst[l * 9 + e] = taps[e][l];
                }
            }
        }
    }
}

/* dw = the weight gradient of samples [n0, n1) of cv, for wino_weight_fits(cv). */
static int wino_weight_samples(const struct conv *cv, float *dw, Py_ssize_t n0, Py_ssize_t n1,
                               struct scratch *scratch)
{
    const Py_ssize_t c = cv->c, k = cv->m, tw = cv->w / 4, th = cv->h / 4;
    /* each block adds into all the sums (36 k c of them): where they are many, larger blocks
     * (up to 4 MiB of patches, half the sums' bytes) read and write them fewer times */
    Py_ssize_t budget = 36 * k * c * (Py_ssize_t)sizeof(float) / 2;
    budget = budget < WINO_WEIGHT_BLOCK_BYTES ? WINO_WEIGHT_BLOCK_BYTES : budget;
    budget = budget > 4096 * 1024 ? 4096 * 1024 : budget;
    Py_ssize_t rows = budget / (Py_ssize_t)sizeof(float) / (36 * (c + k)) / tw;
    rows = rows > 1 ? rows : 1;
    rows = rows < WINO_MAX_ROWS ? rows : WINO_MAX_ROWS;
    if (tw < 16) { /* whole vectors of tiles */
        const Py_ssize_t per = 16 / tw;
        rows = (rows + per - 1) / per * per;
    }
    const Py_ssize_t tiles = round16(rows * tw);
    struct wino p = {
        .x = cv->x, .dy = cv->dy, .n = cv->n, .c = c, .h = cv->h, .w = cv->w, .k = k, .tile = 4,
        .freqs = 36, .th = th, .tw = tw, .rows = rows, .tiles = tiles,
        .v_pitch = c * tiles + 16, .m_pitch = k * tiles + 16,
    };
    const size_t v_floats = (size_t)(36 * p.v_pitch), z_floats = (size_t)(36 * p.m_pitch);
    if (reserve(scratch, v_floats + z_floats + (size_t)(36 * k * c), (size_t)c) < 0) {
        return -1;
    }
    float *v = scratch->data, *z = v + v_floats, *sums = z + z_floats;
    Py_ssize_t *offsets = scratch->offsets;
    for (Py_ssize_t cc = 0; cc < c; cc++) {
        offsets[cc] = cc * tiles;
    }
    memset(sums, 0, sizeof(float) * (size_t)(36 * k * c));
    const int packing = wino4_packing(tw);
    for (Py_ssize_t unit0 = n0 * th; unit0 < n1 * th; unit0 += rows) {
        const Py_ssize_t count = n1 * th - unit0 < rows ? n1 * th - unit0 : rows;
        wino4_ins[packing](&p, v, unit0, count);
        wino4_grads_of[packing](&p, z, unit0, count);
        const Py_ssize_t len = round16(count * tw);
        for (int f = 0; f < 36; f++) {
            dot_rows(z + f * p.m_pitch, tiles, v + f * p.v_pitch, offsets, sums + f * k * c, c, k,
                     c, len);
        }
    }
    wino4_weights(sums, dw, k, c);
    return 0;
}
