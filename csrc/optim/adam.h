/* adam.h: fused Adam / AdamW step over many fp32 tensors (or one flat buffer) in one multi-threaded pass.
 * Per element: read param, grad, exp_avg, exp_avg_sq (and max_exp_avg_sq for amsgrad), write them back once,
 * plus an optional bf16/fp16 copy of the new param. Math follows torch.optim.Adam(foreach=False):
 *   g = grad * grad_scale; if maximize: g = -g
 *   AdamW (decoupled): p *= 1 - lr*wd          Adam (L2): g = fma(p, wd, g)
 *   m = lerp(m, g, 1-beta1)  (fma form, as ATen's vector lerp)
 *   v = fma((1-beta2)*g, g, v*beta2)   (ATen's addcmul after GCC contraction)
 *   amsgrad: vmax = max(vmax, v); v_used = vmax
 *   denom = sqrt(v_used) / sqrt(bc2) + eps
 *   p = p + ((-lr/bc1) * m) / denom        (ATen's addcdiv order)
 * Scalars are derived in double from `step` exactly as torch's Python code does, then rounded to float.
 * With this order exp_avg and exp_avg_sq match torch.optim.AdamW(foreach=False) bit for bit and params to
 * <= ~1e-7 relative (torch's own scalar tail loops round addcdiv/div differently from its vector body, so
 * full bit equality with torch is not attainable). Two divisions and one sqrt per element: measured in-cache
 * at ~5.6 Gparam/s per core (AVX-512), far above the DRAM-bound rate, so the exactness costs nothing. 
 * The same update with exp_avg/exp_avg_sq held in bf16 or in 8-bit block-wise codes is adam_lowbit.c's
 * (acc_adam_tensor.state_dtype): acc_adam_step takes fp32-state tensors only, acc_adam_lowbit_step the others,
 * and the caller splits a mixed call (bind_optim.c: acc_adam_check over all, then the low-precision tensors,
 * then the fp32 ones).
 * Not for: Python objects, the non-finite check (optim_util.h) or state allocation. */
#ifndef ACC_ADAM_H
#define ACC_ADAM_H

#include <stddef.h>

#include "acc.h"
#include "adam_math.h"

typedef struct {
    float *param;           /* fp32, n elements, updated in place */
    const void *grad;       /* n elements of grad_dtype */
    void *exp_avg, *exp_avg_sq; /* state_dtype elements each (ACC_U8: one code byte per element) */
    float *max_exp_avg_sq;  /* amsgrad only (fp32 state only), else NULL */
    void *lp_out;           /* optional bf16/fp16 copy of the updated param (NULL: none) */
    float *mirror;          /* optional fp32 copy of the updated param, e.g. a peer's replica (NULL: none) */
    size_t n;
    double step;            /* the step number this update makes (torch: state['step'] after += 1) */
    acc_dtype grad_dtype;   /* ACC_F32, ACC_BF16, ACC_F16 */
    acc_dtype lp_dtype;     /* ACC_BF16 or ACC_F16 when lp_out != NULL */
    /* Low-precision state (adam_lowbit.c); a zeroed struct means fp32 state. */
    acc_dtype state_dtype;  /* ACC_F32; ACC_BF16 (stochastic rounding on the write); ACC_U8 (8-bit block-wise,
                               qmap.h: exp_avg signed codes, exp_avg_sq unsigned codes) */
    float *exp_avg_absmax, *exp_avg_sq_absmax; /* ACC_U8: ceil(n / ACC_QBLOCK) block scales each */
    uint64_t offset;        /* this slice's first element within its logical tensor: the bf16 rounding bits
                               follow the logical index; ACC_U8 slices must start on a block (offset % 256 == 0) */
    uint64_t salt;          /* ACC_BF16: mixed with the step into the rounding seed (the tensor's position) */
} acc_adam_tensor;

/* Updates every tensor of ts[0..nt) (all with state_dtype ACC_F32) on up to nthreads threads. The result does
 * not depend on nthreads or on the SIMD level. Checks arguments (dtypes, amsgrad buffers) before touching any
 * memory. */
acc_status acc_adam_step(const acc_adam_config *cfg, const acc_adam_tensor *ts, size_t nt, int nthreads);

/* The checks every Adam tensor passes whatever its state (dtypes, amsgrad buffers, missing buffers, step >= 1),
 * tensor k of a call; acc_adam_check runs them over ts[0..nt) and stops at the first failure (error text set). */
acc_status acc_adam_check_tensor(const acc_adam_config *cfg, size_t k, const acc_adam_tensor *x);
acc_status acc_adam_check(const acc_adam_config *cfg, const acc_adam_tensor *ts, size_t nt);

/* The low-precision-state step (adam_lowbit.c): the tensors whose state_dtype is not ACC_F32 (k in error texts:
 * the index in ts). Same contract; the 8-bit tensors are split between threads in whole blocks. */
acc_status acc_adam_lowbit_step(const acc_adam_config *cfg, const acc_adam_tensor *const *ts, size_t nt,
                                int nthreads);

#endif
