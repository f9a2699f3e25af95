/* shm_p2p.c: the point-to-point rings of p2p.h and their progress thread.
 * Not for: collectives (shm_coll.c), the group's segment life cycle (shm_seg.c).
 *
 * Ring memory (in the receiver's part, 64-byte aligned): a control block (tail: chunks published, written by the
 * producer; head: chunks consumed, written by the consumer; each on its own cache line), then nslots slots of
 * [64-byte header: tag, message bytes, offset, length][slot_bytes of data]. The producer writes a slot while
 * tail - head < nslots, then stores tail + 1 (release); the consumer reads a slot while head < tail (acquire), then
 * stores head + 1 (release). A message of n bytes is max(1, ceil(n / slot_bytes)) chunks.
 *
 * The progress thread loops: read its doorbell, advance the head request of every ring as far as the ring allows,
 * complete finished requests; when nothing moved, spin for the group's spin budget watching the doorbell, then
 * sleep on it (FUTEX_WAIT, 50 ms slices, checking the group's abort flag, the deadline and the peers' pids). Reading
 * the doorbell before looking at the rings means a wake-up between the look and the sleep is never lost. */
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "p2p.h"
#include "shm_internal.h"

#define MAXREQ 4096 /* requests in flight per process (a ticket's slot is ticket % MAXREQ) */
#define RINGQ 1024  /* requests queued per ring */

typedef struct {
    _Atomic uint64_t tail;
    char pad0[56];
    _Atomic uint64_t head;
    char pad1[56];
} ring_ctl;

typedef struct {
    uint64_t tag, msg_bytes, off, len;
    char pad[32];
} slot_hdr;

typedef struct {
    _Atomic uint32_t bell;
    _Atomic uint32_t sleepers;
} bell_blk;

typedef struct {
    int ring, send, finished;
    acc_status st;
    char *data;
    size_t nbytes, done, chunks, nchunks;
    uint64_t tag, ticket;
} p2p_req;

typedef struct {
    ring_ctl *ctl;
    char *slots;
    int src, dst;
    uint64_t q[RINGQ]; /* tickets, FIFO */
    unsigned qh, qt;
} p2p_ring;

struct acc_p2p {
    acc_shm_group *g;
    char *base;
    size_t part_bytes, slot_bytes, slot_stride;
    uint32_t nslots;
    int me, nranks, nrings;
    p2p_ring *rings;
    pthread_t thread;
    int started, stop;
    pthread_mutex_t mu;
    pthread_cond_t cv_done;
    p2p_req reqs[MAXREQ];
    uint64_t next; /* tickets are 1-based */
    acc_status err;
    char errmsg[512];
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static bell_blk *bell_of(acc_p2p *p, int r) { return (bell_blk *)(p->base + (size_t)r * p->part_bytes); }

static void ring_bell(acc_p2p *p, int r) {
    bell_blk *b = bell_of(p, r);
    atomic_fetch_add(&b->bell, 1u);
    if (atomic_load(&b->sleepers) > 0) syscall(SYS_futex, &b->bell, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

size_t acc_p2p_ring_bytes(uint32_t nslots, size_t slot_bytes) {
    return sizeof(ring_ctl) + (size_t)nslots * (sizeof(slot_hdr) + slot_bytes);
}

/* Moves as many chunks of `r`'s head request as the ring allows; returns chunks moved, or -1 on a mismatch (the
 * error text in p->errmsg). */
static int advance(acc_p2p *p, p2p_ring *ring, p2p_req *r) {
    int moved = 0;
    while (r->chunks < r->nchunks) {
        if (r->send) {
            uint64_t tail = atomic_load_explicit(&ring->ctl->tail, memory_order_relaxed);
            if (tail - atomic_load_explicit(&ring->ctl->head, memory_order_acquire) >= p->nslots) break;
            char *s = ring->slots + (size_t)(tail % p->nslots) * p->slot_stride;
            slot_hdr *h = (slot_hdr *)s;
            size_t len = r->nbytes - r->done < p->slot_bytes ? r->nbytes - r->done : p->slot_bytes;
            h->tag = r->tag, h->msg_bytes = r->nbytes, h->off = r->done, h->len = len;
            if (len) memcpy(s + sizeof(slot_hdr), r->data + r->done, len);
            atomic_store_explicit(&ring->ctl->tail, tail + 1, memory_order_release);
            ring_bell(p, ring->dst);
            r->done += len;
        } else {
            uint64_t head = atomic_load_explicit(&ring->ctl->head, memory_order_relaxed);
            if (head >= atomic_load_explicit(&ring->ctl->tail, memory_order_acquire)) break;
            char *s = ring->slots + (size_t)(head % p->nslots) * p->slot_stride;
            const slot_hdr *h = (const slot_hdr *)s;
            if (h->tag != r->tag || h->msg_bytes != r->nbytes || h->off != r->done) {
                snprintf(p->errmsg, sizeof p->errmsg, "shm p2p: rank %d expected message tag %llu of %zu bytes "
                         "(offset %zu) from rank %d but got tag %llu of %llu bytes (offset %llu): the two ranks "
                         "disagree on the order or the shape of what they exchange", p->me,
                         (unsigned long long)r->tag, r->nbytes, r->done, ring->src, (unsigned long long)h->tag,
                         (unsigned long long)h->msg_bytes, (unsigned long long)h->off);
                return -1;
            }
            if (h->len) memcpy(r->data + r->done, s + sizeof(slot_hdr), h->len);
            r->done += h->len;
            atomic_store_explicit(&ring->ctl->head, head + 1, memory_order_release);
            ring_bell(p, ring->src);
        }
        r->chunks++;
        moved++;
    }
    return moved;
}

/* Fails every unfinished request with st / msg (the first error wins). Called with the lock held. */
static void fail_all(acc_p2p *p, acc_status st, const char *msg) {
    if (!p->err) {
        p->err = st;
        snprintf(p->errmsg, sizeof p->errmsg, "%s", msg);
    }
    for (int i = 0; i < p->nrings; i++) {
        p2p_ring *ring = &p->rings[i];
        for (; ring->qh != ring->qt; ring->qh++) {
            p2p_req *r = &p->reqs[ring->q[ring->qh % RINGQ] % MAXREQ];
            r->finished = 1, r->st = p->err;
        }
    }
    pthread_cond_broadcast(&p->cv_done);
}

/* One pass over the rings (lock held on entry and exit; released around the copies). Returns chunks moved. */
static int pass(acc_p2p *p) {
    int moved = 0;
    for (int i = 0; i < p->nrings && !p->err; i++) {
        p2p_ring *ring = &p->rings[i];
        while (ring->qh != ring->qt) {
            p2p_req *r = &p->reqs[ring->q[ring->qh % RINGQ] % MAXREQ];
            pthread_mutex_unlock(&p->mu);
            int n = advance(p, ring, r);
            pthread_mutex_lock(&p->mu);
            if (n < 0) {
                char msg[512];
                snprintf(msg, sizeof msg, "%s", p->errmsg);
                shm_abort(p->g, msg);
                fail_all(p, ACC_ERR_PEER, msg);
                return moved;
            }
            moved += n;
            if (r->chunks < r->nchunks) break;
            r->finished = 1, r->st = ACC_OK;
            ring->qh++;
            pthread_cond_broadcast(&p->cv_done);
        }
    }
    return moved;
}

/* Why the pending requests cannot go on (abort flag, a dead peer, the deadline), or 0. Lock held. */
static acc_status check_stuck(acc_p2p *p, double idle_s, char *msg, size_t cap) {
    acc_shm_group *g = p->g;
    if (atomic_load(&g->hdr->abort_flag)) {
        for (int i = 0; i < 1000 && atomic_load(&g->hdr->abort_flag) != 2u; i++) sched_yield();
        snprintf(msg, cap, "shm p2p aborted on rank %d: rank %d reported: %s", p->me, g->hdr->abort_rank,
                 g->hdr->abort_msg);
        return ACC_ERR_PEER;
    }
    for (int i = 0; i < p->nrings; i++) {
        p2p_ring *ring = &p->rings[i];
        if (ring->qh == ring->qt) continue;
        const p2p_req *r = &p->reqs[ring->q[ring->qh % RINGQ] % MAXREQ];
        int peer = r->send ? ring->dst : ring->src;
        int32_t pid = atomic_load(&g->slots[peer].pid);
        if (shm_pid_dead(pid)) {
            snprintf(msg, cap, "shm p2p %s of tag %llu on rank %d: peer rank %d (pid %d) died", r->send ? "send" : "recv",
                     (unsigned long long)r->tag, p->me, peer, (int)pid);
            return ACC_ERR_PEER;
        }
        if (idle_s > g->timeout_s) {
            snprintf(msg, cap, "shm p2p %s of tag %llu (%zu bytes) on rank %d: timed out after %.1f s waiting for "
                     "rank %d", r->send ? "send" : "recv", (unsigned long long)r->tag, r->nbytes, p->me, g->timeout_s,
                     peer);
            return ACC_ERR_TIMEOUT;
        }
    }
    return ACC_OK;
}

static int pending(const acc_p2p *p) {
    for (int i = 0; i < p->nrings; i++)
        if (p->rings[i].qh != p->rings[i].qt) return 1;
    return 0;
}

static void *progress(void *arg) {
    acc_p2p *p = arg;
    bell_blk *mine = bell_of(p, p->me);
    double last_move = now_s(), next_check = last_move + 0.1;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        uint32_t seen = atomic_load(&mine->bell);
        int moved = pass(p);
        int busy = pending(p);
        if (p->stop && !busy) break;
        if (p->stop) { /* closing with requests left: they cannot finish */
            fail_all(p, ACC_ERR_STATE, "shm p2p: closed with requests pending");
            break;
        }
        double t = now_s();
        if (moved || !busy) last_move = t;
        if (moved) continue;
        if (busy && t >= next_check) {
            next_check = t + 0.1;
            char msg[512];
            acc_status st = check_stuck(p, t - last_move, msg, sizeof msg);
            if (st) {
                if (st != ACC_ERR_PEER || !atomic_load(&p->g->hdr->abort_flag)) shm_abort(p->g, msg);
                fail_all(p, st, msg);
                continue;
            }
        }
        pthread_mutex_unlock(&p->mu);
        /* spin (the peer may be mid-copy), then sleep on the doorbell */
        long spin_ns = p->g->spin_ns;
        double spin_end = now_s() + 1e-9 * (double)spin_ns;
        while (atomic_load(&mine->bell) == seen && now_s() < spin_end) sched_yield();
        if (atomic_load(&mine->bell) == seen) {
            atomic_fetch_add(&mine->sleepers, 1);
            struct timespec ts = {0, 50 * 1000 * 1000};
            if (atomic_load(&mine->bell) == seen)
                syscall(SYS_futex, &mine->bell, FUTEX_WAIT, seen, &ts, NULL, 0);
            atomic_fetch_sub(&mine->sleepers, 1);
        }
        pthread_mutex_lock(&p->mu);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

acc_status acc_p2p_open(acc_shm_group *g, char *base, size_t part_bytes, int nrings, const int32_t *src,
                        const int32_t *dst, const uint64_t *off, uint32_t nslots, size_t slot_bytes, acc_p2p **out) {
    *out = NULL;
    if (nslots < 1 || slot_bytes < 64 || slot_bytes % 64 || nrings < 0) {
        acc_set_error("shm p2p: %u slots of %zu bytes (want >= 1 slot of a positive multiple of 64 bytes)", nslots,
                      slot_bytes);
        return ACC_ERR_ARG;
    }
    size_t rb = acc_p2p_ring_bytes(nslots, slot_bytes);
    for (int i = 0; i < nrings; i++) {
        if (src[i] < 0 || src[i] >= g->nranks || dst[i] < 0 || dst[i] >= g->nranks || src[i] == dst[i] ||
            off[i] < ACC_P2P_BELL_BYTES || off[i] % 64 || off[i] + rb > part_bytes) {
            acc_set_error("shm p2p: ring %d (rank %d -> %d at offset %llu, %zu bytes) does not fit a part of %zu "
                          "bytes of a group of %d", i, src[i], dst[i], (unsigned long long)off[i], rb, part_bytes,
                          g->nranks);
            return ACC_ERR_ARG;
        }
    }
    acc_p2p *p = calloc(1, sizeof *p);
    if (!p) return ACC_ERR_NOMEM;
    p->rings = calloc(nrings > 0 ? (size_t)nrings : 1, sizeof *p->rings);
    if (!p->rings) {
        free(p);
        return ACC_ERR_NOMEM;
    }
    p->g = g, p->base = base, p->part_bytes = part_bytes, p->nslots = nslots, p->slot_bytes = slot_bytes;
    p->slot_stride = sizeof(slot_hdr) + slot_bytes;
    p->me = g->rank, p->nranks = g->nranks, p->nrings = nrings;
    for (int i = 0; i < nrings; i++) {
        p->rings[i].ctl = (ring_ctl *)(base + (size_t)dst[i] * part_bytes + off[i]);
        p->rings[i].slots = (char *)p->rings[i].ctl + sizeof(ring_ctl);
        p->rings[i].src = src[i], p->rings[i].dst = dst[i];
    }
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv_done, NULL);
    *out = p;
    return ACC_OK;
}

acc_status acc_p2p_post(acc_p2p *p, int ring, int send, void *data, size_t nbytes, uint64_t tag, uint64_t *ticket) {
    if (ring < 0 || ring >= p->nrings || (send ? p->rings[ring].src : p->rings[ring].dst) != p->me) {
        acc_set_error("shm p2p: rank %d cannot %s on ring %d", p->me, send ? "send" : "receive", ring);
        return ACC_ERR_ARG;
    }
    pthread_mutex_lock(&p->mu);
    if (!p->started) {
        if (pthread_create(&p->thread, NULL, progress, p) != 0) {
            pthread_mutex_unlock(&p->mu);
            acc_set_error("shm p2p: cannot start the progress thread");
            return ACC_ERR_OS;
        }
        p->started = 1;
    }
    p2p_ring *rg = &p->rings[ring];
    uint64_t t = ++p->next;
    while (!p->err && ((t > MAXREQ && !p->reqs[t % MAXREQ].finished) || rg->qt - rg->qh >= RINGQ))
        pthread_cond_wait(&p->cv_done, &p->mu);
    if (p->err) {
        acc_status st = p->err;
        acc_set_error("%s", p->errmsg);
        p->next--;
        pthread_mutex_unlock(&p->mu);
        return st;
    }
    p2p_req *r = &p->reqs[t % MAXREQ];
    *r = (p2p_req){ring, send, 0, ACC_OK, data, nbytes, 0, 0, nbytes ? (nbytes + p->slot_bytes - 1) / p->slot_bytes : 1,
                   tag, t};
    rg->q[rg->qt++ % RINGQ] = t;
    pthread_mutex_unlock(&p->mu);
    ring_bell(p, p->me);
    *ticket = t;
    return ACC_OK;
}

acc_status acc_p2p_wait(acc_p2p *p, uint64_t ticket) {
    pthread_mutex_lock(&p->mu);
    p2p_req *r = &p->reqs[ticket % MAXREQ];
    while (r->ticket == ticket && !r->finished) pthread_cond_wait(&p->cv_done, &p->mu);
    /* a slot reused by a later ticket held a finished request: its failure, if any, is the first error */
    acc_status st = r->ticket == ticket ? r->st : p->err;
    if (st) acc_set_error("%s", p->errmsg);
    pthread_mutex_unlock(&p->mu);
    return st;
}

int acc_p2p_done(acc_p2p *p, uint64_t ticket) {
    pthread_mutex_lock(&p->mu);
    int d = p->reqs[ticket % MAXREQ].ticket != ticket || p->reqs[ticket % MAXREQ].finished;
    pthread_mutex_unlock(&p->mu);
    return d;
}

void acc_p2p_abort(acc_p2p *p, const char *msg) {
    shm_abort(p->g, msg);
    for (int r = 0; r < p->nranks; r++) ring_bell(p, r);
}

void acc_p2p_close(acc_p2p *p) {
    if (!p) return;
    if (p->started && p->g->owner_pid == (int)getpid()) {
        pthread_mutex_lock(&p->mu);
        p->stop = 1;
        pthread_mutex_unlock(&p->mu);
        ring_bell(p, p->me);
        pthread_join(p->thread, NULL);
    }
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv_done);
    free(p->rings);
    free(p);
}
