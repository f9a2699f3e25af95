/* optim_util.h: pieces shared by the optimizer kernels (adam.c, sgd.c): exact scalar dtype conversions
 * (bf16/fp16 <-> fp32, matching the AVX-512/AVX2/F16C instructions bit for bit on finite values), the
 * "many tensors, one parallel pass" driver and the non-finite gradient check.
 * Not for: Python (no Python.h) or the optimizer math itself. */
#ifndef ACC_OPTIM_UTIL_H
#define ACC_OPTIM_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "acc.h"

/* bf16 -> fp32 is exact: the 16 bits become the top half. */
static inline float acc_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* fp32 -> bf16, round to nearest even; NaN -> 0x7FC0 (torch's scalar encoding). */
static inline uint16_t acc_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* fp16 -> fp32, exact (what vcvtph2ps does; NaNs come back quiet). */
static inline float acc_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
    if (e == 0x1f) u = sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0);
    else if (e) u = sign | ((e + 112u) << 23) | (m << 13);
    else if (!m) u = sign;
    else {
        float f = (float)m * 0x1p-24f; /* exact: m < 2^10 */
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* fp32 -> fp16, round to nearest even, overflow -> inf, subnormals kept (vcvtps2ph with RNE). */
static inline uint16_t acc_f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);           /* >= 65520 rounds to inf */
    if (a >= 0x38800000u) {                                            /* >= 2^-14: normal half */
        uint32_t r = a + 0x0fffu + ((a >> 13) & 1u) - ((uint32_t)(127 - 15) << 23);
        return (uint16_t)(sign | (r >> 13));
    }
    if (a <= 0x33000000u) return (uint16_t)sign;                       /* <= 2^-25 rounds to 0 */
    uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u, shift = 126u - e; /* shift in 14..24 */
    uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
}

static inline float acc_load_elem(const void *p, acc_dtype dt, size_t i) {
    switch (dt) {
    case ACC_BF16: return acc_bf16_to_f32(((const uint16_t *)p)[i]);
    case ACC_F16: return acc_f16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

static inline void acc_store_lp(void *p, acc_dtype dt, size_t i, float x) {
    if (dt == ACC_BF16) ((uint16_t *)p)[i] = acc_f32_to_bf16(x);
    else ((uint16_t *)p)[i] = acc_f32_to_f16(x);
}

/* fn(ctx, seg, lo, hi): process elements [lo, hi) of segment `seg`. */
typedef void (*acc_seg_fn)(void *ctx, size_t seg, size_t lo, size_t hi);

/* Treats nseg segments (sizes ns[]) as one index space and runs fn over it on up to nthreads threads
 * (contiguous splits, so a thread may cover the end of one tensor and the start of the next). One thread
 * spawn per call, not per tensor: ~150 tensors cost one parallel region. */
acc_status acc_segments_parallel(const size_t *ns, size_t nseg, int nthreads, acc_seg_fn fn, void *ctx);

/* *found = 1 when any element of any grads[k] (dtype dts[k], ns[k] elements) times `scale` is inf or NaN.
 * Grad dtypes: ACC_F32, ACC_BF16, ACC_F16. */
acc_status acc_grads_nonfinite(const void *const *grads, const acc_dtype *dts, const size_t *ns, size_t nseg,
                               float scale, int nthreads, int *found);

/* Tensor k's gradient dtype (ACC_F32, ACC_BF16, ACC_F16) and, when lp_out is set, its low-precision copy's
 * dtype (ACC_BF16, ACC_F16): ACC_ERR_DTYPE with the error text set otherwise. */
acc_status acc_optim_check_dtypes(size_t k, acc_dtype grad_dtype, const void *lp_out, acc_dtype lp_dtype);

/* Work below this many elements per thread is not worth a thread. */
#define ACC_OPTIM_MIN_PER_THREAD ((size_t)1 << 15)

#endif
