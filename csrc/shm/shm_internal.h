/* shm_internal.h: the segment layout and the sync primitives shared by shm_seg.c and shm_coll.c.
 * Not for: anything outside csrc/shm/ (the public API is shm.h).
 *
 * Layout (offsets from the mapping base; every part 4 KiB aligned):
 *   0                 shm_hdr (magic, sizes, attach count, abort flag + message)
 *   4096              shm_slot[nranks], 256 bytes each: phase word (futex), sleeper count, pid,
 *                     two op descriptors (indexed by call number & 1)
 *   data_off + r*data_stride   rank r's data: small[0], small[1], staging[0], staging[1] */
#ifndef ACC_SHM_INTERNAL_H
#define ACC_SHM_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "shm.h"

#define SHM_MAGIC 0x31304D4843434341ULL /* "ACCCHM01" */
#define SHM_MAX_RANKS 64
#define SHM_MAX_REGIONS 32

enum { OP_ALL_REDUCE = 1, OP_REDUCE_SCATTER, OP_ALL_GATHER, OP_BROADCAST, OP_BARRIER, OP_SCATTER };

typedef struct {
    uint32_t call;     /* call number on this group (same on every rank when in step) */
    uint32_t kind;     /* OP_* */
    uint32_t dtype;    /* acc_dtype (raw-byte ops: ACC_U8) */
    uint32_t redop;    /* acc_redop, or root for broadcast / scatter */
    uint64_t count;    /* elements (all_reduce/reduce_scatter) or bytes */
    uint64_t zoff;     /* offset inside the rank's region part for zero-copy, UINT64_MAX otherwise */
    uint32_t zreg;     /* scatter: index of the root's region that zoff refers to (peers read it there) */
    uint32_t spare;
} shm_desc;

typedef struct {
    _Atomic uint32_t phase; /* arrivals so far; the futex word peers wait on */
    char pad0[60];
    _Atomic uint32_t sleepers; /* peers blocked in FUTEX_WAIT on `phase` (wake only when > 0) */
    _Atomic int32_t pid;
    char pad1[56];
    shm_desc desc[2];
    char pad2[256 - 128 - 2 * sizeof(shm_desc)];
} shm_slot;

typedef struct {
    _Atomic uint64_t magic; /* written last by the creator */
    uint32_t version, nranks;
    uint64_t total_bytes, small_bytes, chunk_bytes, data_off, data_stride;
    _Atomic uint32_t attached;
    _Atomic uint32_t abort_flag;
    int32_t abort_rank;
    char abort_msg[400];
} shm_hdr;

typedef struct {
    char *base; /* start of part 0 in this process */
    size_t part_bytes;
} shm_region;

#define SHM_ASYNC_SLOTS 1024

/* A queued collective: kind is an acc_shm_async_kind; `in` == `out` for the in-place all-reduce; count is in
 * elements of dtype (all_gather: bytes of one rank's input, dtype ACC_U8). */
typedef struct {
    int kind;
    const void *in;
    void *out;
    size_t count;
    acc_dtype dtype;
    acc_redop op;
} shm_async_req;

/* The async collective queue (shm_async.c): one worker thread per group runs requests in FIFO order.
 * Tickets are 1-based sequence numbers; done counts finished requests. */
typedef struct {
    int started, stop;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv_req, cv_done;
    shm_async_req ring[SHM_ASYNC_SLOTS];
    uint64_t submitted, done;
    acc_status err; /* first failure; every later request fails with it too */
    char errmsg[512];
} shm_async;

struct acc_shm_group {
    char name[208];
    int rank, nranks, created, all_attached;
    int owner_pid; /* process that opened it: a fork()ed child must not join the parent's worker thread */
    char *map;
    size_t map_bytes;
    shm_hdr *hdr;
    shm_slot *slots;
    size_t small_bytes, chunk_bytes;
    double timeout_s;
    long spin_ns;       /* spin budget at the first arrival of a call (the peer may still be computing) */
    long inner_spin_ns; /* spin budget between the phases of one call (the peer is mid-collective) */
    uint32_t phase;   /* this rank's arrivals (mirror of slots[rank].phase) */
    uint32_t ncalls;  /* collectives issued */
    uint32_t nstage;  /* staged chunks issued (picks staging[nstage & 1]) */
    int broken;
    shm_region regions[SHM_MAX_REGIONS];
    int nregions;
    shm_async async;
};

static inline char *shm_small(acc_shm_group *g, int r, uint32_t call) {
    return g->map + g->hdr->data_off + (size_t)r * g->hdr->data_stride + (call & 1u) * g->small_bytes;
}
static inline char *shm_staging(acc_shm_group *g, int r, uint32_t k) {
    return g->map + g->hdr->data_off + (size_t)r * g->hdr->data_stride + 2 * g->small_bytes + (k & 1u) * g->chunk_bytes;
}

/* Increments this rank's phase (release) and wakes sleeping peers. */
void shm_arrive(acc_shm_group *g);
/* Waits until every peer's phase reached this rank's phase, spinning (then yield-spinning) for up to
 * spin_ns before sleeping on the futex. On timeout / dead peer / abort sets the error text (naming
 * `opname` and the missing ranks), poisons the group and returns the status. */
acc_status shm_wait_all(acc_shm_group *g, const char *opname, long spin_ns);
/* Marks the group unusable for every rank, with a message peers will report. */
void shm_abort(acc_shm_group *g, const char *msg);
/* 1 when process `pid` is gone (or a zombie); 0 for pid <= 0 or when it cannot tell. */
int shm_pid_dead(int32_t pid);

#endif
