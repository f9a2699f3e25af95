/* optim_util.h: pieces shared by the optimizer kernels (adam.c, sgd.c, adam_lowbit.c; the element loads and stores
 * also by csrc/cuda/, ACC_HD): element loads and low-precision stores by dtype (on fpconv.h's exact conversions),
 * the "many tensors, one parallel pass" driver and the non-finite gradient check.
 * Not for: Python (no Python.h) or the optimizer math itself. */
#ifndef ACC_OPTIM_UTIL_H
#define ACC_OPTIM_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "acc.h"
#include "fpconv.h"

static inline ACC_HD float acc_load_elem(const void *p, acc_dtype dt, size_t i) {
    switch (dt) {
    case ACC_BF16: return acc_bf16_to_f32(((const uint16_t *)p)[i]);
    case ACC_F16: return acc_f16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

static inline ACC_HD void acc_store_lp(void *p, acc_dtype dt, size_t i, float x) {
    if (dt == ACC_BF16) ((uint16_t *)p)[i] = acc_f32_to_bf16(x, 0x7fc0); /* torch's scalar NaN */
    else ((uint16_t *)p)[i] = acc_f32_to_f16(x);
}

ACC_EXTERN_C_BEGIN
/* fn(ctx, seg, lo, hi): process elements [lo, hi) of segment `seg`. */
typedef void (*acc_seg_fn)(void *ctx, size_t seg, size_t lo, size_t hi);

/* Treats nseg segments (sizes ns[]) as one index space and runs fn over it on up to nthreads threads
 * (contiguous splits, so a thread may cover the end of one tensor and the start of the next). One thread
 * spawn per call, not per tensor: ~150 tensors cost one parallel region. */
acc_status acc_segments_parallel(const size_t *ns, size_t nseg, int nthreads, acc_seg_fn fn, void *ctx);
/* The same with the units of ns[] (e.g. 256-element blocks) worth a thread given explicitly. */
acc_status acc_segments_parallel_min(const size_t *ns, size_t nseg, int nthreads, size_t min_per_thread,
                                     acc_seg_fn fn, void *ctx);

/* *found = 1 when any element of any grads[k] (dtype dts[k], ns[k] elements) times `scale` is inf or NaN.
 * Grad dtypes: ACC_F32, ACC_BF16, ACC_F16. */
acc_status acc_grads_nonfinite(const void *const *grads, const acc_dtype *dts, const size_t *ns, size_t nseg,
                               float scale, int nthreads, int *found);
ACC_EXTERN_C_END

/* Tensor k's gradient dtype (ACC_F32, ACC_BF16, ACC_F16) and, when lp_out is set, its low-precision copy's
 * dtype (ACC_BF16, ACC_F16): ACC_ERR_DTYPE with the error text set otherwise (inline: the CUDA step checks too) */
static inline acc_status acc_optim_check_dtypes(size_t k, acc_dtype grad_dtype, const void *lp_out,
                                                acc_dtype lp_dtype) {
    if (grad_dtype != ACC_F32 && grad_dtype != ACC_BF16 && grad_dtype != ACC_F16) {
        acc_set_error("tensor %zu: gradient dtype %s is not supported (float32, bfloat16, float16)", k,
                      acc_dtype_name(grad_dtype));
        return ACC_ERR_DTYPE;
    }
    if (lp_out && lp_dtype != ACC_BF16 && lp_dtype != ACC_F16) {
        acc_set_error("tensor %zu: the low-precision copy must be bfloat16 or float16", k);
        return ACC_ERR_DTYPE;
    }
    return ACC_OK;
}

/* Work below this many elements per thread is not worth a thread. */
#define ACC_OPTIM_MIN_PER_THREAD ((size_t)1 << 15)

#endif
