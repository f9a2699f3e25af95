/* shm_async.c: the async all-reduce queue of a shm group: one worker pthread per group, started on the first
 * submit, runs queued in-place all-reduces in FIFO order, so the caller (a DDP backward hook) returns at
 * once and communication overlaps the rest of backward. No GIL is involved: the worker only touches raw
 * pointers the caller keeps alive until it waited on the ticket.
 * Not for: ordering between several submitting threads (one submitter per group) or the collectives
 * themselves (shm_coll.c). */
#include <stdio.h>
#include <string.h>

#include "shm_internal.h"

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
        acc_status st = prev ? prev : acc_shm_all_reduce(g, r.data, r.count, r.dtype, r.op);
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

acc_status acc_shm_async_submit(acc_shm_group *g, void *data, size_t count, acc_dtype dtype, acc_redop op,
                                uint64_t *ticket) {
    shm_async *a = &g->async;
    if (!acc_reduce_supported(dtype, op)) {
        acc_set_error("shm all_reduce_async: op %d is not supported for dtype %s", (int)op, acc_dtype_name(dtype));
        return ACC_ERR_DTYPE;
    }
    if (!a->started) {
        pthread_mutex_init(&a->mu, NULL);
        pthread_cond_init(&a->cv_req, NULL);
        pthread_cond_init(&a->cv_done, NULL);
        if (pthread_create(&a->thread, NULL, worker, g) != 0) {
            acc_set_error("shm all_reduce_async: cannot start the worker thread");
            return ACC_ERR_OS;
        }
        a->started = 1;
    }
    pthread_mutex_lock(&a->mu);
    while (a->submitted - a->done >= SHM_ASYNC_SLOTS) pthread_cond_wait(&a->cv_done, &a->mu);
    a->ring[a->submitted % SHM_ASYNC_SLOTS] = (shm_async_req){data, count, dtype, op};
    *ticket = ++a->submitted;
    pthread_cond_signal(&a->cv_req);
    pthread_mutex_unlock(&a->mu);
    return ACC_OK;
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
