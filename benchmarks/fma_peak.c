/* The float32 multiply-add peak of this machine's vector units: 12 independent chains of
 * AVX-512 fused multiply-adds per thread (enough to cover the instruction's latency on two
 * pipes), on 1 and 2 threads. A bound no kernel's arithmetic passes: the GFLOP/s figures of
 * benchmarks/RESULTS.md compare with it and with numpy's sgemm.
 *
 *     gcc -O2 -mavx512f -mfma -pthread benchmarks/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <time.h>

enum { CHAINS = 12, ROUNDS = 200000000 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *chains(void *result) {
    __m512 a[CHAINS];
    const __m512 b = _mm512_set1_ps(1.0000001f), c = _mm512_set1_ps(1e-7f);
    for (int i = 0; i < CHAINS; i++) {
        a[i] = _mm512_set1_ps((float)i);
    }
    for (long k = 0; k < ROUNDS; k++) {
#pragma GCC unroll 12
        for (int i = 0; i < CHAINS; i++) {
            a[i] = _mm512_fmadd_ps(a[i], b, c);
        }
    }
    float sum = 0.0f;
    for (int i = 0; i < CHAINS; i++) {
        sum += _mm512_reduce_add_ps(a[i]);
    }
    *(float *)result = sum; /* keeps the chains */
    return NULL;
}

int main(void) {
    for (int threads = 1; threads <= 2; threads++) {
        pthread_t ids[2];
        float results[2];
        const double start = now();
        for (int t = 0; t < threads; t++) {
            pthread_create(&ids[t], NULL, chains, &results[t]);
        }
        for (int t = 0; t < threads; t++) {
            pthread_join(ids[t], NULL);
        }
        const double flops = (double)threads * ROUNDS * CHAINS * 16 * 2;
        printf("%d thread%s: %.1f GFLOP/s\n", threads, threads > 1 ? "s" : "",
               flops / (now() - start) / 1e9);
    }
    return 0;
}
