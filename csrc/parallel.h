/* parallel.h: a tiny parallel-for for streaming kernels (casts, optimizer steps).
 * The caller passes the thread count (Python passes torch.get_num_threads(), so we use the cores torch
 * is allowed to use). Work is split into contiguous, ACC_ALIGN-aligned chunks, so every thread count
 * gives the same bits for element-wise kernels. Not for: reductions whose result depends on the split
 * (those combine per-chunk partials in a fixed order themselves). Chunks run on the OpenMP pool torch loaded
 * when the caller is the main thread (options.h openmp_pool, parallel.c says why), else on threads created per
 * call; calls below `min_per_thread * 2` elements run inline on the caller's thread. */
#ifndef ACC_PARALLEL_H
#define ACC_PARALLEL_H

#include <stddef.h>

/* fn(ctx, begin, end, chunk_index): process elements [begin, end). Returns 0 or an acc_status. */
typedef int (*acc_range_fn)(void *ctx, size_t begin, size_t end, int chunk);

/* Runs fn over [0, n) on up to nthreads threads (nthreads <= 0: 1). Returns the first non-zero
 * status any chunk returned. `chunks_out` (may be NULL) receives the number of chunks used, which is
 * also the number of distinct `chunk` indices passed to fn (0 .. chunks-1). */
int acc_parallel_for(size_t n, int nthreads, size_t min_per_thread, acc_range_fn fn, void *ctx, int *chunks_out);

/* Records this process as the one that may use the OpenMP runtime torch loaded (parallel.c); the module calls it as
 * it loads, so that a process forked later never does. */
void acc_parallel_init(void);

/* 1 when a call from this thread now would run on the OpenMP pool, 0 when on threads of its own (tests, reports) */
int acc_parallel_backend(void);

#define ACC_MAX_THREADS 64

#endif
