/* adam.c: fused Adam/AdamW step over fp32 state (see adam.h): per-tensor scalars in double, then one parallel
 * pass over all tensors with the best SIMD path. fp-contract is off so the scalar path never fuses a*b+c behind
 * our back: all three paths give identical bits. Also the argument checks and the per-tensor scalars that
 * adam_lowbit.c shares. Not for: Python, state allocation, the non-finite pre-check, low-precision state
 * (adam_lowbit.c; bind_optim.c splits a call between the two). */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <stdlib.h>

#include "adam.h"
#include "optim/adam_check.h"
#include "simd.h"
#include "optim_simd.h"
#include "adam_update.h"

typedef struct {
    float *param, *exp_avg, *exp_avg_sq, *max_exp_avg_sq, *mirror;
    const void *grad;
    void *lp_out;
    acc_dtype grad_dtype, lp_dtype;
    int nt;
    acc_adam_scalars c;
} adam_item;

#define ACC_ISA_BODY "adam_body.inc"
#include "isa_instances.inc"

static void adam_seg(void *ctx, size_t seg, size_t lo, size_t hi) {
    const adam_item *t = (const adam_item *)ctx + seg;
    ACC_SIMD_CALL(acc_simd_level_get(), adam_range, t, lo, hi);
}

acc_status acc_adam_check_tensor(const acc_adam_config *cfg, size_t k, const acc_adam_tensor *x) {
    const acc_adam_shape shape = ACC_ADAM_SHAPE_INIT(x);
    acc_status st = acc_adam_check_shape(cfg, k, &shape);
    if (st) return st;
    if (!(x->step >= 1)) {
        acc_set_error("tensor %zu: step must be >= 1 (got %g)", k, x->step);
        return ACC_ERR_ARG;
    }
    return ACC_OK;
}

acc_status acc_adam_check(const acc_adam_config *cfg, const acc_adam_tensor *ts, size_t nt) {
    for (size_t k = 0; k < nt; k++) {
        acc_status st = acc_adam_check_tensor(cfg, k, &ts[k]);
        if (st) return st;
    }
    return ACC_OK;
}

acc_status acc_adam_step(const acc_adam_config *cfg, const acc_adam_tensor *ts, size_t nt, int nthreads) {
    if (nt == 0) return ACC_OK;
    acc_status st = acc_adam_check(cfg, ts, nt);
    if (st) return st;
    for (size_t k = 0; k < nt; k++)
        if (ts[k].state_dtype != ACC_F32) {
            acc_set_error("tensor %zu: state dtype %s is acc_adam_lowbit_step's", k, acc_dtype_name(ts[k].state_dtype));
            return ACC_ERR_DTYPE;
        }
    adam_item *items = (adam_item *)calloc(nt, sizeof(adam_item));
    size_t *ns = (size_t *)malloc(nt * sizeof(size_t));
    if (!items || !ns) {
        free(items);
        free(ns);
        return ACC_ERR_NOMEM;
    }
    size_t lp_total = 0;
    for (size_t k = 0; k < nt; k++) {
        const acc_adam_tensor *x = &ts[k];
        adam_item *t = &items[k];
        *t = (adam_item){
            .param = x->param, .exp_avg = x->exp_avg, .exp_avg_sq = x->exp_avg_sq,
            .max_exp_avg_sq = cfg->amsgrad ? x->max_exp_avg_sq : NULL, .grad = x->grad,
            .lp_out = x->lp_out, .mirror = x->mirror, .grad_dtype = x->grad_dtype, .lp_dtype = x->lp_dtype,
        };
        acc_adam_scalars_for(cfg, x->step, &t->c);
        ns[k] = x->n;
        lp_total += x->lp_out ? x->n : 0;
    }
    for (size_t k = 0; k < nt; k++) items[k].nt = lp_total >= ACC_OPTIM_NT_MIN;
    st = acc_segments_parallel(ns, nt, nthreads, adam_seg, items);
    free(items);
    free(ns);
    return st;
}
