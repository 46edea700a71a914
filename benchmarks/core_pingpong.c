/* Round-trip latency of one cache line bounced between two threads pinned to cores 0 and 1.
 *
 * On a virtual machine this shows where the host has placed the two virtual CPUs: tens of
 * nanoseconds when they share a cache, hundreds when they do not. Every onnxruntime kernel
 * split between two threads pays this cost (benchmarks/RESULTS.md, the machine's phases).
 *
 *     gcc -O2 -pthread benchmarks/core_pingpong.c -o /tmp/core_pingpong && /tmp/core_pingpong
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>

enum { ROUNDS = 200000 };
static _Atomic int flag __attribute__((aligned(64)));

static void pin(int core) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(core, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *answer(void *unused) {
    (void)unused;
    pin(1);
    for (int i = 0; i < ROUNDS; i++) {
        while (atomic_load(&flag) != 1) {
        }
        atomic_store(&flag, 0);
    }
    return NULL;
}

int main(void) {
    pthread_t thread;
    struct timespec start, end;
    pin(0);
    pthread_create(&thread, NULL, answer, NULL);
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (int i = 0; i < ROUNDS; i++) {
        atomic_store(&flag, 1);
        while (atomic_load(&flag) != 0) {
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &end);
    pthread_join(thread, NULL);
    double ns = (end.tv_sec - start.tv_sec) * 1e9 + (end.tv_nsec - start.tv_nsec);
    printf("round trip %.0f ns\n", ns / ROUNDS);
    return 0;
}
