/* A pool of persistent worker threads for traingraph's native kernels (_convc.c, _fusedc.c).
 *
 * pool_run(share, arg, threads) runs share(arg, t, threads) for t < threads, each share once;
 * one task at a time. The caller runs share 0, then every share that no worker has claimed
 * yet: worker t claims share t when it wakes, and a worker that the scheduler lets wait (a
 * busy machine) leaves its share to the caller instead of holding up the task. The workers
 * sleep between tasks, and are kept off the caller's CPU before they are woken. Each
 * extension that includes this file has its own pool; its module init creates the module with
 * pool_module(), which registers a fork handler so that a fork()ed child starts its own
 * workers.
 */
#ifndef TRAINGRAPH_POOL_H
#define TRAINGRAPH_POOL_H

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

#ifndef MAX_THREADS
#define MAX_THREADS 64
#endif

/* One call's work: share(arg, t, threads) does thread t's part of it. */
struct task {
    int (*share)(const void *arg, int t, int threads);
    const void *arg;
    int threads;
};

static struct {
    pthread_mutex_t busy;        /* one task at a time */
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int started;                 /* workers running (they never exit) */
    atomic_uint_fast64_t generation;
    atomic_uint_fast64_t claimed[MAX_THREADS]; /* the last generation each share was claimed in */
    atomic_int done;                           /* shares the workers finished in this one */
    atomic_int failed;
    struct task task;
    uint_fast64_t created_at[MAX_THREADS]; /* the generation when each worker was created */
    pthread_t ids[MAX_THREADS];
    int away_from;                         /* the caller's CPU the workers were kept off, or -1 */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          .away_from = -1};

/* Keep the sleeping workers off the caller's CPU before waking them. Woken, a worker is often
 * placed on its waker's CPU, where it waits for the caller to finish its own share: the task
 * then runs one share after the other. */
static void keep_workers_away(void)
{
#if defined(__linux__) && defined(CPU_SET)
    const int cpu = sched_getcpu();
    if (cpu < 0 || cpu == pool.away_from) {
        return;
    }
    cpu_set_t allowed;
    if (pthread_getaffinity_np(pthread_self(), sizeof allowed, &allowed) != 0 ||
        !CPU_ISSET(cpu, &allowed) || CPU_COUNT(&allowed) < 2) {
        return;
    }
    CPU_CLR(cpu, &allowed);
    for (int t = 1; t <= pool.started; t++) {
        pthread_setaffinity_np(pool.ids[t], sizeof allowed, &allowed);
    }
    pool.away_from = cpu;
#endif
}

static void run_share(int t)
{
    const struct task *task = &pool.task;
    if (task->share(task->arg, t, task->threads) < 0) {
        atomic_store(&pool.failed, 1);
    }
}

static inline void pause_cpu(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Whether this thread takes share t of task `generation`: the first to ask does. A claim
 * for a task already finished fails (its caller claimed every share before it returned). */
static int claim(int t, uint_fast64_t generation)
{
    uint_fast64_t last = atomic_load(&pool.claimed[t]);
    while (last < generation) {
        if (atomic_compare_exchange_weak(&pool.claimed[t], &last, generation)) {
            return 1;
        }
    }
    return 0;
}

static void *worker(void *arg)
{
    const int t = (int)(intptr_t)arg;
    /* Created between tasks: the next one posted is the first it runs. */
    uint_fast64_t seen = pool.created_at[t];
    for (;;) {
        /* Tasks come a few per training step, apart: sleep until the next one. */
        uint_fast64_t now;
        pthread_mutex_lock(&pool.lock);
        while ((now = atomic_load(&pool.generation)) == seen) {
            pthread_cond_wait(&pool.wake, &pool.lock);
        }
        pthread_mutex_unlock(&pool.lock);
        seen = now;
        if (claim(t, now)) { /* the task is still running and waits for this share */
            run_share(t);
            atomic_fetch_add(&pool.done, 1);
        }
    }
    return NULL;
}

/* Run share(arg, t, threads) for t < threads, the caller being thread 0. Returns the thread
 * count used (fewer where a worker could not start), or -1 when a share failed (a scratch
 * buffer could not be allocated). The caller holds pool.busy. */
static int run_task(int (*share)(const void *, int, int), const void *arg, int threads)
{
    while (pool.started < threads - 1) {
        pthread_t id;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pool.created_at[pool.started + 1] = atomic_load(&pool.generation);
        const int failed = pthread_create(&id, &attr, worker, (void *)(intptr_t)(pool.started + 1));
        pthread_attr_destroy(&attr);
        if (failed) {
            threads = pool.started + 1;
            break;
        }
        pool.ids[++pool.started] = id;
        pool.away_from = -1;
    }
    pool.task = (struct task){share, arg, threads};
    atomic_store(&pool.failed, 0);
    atomic_store(&pool.done, 0);
    const uint_fast64_t generation = atomic_load(&pool.generation) + 1;
    for (int t = threads; t <= pool.started; t++) { /* the workers without a share */
        atomic_store(&pool.claimed[t], generation);
    }
    if (threads > 1) {
        keep_workers_away();
        pthread_mutex_lock(&pool.lock);
        atomic_store(&pool.generation, generation);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    else { /* no worker is woken; one that wakes finds every share claimed */
        atomic_store(&pool.generation, generation);
    }
    run_share(0);
    int by_workers = threads - 1;
    for (int t = 1; t < threads; t++) {
        if (claim(t, generation)) {
            run_share(t);
            by_workers--;
        }
    }
    while (atomic_load(&pool.done) < by_workers) {
        pause_cpu();
    }
    return atomic_load(&pool.failed) ? -1 : threads;
}

/* A requested thread count within [1, MAX_THREADS]. */
static inline int pool_threads(int threads)
{
    return threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
}

/* run_task while holding the pool (one task at a time); call it without the GIL. */
static int pool_run(int (*share)(const void *, int, int), const void *arg, int threads)
{
    pthread_mutex_lock(&pool.busy);
    const int used = run_task(share, arg, pool_threads(threads));
    pthread_mutex_unlock(&pool.busy);
    return used;
}

/* A child of fork() has none of the parent's workers: it starts its own. */
static void forget_workers(void)
{
    pool.away_from = -1;
    pthread_mutex_init(&pool.busy, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.started = 0;
}

static void register_pool_fork_handler(void)
{
    static int registered = 0;
    if (!registered && pthread_atfork(NULL, NULL, forget_workers) == 0) {
        registered = 1;
    }
}


/* ---------------------------------------------------- Python (Python.h included first) */

/* The extension module `name` (docstring `doc`) of the functions in `methods`, for its
 * PyInit function: one per extension, created once, with the pool's fork handler registered. */
static PyObject *pool_module(const char *name, const char *doc, PyMethodDef *methods)
{
    static struct PyModuleDef def;
    def = (struct PyModuleDef){
        PyModuleDef_HEAD_INIT, .m_name = name, .m_doc = doc, .m_size = -1, .m_methods = methods,
    };
    register_pool_fork_handler();
    return PyModule_Create(&def);
}

/* Elementwise kernels: kernel(args, begin, end) computes elements [begin, end) of n, each on its
 * own (an optimizer update, a mask, ...). */

/* Below this many elements the GIL is kept: releasing it costs more than the loop. */
#define RELEASE_GIL_MIN 4096
/* Below this many elements one thread computes them all: waking a worker costs more. */
#define PER_THREAD_MIN (1 << 16)

/* One elementwise kernel over [0, n), shared by the pool's threads in 16-element-aligned
 * ranges. */
struct split {
    void (*kernel)(const void *args, Py_ssize_t begin, Py_ssize_t end);
    const void *args;
    Py_ssize_t n;
};

static int split_share(const void *arg, int t, int threads)
{
    const struct split *s = arg;
    const Py_ssize_t begin = s->n * t / threads & ~(Py_ssize_t)15;
    const Py_ssize_t end = t == threads - 1 ? s->n : s->n * (t + 1) / threads & ~(Py_ssize_t)15;
    if (end > begin) {
        s->kernel(s->args, begin, end);
    }
    return 0;
}

/* Run kernel over n elements, without the GIL where n is large, on up to threads threads from
 * per_thread_min elements on (fewer where each element costs more: a Sigmoid, a Tanh). */
static void run_elementwise_from(void (*kernel)(const void *, Py_ssize_t, Py_ssize_t),
                                 const void *args, Py_ssize_t n, int threads,
                                 Py_ssize_t per_thread_min)
{
    if (n < RELEASE_GIL_MIN) {
        kernel(args, 0, n);
        return;
    }
    const struct split s = {kernel, args, n};
    Py_BEGIN_ALLOW_THREADS
    if (n < per_thread_min || threads <= 1) {
        kernel(args, 0, n);
    }
    else {
        pool_run(split_share, &s, threads);
    }
    Py_END_ALLOW_THREADS
}

/* run_elementwise_from with the threads from PER_THREAD_MIN elements on. */
static void run_elementwise(void (*kernel)(const void *, Py_ssize_t, Py_ssize_t),
                            const void *args, Py_ssize_t n, int threads)
{
    run_elementwise_from(kernel, args, n, threads, PER_THREAD_MIN);
}

#endif
