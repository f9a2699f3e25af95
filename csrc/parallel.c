/* parallel.c: implementation of acc_parallel_for (see parallel.h): on the OpenMP runtime torch has loaded when the
 * caller is the process's main thread, else on threads created for the call. Not for: the kernels' splitting rules
 * (each caller's min_per_thread) or anything that waits on other processes. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "acc.h"
#include "options.h"
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

/* libgomp's entry points, found in the libgomp.so.1 the process has already loaded (torch's; never loaded by us):
 * GOMP_parallel is the call GCC emits for `#pragma omp parallel`, so the same pool threads that run torch's ops
 * run our chunks. Why: after a parallel region, libgomp's idle threads spin (GOMP_SPINCOUNT) before they sleep, so
 * threads of our own started right after a torch op share the cores with spinning ones (2 cores: a 128 MB pack ran
 * 1.6x slower on 2 threads than torch's copies, as fast with OMP_WAIT_POLICY=PASSIVE); the pool also saves the
 * thread creation (~30-50 us a call). Only the main thread uses it (libgomp keeps one pool per thread that starts
 * regions: a helper thread of ours would create a second, spinning pool), never inside an OpenMP region, and never
 * in a process forked after _C loaded (acc_parallel_init records the loading process: a forked child inherits
 * libgomp's pool without its threads, and a region there may wait for them forever, as torch's own ops do in such a
 * child unless it sets one thread, which makes our calls single-threaded too). */
typedef struct {
    void (*parallel)(void (*)(void *), void *, unsigned, unsigned);
    int (*thread_num)(void), (*num_threads)(void), (*in_parallel)(void);
} gomp_api;
static gomp_api gomp;
static atomic_int gomp_found; /* 1: `gomp` is filled; -1: a libgomp.so.1 without these entry points (never again);
                               * 0: not found yet (a call before torch loaded libgomp finds nothing: retried) */
static pid_t load_pid;        /* the process _C loaded in (acc_parallel_init) */
static pthread_mutex_t gomp_lock = PTHREAD_MUTEX_INITIALIZER;

static int gomp_find(void) {
    int state = atomic_load_explicit(&gomp_found, memory_order_acquire);
    if (state) return state > 0;
    pthread_mutex_lock(&gomp_lock);
    void *h = atomic_load_explicit(&gomp_found, memory_order_relaxed) ? NULL
                                                                       : dlopen("libgomp.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (h) {
        gomp_api g;
        *(void **)&g.parallel = dlsym(h, "GOMP_parallel");
        *(void **)&g.thread_num = dlsym(h, "omp_get_thread_num");
        *(void **)&g.num_threads = dlsym(h, "omp_get_num_threads");
        *(void **)&g.in_parallel = dlsym(h, "omp_in_parallel");
        if (g.parallel && g.thread_num && g.num_threads && g.in_parallel) { /* h stays open: it was loaded anyway */
            gomp = g;
            atomic_store_explicit(&gomp_found, 1, memory_order_release);
        } else {
            dlclose(h);
            atomic_store_explicit(&gomp_found, -1, memory_order_release);
        }
    }
    pthread_mutex_unlock(&gomp_lock);
    return atomic_load_explicit(&gomp_found, memory_order_acquire) > 0;
}

static int gomp_usable(void) {
    if (!acc_options_openmp_pool()) return 0;
    pid_t pid = getpid();
    return pid == load_pid && (pid_t)syscall(SYS_gettid) == pid && gomp_find() && !gomp.in_parallel();
}

void acc_parallel_init(void) { load_pid = getpid(); }

int acc_parallel_backend(void) { return gomp_usable(); }

typedef struct {
    acc_job *jobs;
    int used;
} team_ctx;

static void team_run(void *arg) { /* a team smaller than asked for still runs every chunk */
    const team_ctx *t = (const team_ctx *)arg;
    int me = gomp.thread_num(), size = gomp.num_threads();
    for (int k = me; k < t->used; k += size > 0 ? size : 1) run_job(&t->jobs[k]);
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
    if (used > 1 && gomp_usable()) {
        team_ctx team = {jobs, used};
        gomp.parallel(team_run, &team, (unsigned)used, 0);
        int rc = 0;
        for (int t = 0; t < used && !rc; t++) rc = jobs[t].rc;
        return rc;
    }
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
