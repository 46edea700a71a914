/* Native one-pass AdamW and SGD updates for traingraph.runtime.optimizer.fused.
 *
 * Plain CPython C API and the buffer protocol: no numpy headers. Each function updates
 * C-contiguous float32 or float64 buffers in place in one pass, without the GIL, with the
 * optimizer graph's operations in the graph's order (see _fusedc_kernels.h).
 */
#define PY_SSIZE_T_CLEAN
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* sched_getcpu, pthread_setaffinity_np (_pool.h) */
#endif
#include <Python.h>
#include <math.h>
#include <string.h>

#include "pool.h"

enum sgd_mode { SGD_PLAIN, SGD_MOMENTUM, SGD_NESTEROV, SGD_DAMPENED, SGD_FIRST_DAMPENED };

struct adamw_args {
    void *param, *exp_avg, *exp_avg_sq;
    const void *grad;
    int decay;
    /* 1 - b1, b2, 1 - b2, 1 - b1^t, sqrt(1 - b2^t), eps, weight_decay, -lr */
    double coefficients[8];
};

struct sgd_args {
    void *param, *momentum_buffer;
    const void *grad;
    int decay;
    enum sgd_mode mode;
    /* weight_decay, momentum, 1 - dampening, -lr */
    double coefficients[4];
};

/* The loops are bound by their divisions and square roots, so wider vectors pay: where the
 * loader picks a function's version at run time (GNU ifunc), build one per vector width. */
#if defined(__x86_64__) && defined(__GLIBC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define TARGETS __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef TARGETS
#define TARGETS
#endif

#define T float
#define SQRT sqrtf
#define SUFFIX f32
#include "optimizer_kernels.h"
#undef T
#undef SQRT
#undef SUFFIX

#define T double
#define SQRT sqrt
#define SUFFIX f64
#include "optimizer_kernels.h"
#undef T
#undef SQRT
#undef SUFFIX

/* The kernels with an untyped argument, as run_elementwise takes them. */
static void adamw_f32_any(const void *a, Py_ssize_t begin, Py_ssize_t end)
{
    adamw_f32(a, begin, end);
}
static void adamw_f64_any(const void *a, Py_ssize_t begin, Py_ssize_t end)
{
    adamw_f64(a, begin, end);
}
static void sgd_f32_any(const void *a, Py_ssize_t begin, Py_ssize_t end)
{
    sgd_f32(a, begin, end);
}
static void sgd_f64_any(const void *a, Py_ssize_t begin, Py_ssize_t end)
{
    sgd_f64(a, begin, end);
}

static PyObject *UnsupportedArray;

/* The element type of a buffer: 'f' (float32), 'd' (float64), or 0 for anything else. */
static char element_type(const Py_buffer *view)
{
    const char *format = view->format ? view->format : "B";
    const int little = PY_LITTLE_ENDIAN;
    if (*format == '@' || *format == '=' || (*format == '<' && little) ||
        ((*format == '>' || *format == '!') && !little)) {
        format++;
    }
    if (format[0] == 'f' && format[1] == '\0' && view->itemsize == 4) {
        return 'f';
    }
    if (format[0] == 'd' && format[1] == '\0' && view->itemsize == 8) {
        return 'd';
    }
    return 0;
}

static PyObject *shape_tuple(const Py_buffer *view)
{
    PyObject *shape = PyTuple_New(view->ndim);
    for (int k = 0; shape != NULL && k < view->ndim; k++) {
        PyObject *size = PyLong_FromSsize_t(view->shape[k]);
        if (size == NULL) {
            Py_CLEAR(shape);
            break;
        }
        PyTuple_SET_ITEM(shape, k, size);
    }
    return shape;
}

/* Get the buffer of argument `name`: writable when `writable`, C-contiguous, float32 or
 * float64, and of `like`'s shape and element type unless `like` is NULL. Raises
 * UnsupportedArray (a TypeError) for another element type or a non-contiguous layout, which
 * the numpy fallback handles, and ValueError for a read-only or mismatched array. */
static int get_array(const char *function, PyObject *obj, const char *name, int writable,
                     Py_buffer *view, const Py_buffer *like)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_RECORDS_RO) < 0) {
        PyErr_Clear();
        PyErr_Format(UnsupportedArray,
                     "%s: %s must be an array with the buffer protocol (a numpy array); got %.200s",
                     function, name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    const char type = element_type(view);
    if (type == 0) {
        PyErr_Format(UnsupportedArray,
                     "%s: %s has element format '%s' of %zd bytes; the native update takes"
                     " float32 or float64 arrays",
                     function, name, view->format ? view->format : "B", view->itemsize);
    }
    else if (!PyBuffer_IsContiguous(view, 'C')) {
        PyErr_Format(UnsupportedArray,
                     "%s: %s is not C-contiguous; the native update takes contiguous arrays"
                     " (numpy.ascontiguousarray makes one)",
                     function, name);
    }
    else if (writable && view->readonly) {
        PyErr_Format(PyExc_ValueError, "%s: %s is read-only; it is updated in place, pass a"
                     " writable array", function, name);
    }
    else if (like != NULL && (type != element_type(like) || view->ndim != like->ndim ||
                              memcmp(view->shape, like->shape, sizeof(Py_ssize_t) * like->ndim))) {
        PyObject *got = shape_tuple(view), *expected = shape_tuple(like);
        if (got != NULL && expected != NULL) {
            PyErr_Format(PyExc_ValueError,
                         "%s: %s has shape %R and dtype %s, but param has shape %R and dtype %s;"
                         " pass matching arrays",
                         function, name, got, type == 'f' ? "float32" : "float64", expected,
                         element_type(like) == 'f' ? "float32" : "float64");
        }
        Py_XDECREF(got);
        Py_XDECREF(expected);
    }
    else {
        return 0;
    }
    PyBuffer_Release(view);
    return -1;
}

static void release_all(Py_buffer *views, int count)
{
    for (int k = 0; k < count; k++) {
        PyBuffer_Release(&views[k]);
    }
}

static int check_step(const char *function, long long step)
{
    if (step < 1) {
        PyErr_Format(PyExc_ValueError, "%s: step is the 1-based number of this step; got %lld",
                     function, step);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(adamw_doc,
"adamw(param, grad, exp_avg, exp_avg_sq, lr, step, beta1, beta2, eps, weight_decay,\n"
"      threads=1)\n--\n\n"
"One AdamW step in place over C-contiguous float32 or float64 arrays of one shape, in one\n"
"pass, as the optimizer graph's AdamW computes it (traingraph.runtime.optimizer.fused calls\n"
"it); up to ``threads`` threads share the elements.");

static PyObject *fused_adamw(PyObject *self, PyObject *args)
{
    PyObject *objects[4];
    double lr, b1, b2, eps, weight_decay;
    long long step;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OOOOdLdddd|i:adamw", &objects[0], &objects[1], &objects[2],
                          &objects[3], &lr, &step, &b1, &b2, &eps, &weight_decay, &threads) ||
        check_step("adamw", step) < 0) {
        return NULL;
    }
    static const char *names[4] = {"param", "grad", "exp_avg", "exp_avg_sq"};
    Py_buffer views[4];
    for (int k = 0; k < 4; k++) {
        if (get_array("adamw", objects[k], names[k], k != 1, &views[k], k ? &views[0] : NULL)) {
            release_all(views, k);
            return NULL;
        }
    }
    struct adamw_args a = {
        .param = views[0].buf, .grad = views[1].buf, .exp_avg = views[2].buf,
        .exp_avg_sq = views[3].buf, .decay = weight_decay != 0,
        .coefficients = {1.0 - b1, b2, 1.0 - b2, 1.0 - pow(b1, (double)step),
                         sqrt(1.0 - pow(b2, (double)step)), eps, weight_decay, -lr},
    };
    const Py_ssize_t n = views[0].len / views[0].itemsize;
    run_elementwise(element_type(&views[0]) == 'f' ? adamw_f32_any : adamw_f64_any, &a, n, threads);
    release_all(views, 4);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(sgd_doc,
"sgd(param, grad, momentum_buffer, lr, step, momentum, dampening, nesterov, weight_decay,\n"
"    threads=1)\n--\n\n"
"One SGD step in place over C-contiguous float32 or float64 arrays of one shape, in one\n"
"pass, as the optimizer graph's SGD computes it (traingraph.runtime.optimizer.fused calls\n"
"it); up to ``threads`` threads share the elements. momentum_buffer may be None when\n"
"momentum is 0; grad is not modified.");

static PyObject *fused_sgd(PyObject *self, PyObject *args)
{
    PyObject *objects[3];
    double lr, momentum, dampening, weight_decay;
    long long step;
    int nesterov, threads = 1;
    if (!PyArg_ParseTuple(args, "OOOdLddpd|i:sgd", &objects[0], &objects[1], &objects[2], &lr,
                          &step, &momentum, &dampening, &nesterov, &weight_decay, &threads) ||
        check_step("sgd", step) < 0) {
        return NULL;
    }
    const int count = momentum > 0 ? 3 : 2;
    if (count == 3 && objects[2] == Py_None) {
        PyErr_SetString(PyExc_ValueError,
                        "sgd: momentum > 0 needs the momentum_buffer slot; got None");
        return NULL;
    }
    static const char *names[3] = {"param", "grad", "momentum_buffer"};
    Py_buffer views[3];
    for (int k = 0; k < count; k++) {
        if (get_array("sgd", objects[k], names[k], k != 1, &views[k], k ? &views[0] : NULL)) {
            release_all(views, k);
            return NULL;
        }
    }
    struct sgd_args a = {
        .param = views[0].buf, .grad = views[1].buf,
        .momentum_buffer = count == 3 ? views[2].buf : NULL, .decay = weight_decay != 0,
        .mode = count == 2 ? SGD_PLAIN
                : nesterov ? SGD_NESTEROV
                : dampening == 0 ? SGD_MOMENTUM
                : step == 1 ? SGD_FIRST_DAMPENED
                : SGD_DAMPENED,
        .coefficients = {weight_decay, momentum, 1.0 - dampening, -lr},
    };
    const Py_ssize_t n = views[0].len / views[0].itemsize;
    run_elementwise(element_type(&views[0]) == 'f' ? sgd_f32_any : sgd_f64_any, &a, n, threads);
    release_all(views, count);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"adamw", fused_adamw, METH_VARARGS, adamw_doc},
    {"sgd", fused_sgd, METH_VARARGS, sgd_doc},
    {NULL, NULL, 0, NULL},
};

PyMODINIT_FUNC PyInit__fusedc(void)
{
    PyObject *module = pool_module(
        "traingraph.runtime._fusedc",
        "Native one-pass AdamW and SGD updates over contiguous float buffers.", methods);
    if (module == NULL) {
        return NULL;
    }
    UnsupportedArray = PyErr_NewExceptionWithDoc(
        "traingraph.runtime._fusedc.UnsupportedArray",
        "An array the native update does not take (element type or layout); the numpy update"
        " does.",
        PyExc_TypeError, NULL);
    if (UnsupportedArray == NULL || PyModule_AddObjectRef(module, "UnsupportedArray",
                                                          UnsupportedArray) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
