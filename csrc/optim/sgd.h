/* sgd.h: fused SGD step (momentum, dampening, nesterov, weight decay, maximize) over many fp32 tensors in one
 * multi-threaded pass, with optional gradient scaling and a bf16/fp16 copy of the new param.
 * Math follows torch.optim.SGD(foreach=False), op for op:
 *   g = grad * grad_scale; if maximize: g = -g;  if wd: g = fma(p, wd, g)
 *   momentum: first step buf = g, later buf = fma(g, 1-dampening, buf*momentum)
 *             nesterov: g = fma(buf, momentum, g), else g = buf
 *   p = fma(g, -lr, p)
 * Not for: Python objects or state allocation (the caller passes a momentum buffer to fill on the first step). */
#ifndef ACC_SGD_H
#define ACC_SGD_H

#include <math.h>
#include <stddef.h>

#include "acc.h"

typedef struct {
    float *param;          /* fp32, updated in place */
    const void *grad;      /* grad_dtype: ACC_F32, ACC_BF16, ACC_F16 */
    float *momentum_buf;   /* fp32; NULL when momentum == 0 */
    void *lp_out;          /* optional bf16/fp16 copy of the updated param */
    float *mirror;         /* optional fp32 copy of the updated param, e.g. a peer's replica (NULL: none) */
    size_t n;
    int init_buf;          /* 1: first step, the buffer is written with g (torch's clone), not read */
    acc_dtype grad_dtype, lp_dtype;
} acc_sgd_tensor;

typedef struct {
    double lr, momentum, dampening, weight_decay, grad_scale;
    int nesterov, maximize;
} acc_sgd_config;

ACC_EXTERN_C_BEGIN
acc_status acc_sgd_step(const acc_sgd_config *cfg, const acc_sgd_tensor *ts, size_t nt, int nthreads);
ACC_EXTERN_C_END

/* One element in the order above (sgd_body.inc's, which the CPU paths run; the CUDA kernels call this, ACC_HD):
 * gs/wd/mom/one_m_damp/neg_lr are the float scalars sgd.c derives (neg_lr = -lr), buf NULL without momentum, init
 * the first step. Include only from files compiled without floating-point contraction. */
static inline ACC_HD float acc_sgd_update1(float g, float *p, float *buf, int scaled, float gs, int maximize,
                                           int has_wd, float wd, int init, float mom, float one_m_damp,
                                           int nesterov, float neg_lr) {
    if (scaled) g = g * gs;
    if (maximize) g = -g;
    float pp = *p;
    if (has_wd) g = fmaf(pp, wd, g);
    if (buf) {
        float b = init ? g : fmaf(g, one_m_damp, *buf * mom);
        *buf = b;
        g = nesterov ? fmaf(b, mom, g) : b;
    }
    pp = fmaf(g, neg_lr, pp);
    *p = pp;
    return pp;
}

#endif
