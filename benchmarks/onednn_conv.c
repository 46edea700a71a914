/* oneDNN's 2-D float32 convolution primitives over NCHW buffers, for benchmarks/onednn_conv.py.
 *
 * dn_create builds one primitive (forward, backward-data or backward-weights) over caller
 * buffers in NCHW / OIHW (GOIHW for groups); with blocked = 1 the primitive picks its own
 * layouts and the run reorders in and out of them (as a caller holding NCHW tensors pays),
 * with blocked = 0 it is asked for the plain layouts. dn_run executes it and waits. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <oneapi/dnnl/dnnl.h>

enum { FWD = 0, BWD_DATA = 1, BWD_WEIGHTS = 2 };

static dnnl_engine_t engine;
static dnnl_stream_t stream;

struct side {
    dnnl_memory_t user, inner;   /* inner == user when no reorder is needed */
    dnnl_primitive_t reorder;    /* user -> inner (inputs) or inner -> user (outputs) */
};

struct plan {
    dnnl_primitive_t conv;
    struct side in[2], out;
    int in_args[2], out_arg;
    dnnl_memory_t scratch;
    char impl[128];
};

#define CHECK(call)                                                                       \
    do {                                                                                  \
        dnnl_status_t s_ = (call);                                                        \
        if (s_ != dnnl_success) {                                                         \
            fprintf(stderr, "onednn_conv: %s failed with status %d\n", #call, (int)s_);  \
            return NULL;                                                                  \
        }                                                                                 \
    } while (0)

static int side_init(struct side *sd, const_dnnl_memory_desc_t inner_md,
                     const_dnnl_memory_desc_t user_md, void *buffer, int is_input)
{
    if (dnnl_memory_create(&sd->user, user_md, engine, buffer) != dnnl_success) {
        return -1;
    }
    sd->reorder = NULL;
    if (dnnl_memory_desc_equal(inner_md, user_md)) {
        sd->inner = sd->user;
        return 0;
    }
    if (dnnl_memory_create(&sd->inner, inner_md, engine, DNNL_MEMORY_ALLOCATE) != dnnl_success) {
        return -1;
    }
    dnnl_primitive_desc_t pd;
    if (dnnl_reorder_primitive_desc_create(&pd, is_input ? user_md : inner_md, engine,
                                           is_input ? inner_md : user_md, engine, NULL) !=
        dnnl_success) {
        return -1;
    }
    dnnl_status_t s = dnnl_primitive_create(&sd->reorder, pd);
    dnnl_primitive_desc_destroy(pd);
    return s == dnnl_success ? 0 : -1;
}

static void side_reorder(struct side *sd, int is_input)
{
    if (sd->reorder == NULL) {
        return;
    }
    dnnl_exec_arg_t args[2] = {{DNNL_ARG_FROM, is_input ? sd->user : sd->inner},
                               {DNNL_ARG_TO, is_input ? sd->inner : sd->user}};
    dnnl_primitive_execute(sd->reorder, stream, 2, args);
}

const char *dn_impl(void *p) { return ((struct plan *)p)->impl; }

void *dn_create(int op, long n, long c, long h, long w, long m, long kh, long kw, long sh,
                long sw, long ph, long pw, long dh, long dw, long g, int blocked, float *x,
                float *wt, float *y)
{
    if (engine == NULL) {
        CHECK(dnnl_engine_create(&engine, dnnl_cpu, 0));
        CHECK(dnnl_stream_create(&stream, engine, dnnl_stream_default_flags));
    }
    const long oh = (h + 2 * ph - (dh * (kh - 1) + 1)) / sh + 1;
    const long ow = (w + 2 * pw - (dw * (kw - 1) + 1)) / sw + 1;
    dnnl_dims_t xd = {n, c, h, w}, yd = {n, m, oh, ow};
    dnnl_dims_t wd4 = {m, c, kh, kw}, wd5 = {g, m / g, c / g, kh, kw};
    dnnl_dims_t strides = {sh, sw}, dil = {dh - 1, dw - 1}, pad = {ph, pw};
    dnnl_memory_desc_t xu, yu, wu, xa, ya, wa;
    CHECK(dnnl_memory_desc_create_with_tag(&xu, 4, xd, dnnl_f32, dnnl_nchw));
    CHECK(dnnl_memory_desc_create_with_tag(&yu, 4, yd, dnnl_f32, dnnl_nchw));
    if (g > 1) {
        CHECK(dnnl_memory_desc_create_with_tag(&wu, 5, wd5, dnnl_f32, dnnl_goihw));
    }
    else {
        CHECK(dnnl_memory_desc_create_with_tag(&wu, 4, wd4, dnnl_f32, dnnl_oihw));
    }
    const dnnl_format_tag_t any = blocked ? dnnl_format_tag_any : dnnl_nchw;
    CHECK(dnnl_memory_desc_create_with_tag(&xa, 4, xd, dnnl_f32, any));
    CHECK(dnnl_memory_desc_create_with_tag(&ya, 4, yd, dnnl_f32, any));
    if (g > 1) {
        CHECK(dnnl_memory_desc_create_with_tag(&wa, 5, wd5, dnnl_f32,
                                               blocked ? dnnl_format_tag_any : dnnl_goihw));
    }
    else {
        CHECK(dnnl_memory_desc_create_with_tag(&wa, 4, wd4, dnnl_f32,
                                               blocked ? dnnl_format_tag_any : dnnl_oihw));
    }
    dnnl_primitive_desc_t fwd, pd;
    CHECK(dnnl_convolution_forward_primitive_desc_create(
        &fwd, engine, dnnl_forward_training, dnnl_convolution_direct, xa, wa, NULL, ya, strides,
        dil, pad, pad, NULL));
    if (op == FWD) {
        pd = fwd;
    }
    else if (op == BWD_DATA) {
        CHECK(dnnl_convolution_backward_data_primitive_desc_create(
            &pd, engine, dnnl_convolution_direct, xa, wa, ya, strides, dil, pad, pad, fwd, NULL));
    }
    else {
        CHECK(dnnl_convolution_backward_weights_primitive_desc_create(
            &pd, engine, dnnl_convolution_direct, xa, wa, NULL, ya, strides, dil, pad, pad, fwd,
            NULL));
    }
    struct plan *p = calloc(1, sizeof *p);
    const char *impl = NULL;
    dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl);
    snprintf(p->impl, sizeof p->impl, "%s", impl ? impl : "?");
    const_dnnl_memory_desc_t xi, yi, wi;
    if (op == FWD) {
        xi = dnnl_primitive_desc_query_md(pd, dnnl_query_src_md, 0);
        wi = dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
        yi = dnnl_primitive_desc_query_md(pd, dnnl_query_dst_md, 0);
        if (side_init(&p->in[0], xi, xu, x, 1) || side_init(&p->in[1], wi, wu, wt, 1) ||
            side_init(&p->out, yi, yu, y, 0)) {
            return NULL;
        }
        p->in_args[0] = DNNL_ARG_SRC;
        p->in_args[1] = DNNL_ARG_WEIGHTS;
        p->out_arg = DNNL_ARG_DST;
    }
    else if (op == BWD_DATA) {
        xi = dnnl_primitive_desc_query_md(pd, dnnl_query_diff_src_md, 0);
        wi = dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
        yi = dnnl_primitive_desc_query_md(pd, dnnl_query_diff_dst_md, 0);
        if (side_init(&p->in[0], yi, yu, y, 1) || side_init(&p->in[1], wi, wu, wt, 1) ||
            side_init(&p->out, xi, xu, x, 0)) {
            return NULL;
        }
        p->in_args[0] = DNNL_ARG_DIFF_DST;
        p->in_args[1] = DNNL_ARG_WEIGHTS;
        p->out_arg = DNNL_ARG_DIFF_SRC;
    }
    else {
        xi = dnnl_primitive_desc_query_md(pd, dnnl_query_src_md, 0);
        wi = dnnl_primitive_desc_query_md(pd, dnnl_query_diff_weights_md, 0);
        yi = dnnl_primitive_desc_query_md(pd, dnnl_query_diff_dst_md, 0);
        if (side_init(&p->in[0], xi, xu, x, 1) || side_init(&p->in[1], yi, yu, y, 1) ||
            side_init(&p->out, wi, wu, wt, 0)) {
            return NULL;
        }
        p->in_args[0] = DNNL_ARG_SRC;
        p->in_args[1] = DNNL_ARG_DIFF_DST;
        p->out_arg = DNNL_ARG_DIFF_WEIGHTS;
    }
    const_dnnl_memory_desc_t sm = dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    if (sm != NULL && dnnl_memory_desc_get_size(sm) > 0) {
        CHECK(dnnl_memory_create(&p->scratch, sm, engine, DNNL_MEMORY_ALLOCATE));
    }
    CHECK(dnnl_primitive_create(&p->conv, pd));
    return p;
}

int dn_run(void *handle)
{
    struct plan *p = handle;
    side_reorder(&p->in[0], 1);
    side_reorder(&p->in[1], 1);
    dnnl_exec_arg_t args[4] = {{p->in_args[0], p->in[0].inner},
                               {p->in_args[1], p->in[1].inner},
                               {p->out_arg, p->out.inner},
                               {DNNL_ARG_SCRATCHPAD, p->scratch}};
    int nargs = p->scratch ? 4 : 3;
    if (dnnl_primitive_execute(p->conv, stream, nargs, args) != dnnl_success) {
        return -1;
    }
    side_reorder(&p->out, 0);
    return dnnl_stream_wait(stream) == dnnl_success ? 0 : -1;
}
