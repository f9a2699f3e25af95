/* shm_async.c: the async collective queue of a shm group: one worker pthread per group, started on the first
 * submit, runs queued all-reduces, reduce-scatters and all-gathers in FIFO order, so the caller (a DDP backward
 * hook, a tensor-parallel layer's backward) returns at once and communication overlaps its compute. No GIL is involved: the worker only touches raw
 * pointers the caller keeps alive until it waited on the ticket.
 * Not for: ordering between several submitting threads (one submitter per group) or the collectives
 * themselves (shm_coll.c). */
#include <stdio.h>
#include <string.h>

#include "shm_internal.h"

static acc_status run_req(acc_shm_group *g, const shm_async_req *r) {
    switch (r->kind) {
    case ACC_ASYNC_REDUCE_SCATTER: return acc_shm_reduce_scatter(g, r->in, r->out, r->count, r->dtype, r->op);
    case ACC_ASYNC_ALL_GATHER: return acc_shm_all_gather(g, r->in, r->out, r->count);
    default: return acc_shm_all_reduce_out(g, r->in, r->out, r->count, r->dtype, r->op);
    }
}

static void *worker(void *arg) {
    acc_shm_group *g = (acc_shm_group *)arg;
    shm_async *a = &g->async;
    pthread_mutex_lock(&a->mu);
    for (;;) {
        while (!a->stop && a->done == a->submitted) pthread_cond_wait(&a->cv_req, &a->mu);
        if (a->done == a->submitted) break; /* stop requested and nothing left */
        shm_async_req r = a->ring[a->done % SHM_ASYNC_SLOTS];
        acc_status prev = a->err;
        pthread_mutex_unlock(&a->mu);
        acc_status st = prev ? prev : run_req(g, &r);
        pthread_mutex_lock(&a->mu);
        if (st && !a->err) {
            a->err = st;
            snprintf(a->errmsg, sizeof a->errmsg, "%s", acc_last_error());
        }
        a->done++;
        pthread_cond_broadcast(&a->cv_done);
    }
    pthread_mutex_unlock(&a->mu);
    return NULL;
}

acc_status acc_shm_async_submit_op(acc_shm_group *g, acc_shm_async_kind kind, const void *in, void *out, size_t count,
                                   acc_dtype dtype, acc_redop op, uint64_t *ticket) {
    shm_async *a = &g->async;
    static const char *names[] = {"all_reduce_async", "reduce_scatter_async", "all_gather_async"};
    if (kind < ACC_ASYNC_ALL_REDUCE || kind > ACC_ASYNC_ALL_GATHER) {
        acc_set_error("shm async: unknown collective kind %d", (int)kind);
        return ACC_ERR_ARG;
    }
    if (kind != ACC_ASYNC_ALL_GATHER && !acc_reduce_supported(dtype, op)) {
        acc_set_error("shm %s: op %d is not supported for dtype %s", names[kind], (int)op, acc_dtype_name(dtype));
        return ACC_ERR_DTYPE;
    }
    if (!a->started) {
        pthread_mutex_init(&a->mu, NULL);
        pthread_cond_init(&a->cv_req, NULL);
        pthread_cond_init(&a->cv_done, NULL);
        if (pthread_create(&a->thread, NULL, worker, g) != 0) {
            acc_set_error("shm %s: cannot start the worker thread", names[kind]);
            return ACC_ERR_OS;
        }
        a->started = 1;
    }
    pthread_mutex_lock(&a->mu);
    while (a->submitted - a->done >= SHM_ASYNC_SLOTS) pthread_cond_wait(&a->cv_done, &a->mu);
    a->ring[a->submitted % SHM_ASYNC_SLOTS] = (shm_async_req){(int)kind, in, out, count, dtype, op};
    *ticket = ++a->submitted;
    pthread_cond_signal(&a->cv_req);
    pthread_mutex_unlock(&a->mu);
    return ACC_OK;
}

acc_status acc_shm_async_submit(acc_shm_group *g, void *data, size_t count, acc_dtype dtype, acc_redop op,
                                uint64_t *ticket) {
    return acc_shm_async_submit_op(g, ACC_ASYNC_ALL_REDUCE, data, data, count, dtype, op, ticket);
}

acc_status acc_shm_async_wait(acc_shm_group *g, uint64_t ticket) {
    shm_async *a = &g->async;
    if (!a->started) return ACC_OK;
    pthread_mutex_lock(&a->mu);
    while (a->done < ticket) pthread_cond_wait(&a->cv_done, &a->mu);
    acc_status st = a->err;
    if (st) acc_set_error("%s", a->errmsg);
    pthread_mutex_unlock(&a->mu);
    return st;
}

int acc_shm_async_done(acc_shm_group *g, uint64_t ticket) {
    shm_async *a = &g->async;
    if (!a->started) return 1;
    pthread_mutex_lock(&a->mu);
    int d = a->done >= ticket;
    pthread_mutex_unlock(&a->mu);
    return d;
}

acc_status acc_shm_async_drain(acc_shm_group *g) {
    shm_async *a = &g->async;
    if (!a->started) return ACC_OK;
    pthread_mutex_lock(&a->mu);
    uint64_t t = a->submitted;
    pthread_mutex_unlock(&a->mu);
    return acc_shm_async_wait(g, t);
}

void acc_shm_async_stop(acc_shm_group *g) {
    shm_async *a = &g->async;
    if (!a->started) return;
    pthread_mutex_lock(&a->mu);
    a->stop = 1;
    pthread_cond_signal(&a->cv_req);
    pthread_mutex_unlock(&a->mu);
    pthread_join(a->thread, NULL);
    pthread_mutex_destroy(&a->mu);
    pthread_cond_destroy(&a->cv_req);
    pthread_cond_destroy(&a->cv_done);
    a->started = 0;
}
