/* shm_coll.c: the collectives over a group's segment: all_reduce, reduce_scatter, all_gather,
 * broadcast, scatter, barrier. Three paths per op, chosen per call from the size and where the data lives:
 *   small (bytes a rank contributes <= small_bytes): copy into small[call & 1], one arrival, every rank
 *       reads what it needs from every peer's small buffer. No trailing barrier: to reuse small[b] a rank
 *       must first have waited for every peer's arrival of the next call, which peers only make after
 *       they finished reading small[b].
 *   zero-copy (the tensor lies in a registered region, same offset on every rank): no copy-in; ranks
 *       read (and for the in-place all_reduce, write) peers' parts directly, then a second arrival so
 *       nobody returns (and lets the user touch its buffer) while a peer still uses it.
 *   staged (ordinary tensors above small_bytes): chunks of chunk_bytes through staging[k & 1]
 *       (k counts chunks across calls, so consecutive chunks alternate buffers; same reuse argument:
 *       a rank rewrites staging[k & 1] for chunk k+2 only after waiting for an arrival that every peer
 *       makes after its last read of chunk k). One arrival per chunk; all_reduce is pipelined so that
 *       P chunks cost P+1 arrivals (see staged_all_reduce).
 * all_reduce slices a chunk into N cache-line aligned parts; rank r reduces part r from every rank. It is
 * out-of-place underneath (acc_shm_all_reduce_out reads `in`, writes `out`); in place is in == out.
 * Not for: segment life cycle / waiting (shm_seg.c) or the arithmetic (shm_reduce.c). */
#include <stdio.h>
#include <string.h>

#include "shm_internal.h"

static const char *op_name(uint32_t kind) {
    switch (kind) {
    case OP_ALL_REDUCE: return "all_reduce";
    case OP_REDUCE_SCATTER: return "reduce_scatter";
    case OP_ALL_GATHER: return "all_gather";
    case OP_BROADCAST: return "broadcast";
    case OP_SCATTER: return "scatter";
    default: return "barrier";
    }
}

static void desc_str(const shm_desc *d, char *buf, size_t cap) {
    snprintf(buf, cap, "%s(count=%llu, dtype=%s, %s=%u, %s)", op_name(d->kind), (unsigned long long)d->count,
             acc_dtype_name((acc_dtype)d->dtype), d->kind == OP_BROADCAST || d->kind == OP_SCATTER ? "root" : "op", d->redop,
             d->zoff == UINT64_MAX ? "ordinary buffer" : "shm buffer");
}

/* Starts call number ncalls: checks the group, publishes this rank's descriptor. */
static acc_status begin(acc_shm_group *g, uint32_t kind, acc_dtype dtype, uint32_t redop, uint64_t count,
                        uint64_t zoff) {
    if (g->broken || atomic_load(&g->hdr->abort_flag)) {
        acc_set_error("shm %s: the group is unusable after an earlier error (%s)", op_name(kind),
                      atomic_load(&g->hdr->abort_flag) ? g->hdr->abort_msg : "see the first exception");
        return ACC_ERR_STATE;
    }
    shm_desc *d = &g->slots[g->rank].desc[g->ncalls & 1u];
    d->call = g->ncalls;
    d->kind = kind;
    d->dtype = (uint32_t)dtype;
    d->redop = redop;
    d->count = count;
    d->zoff = zoff;
    d->zreg = 0;
    g->ncalls++;
    return ACC_OK;
}

/* First arrival of a call: arrive, wait, then compare every peer's descriptor with ours. */
static acc_status first_sync(acc_shm_group *g, uint32_t kind) {
    shm_arrive(g);
    acc_status st = shm_wait_all(g, op_name(kind), g->spin_ns);
    if (st) return st;
    uint32_t b = (g->ncalls - 1) & 1u;
    const shm_desc *mine = &g->slots[g->rank].desc[b];
    for (int q = 0; q < g->nranks; q++) {
        const shm_desc *d = &g->slots[q].desc[b];
        /* scatter: only the root's input placement matters (the others read it from the root's descriptor) */
        if (d->call == mine->call && d->kind == mine->kind && d->dtype == mine->dtype && d->redop == mine->redop &&
            d->count == mine->count && (d->zoff == mine->zoff || kind == OP_SCATTER))
            continue;
        char a[160], c[160], msg[1024];
        desc_str(mine, a, sizeof a);
        desc_str(d, c, sizeof c);
        snprintf(msg, sizeof msg, "shm %s: mismatched collective: rank %d called %s (call %u) but rank %d called %s (call %u)",
                 op_name(kind), g->rank, a, mine->call, q, c, d->call);
        shm_abort(g, msg);
        acc_set_error("%s", msg);
        return ACC_ERR_PEER;
    }
    return ACC_OK;
}

static acc_status sync_again(acc_shm_group *g, uint32_t kind) {
    shm_arrive(g);
    return shm_wait_all(g, op_name(kind), g->inner_spin_ns);
}

/* Offset of [p, p+n) inside this rank's part of a registered region, or UINT64_MAX. Sets *part0. */
static uint64_t region_offset(acc_shm_group *g, const void *p, size_t n, char **part0, size_t *stride) {
    const char *c = (const char *)p;
    for (int i = 0; i < g->nregions; i++) {
        shm_region *r = &g->regions[i];
        char *mine = r->base + (size_t)g->rank * r->part_bytes;
        if (c >= mine && c + n <= mine + r->part_bytes && n > 0) {
            *part0 = r->base;
            *stride = r->part_bytes;
            return (uint64_t)(c - mine);
        }
    }
    return UINT64_MAX;
}

/* Slice q of n elements split in N parts aligned to 64 bytes. */
static void slice(size_t n, size_t esz, int nranks, int q, size_t *lo, size_t *hi) {
    size_t align = 64 / esz ? 64 / esz : 1;
    size_t per = (n + (size_t)nranks - 1) / (size_t)nranks;
    per = (per + align - 1) / align * align;
    *lo = (size_t)q * per < n ? (size_t)q * per : n;
    *hi = *lo + per < n ? *lo + per : n;
}

/* Staged all_reduce of an ordinary tensor, pipelined over pieces of at most chunk_bytes: piece p of the
 * call is stage k = nstage0 + p and uses staging buffer k & 1 of every rank, in which rank q's slot is
 * [q * chunk_bytes / N, +chunk_bytes / N) whatever the piece's size (so slices of different pieces never
 * overlap). Step s (s = 0 .. P) does, then arrives once:
 *   reduce piece s-1:   my slice of it from my tensor + every peer's slot `me` of buffer (s-1) (their
 *                       copy-in), summed in rank order, stored to my tensor and to my own slot `me`;
 *   copy out piece s-2: slice q of my tensor <- rank q's slot q of buffer (s-2) (its reduced slice);
 *   copy in piece s:    slice q of my tensor -> my slot q of buffer s, for every q != me.
 * and a last copy-out of piece P-1 follows the final arrival. So P pieces cost P+1 arrivals. "My tensor" is
 * read from `in` and written to `out` (the same pointer for the in-place op): copy-in and my own sources
 * read `in`, the reduce and the copy-out write `out`.
 * Reuse safety, seen from rank me's staging. In step s peers read: my slots q != me of buffer s-1 (piece
 * s-1's copy-in, for their reduce) and my slot me of buffer s-2 = buffer s (my reduced slice of piece s-2,
 * for their copy-out); I write my slots q != me of buffer s and my slot me of buffer s-1: other slots, so
 * no conflict inside a step. What I overwrite (piece s-2's copy-in, piece s-3's reduced slice) was read by
 * peers in step s-1, before the arrival of step s-1 that I waited for; and no peer starts step s+1 before
 * my arrival of step s. Across calls the stage count continues: the trailing copy-out reads buffer P-1
 * while the next call's step 0 writes only slots q != me of buffer P (the other one), and its step 1 comes
 * after its first arrival, which peers make after their trailing copy-out. */
static size_t piece_len(size_t count, size_t per_piece, size_t p) {
    size_t off = p * per_piece;
    return count - off < per_piece ? count - off : per_piece;
}

static acc_status staged_all_reduce(acc_shm_group *g, const char *in, char *out, size_t count, size_t esz,
                                    acc_dtype dtype, acc_redop op) {
    const int N = g->nranks, me = g->rank;
    const size_t slot = g->chunk_bytes / (size_t)N, per_piece = g->chunk_bytes / esz;
    const size_t npieces = (count + per_piece - 1) / per_piece;
    const uint32_t k0 = g->nstage;
    g->nstage += (uint32_t)npieces;
    const void *srcs[SHM_MAX_RANKS];
    void *dsts[2];
    size_t lo, hi;
    acc_status st;
    for (size_t s = 0; s <= npieces + 1; s++) {
        if (s >= 1 && s - 1 < npieces) { /* reduce piece s-1 */
            size_t m = piece_len(count, per_piece, s - 1), off = (s - 1) * per_piece * esz;
            uint32_t k = k0 + (uint32_t)(s - 1);
            slice(m, esz, N, me, &lo, &hi);
            for (int q = 0; q < N; q++) srcs[q] = q == me ? in + off + lo * esz : shm_staging(g, q, k) + (size_t)me * slot;
            dsts[0] = out + off + lo * esz;
            dsts[1] = shm_staging(g, me, k) + (size_t)me * slot;
            if (hi > lo && (st = acc_reduce_n(dtype, op, srcs, N, dsts, N > 1 ? 2 : 1, hi - lo))) return st;
        }
        if (s >= 2) { /* copy out piece s-2 */
            size_t m = piece_len(count, per_piece, s - 2);
            uint32_t k = k0 + (uint32_t)(s - 2);
            char *base = out + (s - 2) * per_piece * esz;
            for (int q = 0; q < N; q++) {
                if (q == me) continue;
                slice(m, esz, N, q, &lo, &hi);
                memcpy(base + lo * esz, shm_staging(g, q, k) + (size_t)q * slot, (hi - lo) * esz);
            }
        }
        if (s == npieces + 1) break;
        if (s < npieces) { /* copy in piece s */
            size_t m = piece_len(count, per_piece, s);
            const char *base = in + s * per_piece * esz;
            char *stg = shm_staging(g, me, k0 + (uint32_t)s);
            for (int q = 0; q < N; q++) {
                if (q == me) continue;
                slice(m, esz, N, q, &lo, &hi);
                memcpy(stg + (size_t)q * slot, base + lo * esz, (hi - lo) * esz);
            }
        }
        if ((st = s == 0 ? first_sync(g, OP_ALL_REDUCE) : sync_again(g, OP_ALL_REDUCE))) return st;
    }
    return ACC_OK;
}

acc_status acc_shm_all_reduce_out(acc_shm_group *g, const void *in, void *out, size_t count, acc_dtype dtype,
                                  acc_redop op) {
    if (!acc_reduce_supported(dtype, op)) {
        acc_set_error("shm all_reduce: op %d is not supported for dtype %s", (int)op, acc_dtype_name(dtype));
        return ACC_ERR_DTYPE;
    }
    const int N = g->nranks, me = g->rank;
    const size_t esz = acc_dtype_size(dtype), nbytes = count * esz;
    const int inplace = in == out;
    char *part0 = NULL;
    size_t pstride = 0;
    uint64_t zoff = nbytes > g->small_bytes ? region_offset(g, in, nbytes, &part0, &pstride) : UINT64_MAX;
    acc_status st = begin(g, OP_ALL_REDUCE, dtype, (uint32_t)op, count, zoff);
    if (st) return st;
    const void *srcs[SHM_MAX_RANKS];
    void *dsts[SHM_MAX_RANKS + 1];
    if (nbytes <= g->small_bytes) {
        uint32_t call = g->ncalls - 1;
        memcpy(shm_small(g, me, call), in, nbytes);
        if ((st = first_sync(g, OP_ALL_REDUCE))) return st;
        for (int q = 0; q < N; q++) srcs[q] = shm_small(g, q, call);
        dsts[0] = out;
        return acc_reduce_n(dtype, op, srcs, N, dsts, 1, count);
    }
    if (zoff != UINT64_MAX) {
        if ((st = first_sync(g, OP_ALL_REDUCE))) return st;
        size_t lo, hi;
        if (inplace) { /* my slice from every part, stored back to every part */
            slice(count, esz, N, me, &lo, &hi);
            for (int q = 0; q < N; q++) dsts[q] = part0 + (size_t)q * pstride + zoff + lo * esz;
            if (hi > lo && (st = acc_reduce_n(dtype, op, (const void *const *)dsts, N, dsts, N, hi - lo))) return st;
        } else { /* the inputs stay untouched: every rank reduces the whole range into its own out */
            for (int q = 0; q < N; q++) srcs[q] = part0 + (size_t)q * pstride + zoff;
            dsts[0] = out;
            if ((st = acc_reduce_n(dtype, op, srcs, N, dsts, 1, count))) return st;
        }
        return sync_again(g, OP_ALL_REDUCE);
    }
    return staged_all_reduce(g, (const char *)in, (char *)out, count, esz, dtype, op);
}

acc_status acc_shm_all_reduce(acc_shm_group *g, void *data, size_t count, acc_dtype dtype, acc_redop op) {
    return acc_shm_all_reduce_out(g, data, data, count, dtype, op);
}

acc_status acc_shm_reduce_scatter(acc_shm_group *g, const void *in, void *out, size_t count, acc_dtype dtype,
                                  acc_redop op) {
    if (!acc_reduce_supported(dtype, op)) {
        acc_set_error("shm reduce_scatter: op %d is not supported for dtype %s", (int)op, acc_dtype_name(dtype));
        return ACC_ERR_DTYPE;
    }
    const int N = g->nranks, me = g->rank;
    const size_t esz = acc_dtype_size(dtype), nbytes = count * esz, total = nbytes * (size_t)N;
    char *part0 = NULL;
    size_t pstride = 0;
    uint64_t zoff = total > g->small_bytes ? region_offset(g, in, total, &part0, &pstride) : UINT64_MAX;
    acc_status st = begin(g, OP_REDUCE_SCATTER, dtype, (uint32_t)op, count, zoff);
    if (st) return st;
    const void *srcs[SHM_MAX_RANKS];
    void *dst[1] = {out};
    if (total <= g->small_bytes) {
        uint32_t call = g->ncalls - 1;
        memcpy(shm_small(g, me, call), in, total);
        if ((st = first_sync(g, OP_REDUCE_SCATTER))) return st;
        for (int q = 0; q < N; q++) srcs[q] = shm_small(g, q, call) + (size_t)me * nbytes;
        return acc_reduce_n(dtype, op, srcs, N, dst, 1, count);
    }
    if (zoff != UINT64_MAX) {
        if ((st = first_sync(g, OP_REDUCE_SCATTER))) return st;
        for (int q = 0; q < N; q++) srcs[q] = part0 + (size_t)q * pstride + zoff + (size_t)me * nbytes;
        if ((st = acc_reduce_n(dtype, op, srcs, N, dst, 1, count))) return st;
        return sync_again(g, OP_REDUCE_SCATTER);
    }
    /* staged: chunk c holds elements [off, off+m) of every rank's block, block q at q*m */
    const size_t per_chunk = g->chunk_bytes / esz / (size_t)N;
    for (size_t off = 0; off < count; off += per_chunk) {
        size_t m = count - off < per_chunk ? count - off : per_chunk;
        uint32_t k = g->nstage++;
        char *stg = shm_staging(g, me, k);
        for (int q = 0; q < N; q++) memcpy(stg + (size_t)q * m * esz, (const char *)in + ((size_t)q * count + off) * esz, m * esz);
        if ((st = off == 0 ? first_sync(g, OP_REDUCE_SCATTER) : sync_again(g, OP_REDUCE_SCATTER))) return st;
        for (int q = 0; q < N; q++) srcs[q] = shm_staging(g, q, k) + (size_t)me * m * esz;
        dst[0] = (char *)out + off * esz;
        if ((st = acc_reduce_n(dtype, op, srcs, N, dst, 1, m))) return st;
    }
    return ACC_OK;
}

acc_status acc_shm_all_gather(acc_shm_group *g, const void *in, void *out, size_t nbytes) {
    const int N = g->nranks, me = g->rank;
    char *part0 = NULL;
    size_t pstride = 0;
    uint64_t zoff = nbytes > g->small_bytes ? region_offset(g, in, nbytes, &part0, &pstride) : UINT64_MAX;
    acc_status st = begin(g, OP_ALL_GATHER, ACC_U8, 0, nbytes, zoff);
    if (st) return st;
    char *o = (char *)out;
    if (nbytes <= g->small_bytes) {
        uint32_t call = g->ncalls - 1;
        memcpy(shm_small(g, me, call), in, nbytes);
        if ((st = first_sync(g, OP_ALL_GATHER))) return st;
        for (int q = 0; q < N; q++) memcpy(o + (size_t)q * nbytes, q == me ? in : shm_small(g, q, call), nbytes);
        return ACC_OK;
    }
    if (zoff != UINT64_MAX) {
        if ((st = first_sync(g, OP_ALL_GATHER))) return st;
        for (int q = 0; q < N; q++) memmove(o + (size_t)q * nbytes, part0 + (size_t)q * pstride + zoff, nbytes);
        return sync_again(g, OP_ALL_GATHER);
    }
    for (size_t off = 0; off < nbytes; off += g->chunk_bytes) {
        size_t m = nbytes - off < g->chunk_bytes ? nbytes - off : g->chunk_bytes;
        uint32_t k = g->nstage++;
        memcpy(shm_staging(g, me, k), (const char *)in + off, m);
        if ((st = off == 0 ? first_sync(g, OP_ALL_GATHER) : sync_again(g, OP_ALL_GATHER))) return st;
        for (int q = 0; q < N; q++) memcpy(o + (size_t)q * nbytes + off, shm_staging(g, q, k), m);
    }
    return ACC_OK;
}

acc_status acc_shm_broadcast(acc_shm_group *g, void *data, size_t nbytes, int root) {
    const int me = g->rank;
    if (root < 0 || root >= g->nranks) {
        acc_set_error("shm broadcast: root %d out of range for %d ranks", root, g->nranks);
        return ACC_ERR_ARG;
    }
    char *part0 = NULL;
    size_t pstride = 0;
    uint64_t zoff = nbytes > g->small_bytes ? region_offset(g, data, nbytes, &part0, &pstride) : UINT64_MAX;
    acc_status st = begin(g, OP_BROADCAST, ACC_U8, (uint32_t)root, nbytes, zoff);
    if (st) return st;
    if (nbytes <= g->small_bytes) {
        uint32_t call = g->ncalls - 1;
        if (me == root) memcpy(shm_small(g, me, call), data, nbytes);
        if ((st = first_sync(g, OP_BROADCAST))) return st;
        if (me != root) memcpy(data, shm_small(g, root, call), nbytes);
        return ACC_OK;
    }
    if (zoff != UINT64_MAX) {
        if ((st = first_sync(g, OP_BROADCAST))) return st;
        if (me != root) memcpy(data, part0 + (size_t)root * pstride + zoff, nbytes);
        return sync_again(g, OP_BROADCAST);
    }
    for (size_t off = 0; off < nbytes; off += g->chunk_bytes) {
        size_t m = nbytes - off < g->chunk_bytes ? nbytes - off : g->chunk_bytes;
        uint32_t k = g->nstage++;
        if (me == root) memcpy(shm_staging(g, me, k), (char *)data + off, m);
        if ((st = off == 0 ? first_sync(g, OP_BROADCAST) : sync_again(g, OP_BROADCAST))) return st;
        if (me != root) memcpy((char *)data + off, shm_staging(g, root, k), m);
    }
    return ACC_OK;
}

/* Scatter of root's in[q*nbytes, +nbytes) to rank q's out. The path is the root's choice: the small one
 * from the size (every rank knows it), else zero-copy when root's `in` lies in a registered region, else
 * staged. Only the root knows which of the last two, so it publishes zoff (and the region index) in its
 * descriptor, and the peers, who do nothing before the first arrival, read it there after that arrival.
 *   small (N*nbytes <= small_bytes): root copies everything into small[call & 1]; same reuse rule as
 *       broadcast (root rewrites small[b] two calls later, after every peer's arrival of the call in between).
 *   zero-copy: peers read their block from root's part, then a second arrival so the root does not return
 *       (and let the caller touch `in`) while a peer still reads.
 *   staged: chunk k (k = nstage, across calls) carries elements [off, off+m) of every block but root's own,
 *       the block of rank q in slot j(q) = q - (q > root) of root's staging[k & 1] (chunk_bytes / (N-1) bytes
 *       per slot); root copies its own block straight to its `out`. One arrival per chunk; root rewrites
 *       staging[k & 1] for chunk k+2 only after waiting for the arrival of chunk k+1, which every peer makes
 *       after reading chunk k (the broadcast / all_gather argument; nstage is shared with them). */
acc_status acc_shm_scatter(acc_shm_group *g, const void *in, void *out, size_t nbytes, int root) {
    const int N = g->nranks, me = g->rank;
    if (root < 0 || root >= N) {
        acc_set_error("shm scatter: root %d out of range for %d ranks", root, N);
        return ACC_ERR_ARG;
    }
    if (me == root && nbytes && !in) {
        acc_set_error("shm scatter: the root (rank %d) has no input", me);
        return ACC_ERR_ARG;
    }
    const size_t total = nbytes * (size_t)N;
    char *part0 = NULL;
    size_t pstride = 0;
    uint64_t zoff = me == root && total > g->small_bytes ? region_offset(g, in, total, &part0, &pstride) : UINT64_MAX;
    acc_status st = begin(g, OP_SCATTER, ACC_U8, (uint32_t)root, nbytes, zoff);
    if (st) return st;
    const uint32_t call = g->ncalls - 1;
    if (zoff != UINT64_MAX)
        for (int i = 0; i < g->nregions; i++)
            if (g->regions[i].base == part0) g->slots[me].desc[call & 1u].zreg = (uint32_t)i;
    char *o = (char *)out;
    const char *mine = me == root ? (const char *)in + (size_t)me * nbytes : NULL;
    if (total <= g->small_bytes) {
        if (me == root) memcpy(shm_small(g, me, call), in, total);
        if ((st = first_sync(g, OP_SCATTER))) return st;
        if (me == root) memmove(o, mine, nbytes);
        else memcpy(o, shm_small(g, root, call) + (size_t)me * nbytes, nbytes);
        return ACC_OK;
    }
    if (me == root && zoff != UINT64_MAX) {
        if ((st = first_sync(g, OP_SCATTER))) return st;
        memmove(o, mine, nbytes);
        return sync_again(g, OP_SCATTER);
    }
    if (me != root) { /* peers learn the root's path at the first arrival */
        if ((st = first_sync(g, OP_SCATTER))) return st;
        const shm_desc *rd = &g->slots[root].desc[call & 1u];
        if (rd->zoff != UINT64_MAX) {
            if (rd->zreg >= (uint32_t)g->nregions) {
                acc_set_error("shm scatter: rank %d has no region %u (the root's input region); regions must be "
                              "allocated collectively", me, rd->zreg);
                return ACC_ERR_STATE;
            }
            const shm_region *r = &g->regions[rd->zreg];
            memcpy(o, r->base + (size_t)root * r->part_bytes + rd->zoff + (size_t)me * nbytes, nbytes);
            return sync_again(g, OP_SCATTER);
        }
    }
    const size_t slot = N > 1 ? g->chunk_bytes / (size_t)(N - 1) / 64 * 64 : g->chunk_bytes; /* >= 4096 */
    for (size_t off = 0; off < nbytes; off += slot) {
        size_t m = nbytes - off < slot ? nbytes - off : slot;
        uint32_t k = g->nstage++;
        if (me == root) {
            char *stg = shm_staging(g, me, k);
            for (int q = 0; q < N; q++)
                if (q != root) memcpy(stg + (size_t)(q - (q > root)) * m, (const char *)in + (size_t)q * nbytes + off, m);
            if ((st = off == 0 ? first_sync(g, OP_SCATTER) : sync_again(g, OP_SCATTER))) return st;
            memmove(o + off, mine + off, m);
        } else {
            if (off > 0 && (st = sync_again(g, OP_SCATTER))) return st;
            memcpy(o + off, shm_staging(g, root, k) + (size_t)(me - (me > root)) * m, m);
        }
    }
    return ACC_OK;
}

acc_status acc_shm_barrier(acc_shm_group *g) {
    acc_status st = begin(g, OP_BARRIER, ACC_U8, 0, 0, UINT64_MAX);
    if (st) return st;
    return first_sync(g, OP_BARRIER);
}
