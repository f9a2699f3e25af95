/* shm.h: the shared-memory transport between the ranks of one host (POSIX shm, C11 atomics, futexes).
 * Not for: Python (bind_shm.c wraps it), ranks on other hosts (torch.distributed does that), or
 * rendezvous (the Python side passes the segment name from rank 0 to the others through the store).
 *
 * One control segment per group, mapped by every local rank:
 *   [header 4 KiB][slot 0 .. slot N-1 (sync words, pid, op descriptors)][data 0 .. data N-1]
 *   data r = small[0] | small[1] (double buffer for one-phase ops) | staging (chunked copy-in path)
 * Extra "regions" (acc_shm_region_*) are separate segments of N equal parts: part r belongs to rank r
 * and is exposed to Python as rank r's writable buffer (zero-copy collectives, DDP buckets).
 *
 * Ordering rule: every rank issues the same collectives in the same order with the same sizes/dtypes
 * (checked: each rank writes a descriptor, every rank compares them at the first arrival of a call).
 * Each rank has one monotonically increasing `phase` word; an "arrival" increments it, a wait checks
 * that every peer reached the same phase. Small ops use one arrival and a double buffer (no trailing
 * barrier); large ops use one arrival per chunk (plus one for a pipelined all_reduce, plus a trailing one
 * for zero-copy ops). Every wait has a deadline and checks peer liveness. */
#ifndef ACC_SHM_H
#define ACC_SHM_H

#include <stddef.h>
#include <stdint.h>

#include "acc.h"

/* AVG divides the exact (accumulation-type) sum by N before rounding (DDP gradients); SUM_DIV rounds the sum
 * to the storage type first, then divides and rounds again: torch's `all_reduce(SUM); t /= N` bit for bit
 * (HF Accelerate's reduce(..., "mean")). Both are for floating types only. */
typedef enum { ACC_RED_SUM = 0, ACC_RED_AVG = 1, ACC_RED_MAX = 2, ACC_RED_MIN = 3, ACC_RED_SUM_DIV = 4 } acc_redop;

typedef struct acc_shm_group acc_shm_group;

/* Creates (rank 0: create=1, O_EXCL, mode 0600) or attaches (create=0) the control segment `name`
 * ("/accc-..." ; at most 200 chars). small_bytes / chunk_bytes: 0 = defaults (64 KiB / 1 MiB).
 * Attaching increments the attach count; the rank that completes it unlinks the name. */
acc_status acc_shm_group_open(const char *name, int create, int rank, int nranks, size_t small_bytes,
                              size_t chunk_bytes, double timeout_s, acc_shm_group **out);
/* Waits (up to the timeout) until all ranks attached; on timeout unlinks the name and fails. */
acc_status acc_shm_group_wait_attached(acc_shm_group *g);
/* munmap + free. Safe on NULL. Unlinks the name too if this rank created it and not all attached. */
void acc_shm_group_close(acc_shm_group *g);
int acc_shm_group_rank(const acc_shm_group *g);
int acc_shm_group_size(const acc_shm_group *g);
/* The spin budgets the group waits with (options.h's values when it was opened), in microseconds. */
void acc_shm_group_spin_us(const acc_shm_group *g, long *spin_us, long *inner_spin_us);
void acc_shm_group_set_timeout(acc_shm_group *g, double timeout_s);

/* Regions: a separate segment of nranks parts of part_bytes each, for buffers that live in shared
 * memory. create/open return an fd the caller maps (Python maps it with mmap so tensors keep it alive);
 * the caller then registers the mapping with acc_shm_region_register so collectives on tensors inside
 * it go zero-copy. */
acc_status acc_shm_region_fd(const char *name, int create, size_t total_bytes, int *fd_out);
acc_status acc_shm_unlink(const char *name);
acc_status acc_shm_region_register(acc_shm_group *g, void *base, size_t part_bytes);
void acc_shm_region_unregister(acc_shm_group *g, void *base);

/* Collectives. Pointers are this rank's; `count` is in elements of `dtype`.
 * all_reduce: in place over data[0:count). Zero-copy when data lies in a registered region (the same
 * offset in every rank's part: allocate regions collectively and identically).
 * reduce_scatter: in[0 : count*N) -> out[0 : count) = reduction of every rank's in[rank*count : +count).
 * all_gather: in[0:nbytes) of every rank -> out[0 : N*nbytes) in rank order (raw bytes).
 * broadcast: data[0:nbytes) of `root` to every rank (raw bytes).
 * scatter: in[q*nbytes : (q+1)*nbytes) of `root` -> out[0:nbytes) of rank q (raw bytes); `in` is only read,
 * and only on root (NULL elsewhere). Zero-copy when root's `in` lies in a registered region (only root's
 * placement matters: peers read root's part directly). */
acc_status acc_shm_all_reduce(acc_shm_group *g, void *data, size_t count, acc_dtype dtype, acc_redop op);
/* Out-of-place all_reduce: out[0:count) = reduction over ranks of in[0:count); `in` is only read. `out` is
 * either `in` itself (then it is acc_shm_all_reduce) or does not overlap it. Same paths as the in-place op
 * (the zero-copy one when `in` lies in a registered region: every rank then reduces the whole range from
 * the peers' parts into its own `out`), with no copy of the input and no copy-back. */
acc_status acc_shm_all_reduce_out(acc_shm_group *g, const void *in, void *out, size_t count, acc_dtype dtype,
                                  acc_redop op);
acc_status acc_shm_reduce_scatter(acc_shm_group *g, const void *in, void *out, size_t count, acc_dtype dtype,
                                  acc_redop op);
acc_status acc_shm_all_gather(acc_shm_group *g, const void *in, void *out, size_t nbytes);
acc_status acc_shm_broadcast(acc_shm_group *g, void *data, size_t nbytes, int root);
acc_status acc_shm_scatter(acc_shm_group *g, const void *in, void *out, size_t nbytes, int root);
acc_status acc_shm_barrier(acc_shm_group *g);

/* Async all-reduce (for overlapping gradient communication with backward): a worker thread per group runs
 * queued collectives in issue order without the GIL. submit returns a ticket (> 0); wait blocks
 * until that ticket finished and returns its status (after a failure, that of the first failure); done
 * tests without blocking; drain waits for everything queued. The caller keeps each buffer alive and
 * untouched until its ticket finished, and must drain before issuing a synchronous collective on the
 * same group from another thread (the bindings do this). Only one thread may submit. */
acc_status acc_shm_async_submit(acc_shm_group *g, void *data, size_t count, acc_dtype dtype, acc_redop op,
                                uint64_t *ticket);
/* The same queue for the other activation collectives (tensor parallelism overlaps them with matmuls):
 * kind ACC_ASYNC_REDUCE_SCATTER: out[0:count) = reduction of every rank's in[rank*count : +count);
 * ACC_ASYNC_ALL_GATHER: out[0 : N*count) = every rank's in[0:count) in rank order (count in bytes, dtype ACC_U8);
 * ACC_ASYNC_ALL_REDUCE: out[0:count) = reduction of in[0:count) (in == out: in place). Same rules as submit:
 * the caller keeps both buffers alive and untouched until the ticket finished. */
typedef enum { ACC_ASYNC_ALL_REDUCE = 0, ACC_ASYNC_REDUCE_SCATTER = 1, ACC_ASYNC_ALL_GATHER = 2 } acc_shm_async_kind;
acc_status acc_shm_async_submit_op(acc_shm_group *g, acc_shm_async_kind kind, const void *in, void *out, size_t count,
                                   acc_dtype dtype, acc_redop op, uint64_t *ticket);
acc_status acc_shm_async_wait(acc_shm_group *g, uint64_t ticket);
int acc_shm_async_done(acc_shm_group *g, uint64_t ticket);
acc_status acc_shm_async_drain(acc_shm_group *g);
/* Stops the worker thread (after draining); called by acc_shm_group_close. */
void acc_shm_async_stop(acc_shm_group *g);

/* Reduction kernel (shm_reduce.c): for i in [0, count): v = op(srcs[0][i], ..., srcs[nsrc-1][i])
 * (fixed source order, so every rank gets the same bits), computed in fp32 for bf16/fp16 and rounded
 * back to nearest-even; AVG divides by nsrc (floating types only), SUM_DIV rounds the sum to the storage type
 * and then divides it by nsrc (floating types only). The result is stored to every
 * dsts[k] (a dst may alias a src). Returns ACC_ERR_DTYPE for unsupported dtype/op pairs. */
acc_status acc_reduce_n(acc_dtype dtype, acc_redop op, const void *const *srcs, int nsrc, void *const *dsts,
                        int ndst, size_t count);
int acc_reduce_supported(acc_dtype dtype, acc_redop op);

#endif
