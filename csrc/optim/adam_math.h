/* adam_math.h: the scalar definition of one Adam/AdamW update (adam.h gives the operation order): the per-call
 * config, the per-tensor float scalars derived from it (in double, as torch's Python code does, then rounded) and
 * one element's update. The CPU kernels (adam.c's vector bodies, adam_lowbit.c) perform these operations; the CUDA
 * kernels (csrc/cuda/) call these very functions on the device (ACC_HD), so a step gives the same bits on both
 * where the device compiles without contraction (-fmad=false) and with IEEE division and square root.
 * Include only from files compiled without floating-point contraction (gcc: fp-contract=off).
 * Not for: state allocation, the multi-tensor passes, Python. */
#ifndef ACC_ADAM_MATH_H
#define ACC_ADAM_MATH_H

#include <math.h>

#include "acc.h"

typedef struct {
    double lr, beta1, beta2, eps, weight_decay;
    double grad_scale;      /* gradients are multiplied by this (1.0: no scaling) */
    int decoupled;          /* 1: AdamW weight decay, 0: Adam (L2 added to the gradient) */
    int amsgrad, maximize;
    int lr_is_f32_tensor;   /* torch computes lr/bc1 and 1 - lr*wd as float32 tensor ops when lr is a float32
                               tensor (LR schedulers with tensor lr): we round the same way */
} acc_adam_config;

/* The per-tensor float scalars of one update (shared by the fp32 and the low-precision paths, so both round
 * lr/bc1, sqrt(bc2), 1 - lr*wd the same way). wd_mode: 0 none, 1 decoupled, 2 L2. */
typedef struct {
    int scaled, maximize, wd_mode, lerp_from_end;
    float grad_scale, lerp_coeff, beta2, one_m_beta2, decay, wd, bc2_sqrt, eps, neg_step_size;
} acc_adam_scalars;

/* The scalars of the update that makes step `step` (>= 1). On a device (CUDA graphs: step and lr read from device
 * memory) pow is the device's, which may differ from glibc's in the last bit of a double before the rounding to
 * float: the CUDA extension computes these on the host whenever the step is known there. */
static inline ACC_HD void acc_adam_scalars_for(const acc_adam_config *cfg, double step, acc_adam_scalars *c) {
    /* torch computes these in Python floats (double) and hands them to float kernels */
    float w = (float)(1.0 - cfg->beta1);
    int from_end = !(fabsf(w) < 0.5f); /* ATen lerp: weight >= 0.5 uses end - (end - start) * (1 - weight) */
    double bc1 = 1.0 - pow(cfg->beta1, step), bc2 = 1.0 - pow(cfg->beta2, step);
    double step_size = cfg->lr / bc1, bc2_sqrt = pow(bc2, 0.5), decay = 1.0 - cfg->lr * cfg->weight_decay;
    if (cfg->lr_is_f32_tensor) {
        step_size = (double)((float)cfg->lr / (float)bc1);
        decay = (double)(1.0f - (float)cfg->lr * (float)cfg->weight_decay);
    }
    c->scaled = cfg->grad_scale != 1.0;
    c->maximize = cfg->maximize;
    c->wd_mode = cfg->weight_decay == 0.0 ? 0 : (cfg->decoupled ? 1 : 2);
    c->lerp_from_end = from_end;
    c->grad_scale = (float)cfg->grad_scale;
    c->lerp_coeff = from_end ? w - 1.0f : w;
    c->beta2 = (float)cfg->beta2;
    c->one_m_beta2 = (float)(1.0 - cfg->beta2);
    c->decay = (float)decay;
    c->wd = (float)cfg->weight_decay;
    c->bc2_sqrt = (float)bc2_sqrt;
    c->eps = (float)cfg->eps;
    c->neg_step_size = (float)(-step_size);
}

/* One element, in adam.h's order: g the gradient as loaded (fp32), *p the param, *m / *v the moments in fp32 (the
 * low-precision paths widen before and narrow after), vmax the amsgrad maximum (NULL: no amsgrad; it holds
 * max(old, v) after, and the update uses it). Returns the new param (also stored in *p). */
static inline ACC_HD float acc_adam_update1(const acc_adam_scalars *c, float g, float *p, float *m, float *v,
                                            float *vmax) {
    if (c->scaled) g = g * c->grad_scale;
    if (c->maximize) g = -g;
    float pp = *p;
    if (c->wd_mode == 1) pp = pp * c->decay;
    else if (c->wd_mode == 2) g = fmaf(pp, c->wd, g);
    *m = fmaf(c->lerp_coeff, g - *m, c->lerp_from_end ? g : *m);
    *v = fmaf(c->one_m_beta2 * g, g, *v * c->beta2);
    float vu = *v;
    if (vmax) {
        vu = *vmax > *v ? *vmax : *v; /* maxps(old, v): the vector bodies' VMAX(X, v) */
        *vmax = vu;
    }
    float den = sqrtf(vu) / c->bc2_sqrt + c->eps;
    pp = pp + (c->neg_step_size * *m) / den;
    *p = pp;
    return pp;
}

#endif
