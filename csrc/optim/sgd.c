/* sgd.c: fused SGD step (see sgd.h): one parallel pass over all tensors with the best SIMD path;
 * fp-contract is off so the scalar path matches the vector paths bit for bit.
 * Not for: Python, state allocation, the non-finite pre-check (optim_util.h). */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <stdlib.h>

#include "simd.h"
#include "optim_simd.h"
#include "sgd.h"

typedef struct {
    float *param, *buf, *mirror;
    const void *grad;
    void *lp_out;
    acc_dtype grad_dtype, lp_dtype;
    int scaled, maximize, has_wd, init_buf, nesterov, nt;
    float grad_scale, wd, momentum, one_m_damp, neg_lr;
} sgd_item;

#define ACC_ISA_BODY "sgd_body.inc"
#include "isa_instances.inc"

static void sgd_seg(void *ctx, size_t seg, size_t lo, size_t hi) {
    const sgd_item *t = (const sgd_item *)ctx + seg;
    ACC_SIMD_CALL(acc_simd_level_get(), sgd_range, t, lo, hi);
}

acc_status acc_sgd_step(const acc_sgd_config *cfg, const acc_sgd_tensor *ts, size_t nt, int nthreads) {
    if (nt == 0) return ACC_OK;
    for (size_t k = 0; k < nt; k++) {
        const acc_sgd_tensor *x = &ts[k];
        acc_status st = acc_optim_check_dtypes(k, x->grad_dtype, x->lp_out, x->lp_dtype);
        if (st) return st;
        if (cfg->momentum != 0.0 && !x->momentum_buf) {
            acc_set_error("tensor %zu: momentum != 0 needs a momentum buffer", k);
            return ACC_ERR_ARG;
        }
        if (x->n && (!x->param || !x->grad)) {
            acc_set_error("tensor %zu: missing buffer", k);
            return ACC_ERR_ARG;
        }
    }
    sgd_item *items = (sgd_item *)calloc(nt, sizeof(sgd_item));
    size_t *ns = (size_t *)malloc(nt * sizeof(size_t));
    if (!items || !ns) {
        free(items);
        free(ns);
        return ACC_ERR_NOMEM;
    }
    size_t lp_total = 0;
    for (size_t k = 0; k < nt; k++) {
        const acc_sgd_tensor *x = &ts[k];
        items[k] = (sgd_item){
            .param = x->param, .buf = cfg->momentum != 0.0 ? x->momentum_buf : NULL, .grad = x->grad,
            .lp_out = x->lp_out, .mirror = x->mirror, .grad_dtype = x->grad_dtype, .lp_dtype = x->lp_dtype,
            .scaled = cfg->grad_scale != 1.0, .maximize = cfg->maximize, .has_wd = cfg->weight_decay != 0.0,
            .init_buf = x->init_buf, .nesterov = cfg->nesterov,
            .grad_scale = (float)cfg->grad_scale, .wd = (float)cfg->weight_decay, .momentum = (float)cfg->momentum,
            .one_m_damp = (float)(1.0 - cfg->dampening), .neg_lr = (float)(-cfg->lr),
        };
        ns[k] = x->n;
        lp_total += x->lp_out ? x->n : 0;
    }
    for (size_t k = 0; k < nt; k++) items[k].nt = lp_total >= ACC_OPTIM_NT_MIN;
    acc_status st = acc_segments_parallel(ns, nt, nthreads, sgd_seg, items);
    free(items);
    free(ns);
    return st;
}
