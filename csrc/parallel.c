/* parallel.c: implementation of acc_parallel_for (see parallel.h). */
#include <pthread.h>

#include "acc.h"
#include "parallel.h"

typedef struct {
    acc_range_fn fn;
    void *ctx;
    size_t begin, end;
    int chunk;
    int rc;
} acc_job;

static void *run_job(void *arg) {
    acc_job *j = (acc_job *)arg;
    j->rc = j->fn(j->ctx, j->begin, j->end, j->chunk);
    return NULL;
}

int acc_parallel_for(size_t n, int nthreads, size_t min_per_thread, acc_range_fn fn, void *ctx, int *chunks_out) {
    if (nthreads < 1) nthreads = 1;
    if (nthreads > ACC_MAX_THREADS) nthreads = ACC_MAX_THREADS;
    if (min_per_thread < 1) min_per_thread = 1;
    size_t want = n / min_per_thread;
    if ((size_t)nthreads > want) nthreads = want > 0 ? (int)want : 1;
    if (chunks_out) *chunks_out = nthreads;
    if (nthreads == 1) return fn(ctx, 0, n, 0);

    acc_job jobs[ACC_MAX_THREADS];
    pthread_t tids[ACC_MAX_THREADS];
    int started[ACC_MAX_THREADS] = {0};
    /* chunk boundaries rounded to 16 elements (64 B for fp32) so vector loops see aligned splits */
    size_t per = (n + (size_t)nthreads - 1) / (size_t)nthreads;
    per = (per + 15) & ~(size_t)15;
    jobs[0] = (acc_job){fn, ctx, 0, n, 0, 0};
    int used = 1;
    for (int t = 0; t < nthreads; t++) {
        size_t b = (size_t)t * per, e = b + per;
        if (b >= n) break;
        if (e > n) e = n;
        jobs[t] = (acc_job){fn, ctx, b, e, t, 0};
        used = t + 1;
    }
    if (chunks_out) *chunks_out = used;
    for (int t = 1; t < used; t++)
        started[t] = pthread_create(&tids[t], NULL, run_job, &jobs[t]) == 0;
    for (int t = 1; t < used; t++)
        if (!started[t]) run_job(&jobs[t]); /* could not spawn: run inline, same result */
    run_job(&jobs[0]);
    int rc = jobs[0].rc;
    for (int t = 1; t < used; t++) {
        if (started[t]) pthread_join(tids[t], NULL);
        if (!rc) rc = jobs[t].rc;
    }
    return rc;
}
