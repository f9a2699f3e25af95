/* shm_reduce.c: the element-wise N-way reduction used by the shm collectives (sum/avg/max/min over
 * fp32, bf16, fp16, fp64, int32, int64), with run-time SIMD dispatch (scalar / AVX2 / AVX-512).
 * Not for: synchronisation or memory layout (shm_seg.c / shm_coll.c).
 *
 * Why blocks: the N sources are combined in a fixed order (rank 0, 1, ...) into a small stack block
 * of the accumulation type (fp32 for bf16/fp16), then stored once to every destination. Fixed order
 * means every rank that reduces the same data gets the same bits. The generic kernels are
 * always_inline and instantiated once per target by ACC_SIMD_INSTANCES (simd.h), so gcc
 * vectorises the same C for each ISA (bit-identical: no FMA contraction happens in add/max/min).
 * The 2-source sum/avg/sum_div (every 2-rank all_reduce) skips the block: one element-wise pass computing the
 * same expression, ~1.7x faster than the block path (both input streams in flight, no extra passes). */
#include <math.h>
#include <string.h>

#include "fpconv.h"
#include "shm.h"
#include "simd.h"

#define BLK 1024

/* acc[i] = op(X, Y) for i < m, where X / Y are expressions of i (op is hoisted out of the loops by gcc's
 * loop unswitching since it is loop-invariant). SUM, AVG and SUM_DIV all add here; their division comes
 * after the last source. MAX/MIN propagate a NaN in the first operand. */
#define COMBINE(A, X, Y)                                                                                  \
    do {                                                                                                  \
        if (op == ACC_RED_MAX) {                                                                          \
            for (size_t i = 0; i < m; i++) {                                                              \
                A a = (X), v = (Y);                                                                       \
                acc[i] = (a > v || a != a) ? a : v;                                                       \
            }                                                                                             \
        } else if (op == ACC_RED_MIN) {                                                                   \
            for (size_t i = 0; i < m; i++) {                                                              \
                A a = (X), v = (Y);                                                                       \
                acc[i] = (a < v || a != a) ? a : v;                                                       \
            }                                                                                             \
        } else { /* SUM, AVG, SUM_DIV */                                                                  \
            for (size_t i = 0; i < m; i++) acc[i] = (X) + (Y);                                            \
        }                                                                                                 \
    } while (0)

/* d0[i] (and d1[i]) = ST(EXPR) for i < count. ivdep: there is no loop-carried dependence because every
 * destination is either exactly one of the sources or disjoint from them (checked by the caller), so the
 * element-wise loop vectorises without gcc's overlap test (which rejects dst == src). */
#define FUSED2(A, EXPR, ST)                                                                               \
    do {                                                                                                  \
        if (nd == 1) {                                                                                    \
            _Pragma("GCC ivdep") for (size_t i = 0; i < count; i++) d0[i] = ST(EXPR);                     \
        } else {                                                                                          \
            _Pragma("GCC ivdep") for (size_t i = 0; i < count; i++) {                                     \
                A v = (EXPR);                                                                             \
                d0[i] = ST(v);                                                                            \
                d1[i] = ST(v);                                                                            \
            }                                                                                             \
        }                                                                                                 \
    } while (0)

/* One generic kernel per (storage type T, accumulation type A). LD converts T->A, ST converts A->T.
 * Per block: the first pass combines sources 0 and 1 (both input streams in flight at once: ~1.7x faster
 * than copying source 0 into the block and adding source 1 in a second pass, for the common 2-rank case),
 * then each further source is folded in, then the block is stored to every destination. */
#define DEF_KERNEL(NAME, T, A, LD, ST)                                                                   \
    static inline ACC_AI void NAME(int op, const void *const *srcs, int n, void *const *dsts, int nd,    \
                                   size_t count, int fuse2) {                                            \
        if (fuse2) { /* 2 sources, 1-2 destinations, sum/avg/sum_div: one pass, no block */                      \
            const T *x = (const T *)srcs[0], *y = (const T *)srcs[1];                                     \
            T *d0 = (T *)dsts[0], *d1 = (T *)dsts[nd - 1];                                                \
            if (op == ACC_RED_SUM) {                                                                      \
                FUSED2(A, LD(x[i]) + LD(y[i]), ST);                                                       \
            } else if (op == ACC_RED_AVG) {                                                               \
                FUSED2(A, (LD(x[i]) + LD(y[i])) / (A)2, ST);                                              \
            } else { /* SUM_DIV: the sum rounded to T, then halved */                                     \
                FUSED2(A, LD(ST(LD(x[i]) + LD(y[i]))) / (A)2, ST);                                        \
            }                                                                                             \
            return;                                                                                       \
        }                                                                                                 \
        A acc[BLK];                                                                                       \
        for (size_t b = 0; b < count; b += BLK) {                                                         \
            size_t m = count - b < BLK ? count - b : BLK;                                                 \
            const T *s0 = (const T *)srcs[0] + b;                                                         \
            if (n == 1) {                                                                                 \
                for (size_t i = 0; i < m; i++) acc[i] = LD(s0[i]);                                        \
            } else {                                                                                      \
                const T *s1 = (const T *)srcs[1] + b;                                                     \
                COMBINE(A, LD(s0[i]), LD(s1[i]));                                                         \
            }                                                                                             \
            for (int k = 2; k < n; k++) {                                                                 \
                const T *sk = (const T *)srcs[k] + b;                                                     \
                COMBINE(A, acc[i], LD(sk[i]));                                                            \
            }                                                                                             \
            if (op == ACC_RED_AVG) {                                                                      \
                A dn = (A)n;                                                                              \
                for (size_t i = 0; i < m; i++) acc[i] = acc[i] / dn;                                      \
            } else if (op == ACC_RED_SUM_DIV) {                                                           \
                A dn = (A)n;                                                                              \
                for (size_t i = 0; i < m; i++) acc[i] = LD(ST(acc[i])) / dn;                              \
            }                                                                                             \
            for (int k = 0; k < nd; k++) {                                                                \
                T *d = (T *)dsts[k] + b;                                                                  \
                for (size_t i = 0; i < m; i++) d[i] = ST(acc[i]);                                         \
            }                                                                                             \
        }                                                                                                 \
    }

/* conversions: fpconv.h. bf16 keeps a NaN's sign and payload (acc_f32_to_bf16_quiet), fp16 goes through the
 * compiler's _Float16, whose F16C / soft-float conversions gcc vectorises (acc_f16n_*: fpconv.h's bits) */
#define ID(x) (x)
DEF_KERNEL(k_f32, float, float, ID, ID)
DEF_KERNEL(k_f64, double, double, ID, ID)
DEF_KERNEL(k_i32, int32_t, int32_t, ID, ID)
DEF_KERNEL(k_i64, int64_t, int64_t, ID, ID)
DEF_KERNEL(k_bf16, uint16_t, float, acc_bf16_to_f32, acc_f32_to_bf16_quiet)
DEF_KERNEL(k_f16, _Float16, float, acc_f16n_to_f32, acc_f32_to_f16n)

#define DISPATCH_BODY                                                                                    \
    switch (dtype) {                                                                                      \
    case ACC_F32: k_f32(op, srcs, n, dsts, nd, count, fuse2); break;                                             \
    case ACC_F64: k_f64(op, srcs, n, dsts, nd, count, fuse2); break;                                             \
    case ACC_I32: k_i32(op, srcs, n, dsts, nd, count, fuse2); break;                                             \
    case ACC_I64: k_i64(op, srcs, n, dsts, nd, count, fuse2); break;                                             \
    case ACC_BF16: k_bf16(op, srcs, n, dsts, nd, count, fuse2); break;                                           \
    case ACC_F16: k_f16(op, srcs, n, dsts, nd, count, fuse2); break;                                             \
    default: break;                                                                                       \
    }

/* ISA is unused: each instance is the same C, vectorised by the compiler for its target */
static inline ACC_AI int reduce_impl(acc_dtype dtype, int op, const void *const *srcs, int n, void *const *dsts,
                                     int nd, size_t count, int fuse2, const int ISA) {
    DISPATCH_BODY
    return 0;
}

ACC_SIMD_INSTANCES(int, reduce, (acc_dtype dtype, int op, const void *const *srcs, int n, void *const *dsts, int nd,
                                 size_t count, int fuse2), reduce_impl, dtype, op, srcs, n, dsts, nd, count, fuse2)

int acc_reduce_supported(acc_dtype dtype, acc_redop op) {
    int is_float = dtype == ACC_F32 || dtype == ACC_F64 || dtype == ACC_BF16 || dtype == ACC_F16;
    int is_int = dtype == ACC_I32 || dtype == ACC_I64;
    if (op < ACC_RED_SUM || op > ACC_RED_SUM_DIV) return 0;
    if (op == ACC_RED_AVG || op == ACC_RED_SUM_DIV) return is_float;
    return is_float || is_int;
}

/* 1 when no two of the ranges (every destination against every source and the other destinations, each
 * `bytes` long) overlap partially: they are either the same address or disjoint. */
static int exact_or_disjoint(const void *const *srcs, int nsrc, void *const *dsts, int ndst, size_t bytes) {
    for (int k = 0; k < ndst; k++) {
        uintptr_t d = (uintptr_t)dsts[k];
        for (int j = 0; j < nsrc + k; j++) {
            uintptr_t o = (uintptr_t)(j < nsrc ? srcs[j] : dsts[j - nsrc]);
            if (o != d && o < d + bytes && d < o + bytes) return 0;
        }
    }
    return 1;
}

acc_status acc_reduce_n(acc_dtype dtype, acc_redop op, const void *const *srcs, int nsrc, void *const *dsts,
                        int ndst, size_t count) {
    if (!acc_reduce_supported(dtype, op)) {
        acc_set_error("reduction op %d is not supported for dtype %s", (int)op, acc_dtype_name(dtype));
        return ACC_ERR_DTYPE;
    }
    if (nsrc < 1 || count == 0) return ACC_OK;
    int fuse2 = nsrc == 2 && ndst >= 1 && ndst <= 2 && op != ACC_RED_MAX && op != ACC_RED_MIN &&
                exact_or_disjoint(srcs, nsrc, dsts, ndst, count * acc_dtype_size(dtype));
    (void)ACC_SIMD_CALL(acc_simd_level_get(), reduce, dtype, op, srcs, nsrc, dsts, ndst, count, fuse2);
    return ACC_OK;
}
