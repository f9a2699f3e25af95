/* pack.c: the CPU implementation of acc_pack (pack.h). Each thread takes a contiguous range of destination
 * elements, finds the first piece reaching into it (binary search) and walks the pieces: zeros for the gaps,
 * acc_cast_span (cast.c: the scalar / AVX2 / AVX-512 conversion bodies, dispatched at run time) for the covered
 * parts. Not for: Python, or the conversions themselves (cast.c / fpconv.h own those). */
#include <string.h>

#include "acc.h"
#include "ops/cast.h"
#include "ops/pack.h"
#include "parallel.h"

/* Threads are created per call (~30-50 us each) while one thread copies an in-cache unit at ~100 GB/s (a 3M-element
 * bf16 unit in ~0.1 ms, benchmarks/pack.py): only units of >= 2 x this many elements are split. */
#define PACK_MIN_PER_THREAD ((size_t)1 << 21)

typedef struct {
    const acc_pack_piece *pieces;
    size_t np;
    char *dst;
    acc_dtype dd;
    size_t dsz;
    int nt;
} pack_ctx;

static int is_float(acc_dtype t) { return t == ACC_F32 || t == ACC_BF16 || t == ACC_F16; }

/* index of the first piece whose end lies beyond element b (np when none) */
static size_t first_piece(const pack_ctx *c, size_t b) {
    size_t lo = 0, hi = c->np;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (c->pieces[mid].offset + c->pieces[mid].n <= b) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static void zero(pack_ctx *c, size_t b, size_t e) {
    if (e > b) memset(c->dst + b * c->dsz, 0, (e - b) * c->dsz);
}

static int pack_chunk(void *ctx, size_t b, size_t e, int chunk) {
    (void)chunk;
    pack_ctx *c = (pack_ctx *)ctx;
    size_t pos = b;
    for (size_t k = first_piece(c, b); k < c->np && pos < e; k++) {
        const acc_pack_piece *p = &c->pieces[k];
        if (!p->n) continue;
        size_t start = p->offset > pos ? p->offset : pos, end = p->offset + p->n < e ? p->offset + p->n : e;
        if (start >= e) break;
        zero(c, pos, start);
        const char *src = (const char *)p->src + (start - p->offset) * acc_dtype_size(p->dtype);
        acc_cast_span(src, p->dtype, c->dst + start * c->dsz, c->dd, end - start, c->nt);
        pos = end;
    }
    zero(c, pos, e);
    return 0;
}

acc_status acc_pack(const acc_pack_piece *pieces, size_t npieces, void *dst, acc_dtype dst_dtype, size_t dst_n,
                    int nthreads, void *stream) {
    if (stream) {
        acc_set_error("acc_pack: the CPU kernel takes no stream");
        return ACC_ERR_ARG;
    }
    if (!is_float(dst_dtype)) {
        acc_set_error("acc_pack: unsupported destination dtype %s (float32, bfloat16, float16)",
                      acc_dtype_name(dst_dtype));
        return ACC_ERR_DTYPE;
    }
    if (dst_n && !dst) {
        acc_set_error("acc_pack: NULL destination");
        return ACC_ERR_ARG;
    }
    const size_t dsz = acc_dtype_size(dst_dtype);
    const char *d0 = (const char *)dst, *d1 = d0 + dst_n * dsz;
    size_t prev_end = 0;
    for (size_t k = 0; k < npieces; k++) {
        const acc_pack_piece *p = &pieces[k];
        if (!is_float(p->dtype)) {
            acc_set_error("acc_pack: piece %zu has unsupported dtype %s (float32, bfloat16, float16)", k,
                          acc_dtype_name(p->dtype));
            return ACC_ERR_DTYPE;
        }
        if (p->offset < prev_end) {
            acc_set_error("acc_pack: piece %zu starts at element %zu, before the end of the previous piece (%zu): "
                          "pieces must be in increasing offset order and must not overlap", k, p->offset, prev_end);
            return ACC_ERR_ARG;
        }
        if (p->offset > dst_n || p->n > dst_n - p->offset) {
            acc_set_error("acc_pack: piece %zu [%zu, %zu) lies outside the destination of %zu elements", k,
                          p->offset, p->offset + p->n, dst_n);
            return ACC_ERR_ARG;
        }
        if (p->n && !p->src) {
            acc_set_error("acc_pack: piece %zu has a NULL source", k);
            return ACC_ERR_ARG;
        }
        const char *s0 = (const char *)p->src, *s1 = s0 + p->n * acc_dtype_size(p->dtype);
        if (p->n && dst_n && s0 < d1 && d0 < s1) {
            acc_set_error("acc_pack: piece %zu overlaps the destination's memory", k);
            return ACC_ERR_ARG;
        }
        prev_end = p->offset + p->n;
    }
    if (!dst_n) return ACC_OK;
    pack_ctx c = {pieces, npieces, (char *)dst, dst_dtype, dsz, dst_n * dsz >= ACC_CAST_NT_BYTES};
    return (acc_status)acc_parallel_for(dst_n, nthreads, PACK_MIN_PER_THREAD, pack_chunk, &c, NULL);
}
