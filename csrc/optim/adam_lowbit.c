/* adam_lowbit.c: the fused Adam/AdamW step with exp_avg / exp_avg_sq held in bf16 (stochastic rounding on the
 * write) or in 8-bit block-wise codes (qmap.h), in the one pass of adam.c's kernel: load the state and widen it
 * to fp32, the same update as adam.h (same operation order, so the fp32 math is adam.c's), then narrow it back.
 * The 8-bit path works a block of ACC_QBLOCK elements at a time: the updated fp32 m and v stay in an L1 buffer
 * until the block's new absmax is known, then are requantised; threads get whole blocks, so nothing depends on
 * the thread count. DRAM traffic per parameter: fp32 grad 4 + param 4+4 + state 2+2 (8-bit) or 4+4 (bf16).
 * Not for: fp32 state or amsgrad (adam.c; bind_optim.c splits a call between the two), Python, state allocation. */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <stdlib.h>

#include "adam.h"
#include "simd.h"
#include "optim_simd.h"
#include "qmap.h"
#include "adam_update.h"

typedef struct {
    float *param, *mirror, *absm, *absv;
    void *m, *v, *lp_out;
    const void *grad;
    size_t n;
    uint64_t offset;
    uint32_t seed;
    acc_dtype grad_dtype, lp_dtype;
    int nt;
    acc_adam_scalars c;
} lowbit_item;

/* One element of the update in scalar float ops, in adam.h's order: the vector bodies' tails (adam_math.h). */
static inline float lb_update1(const acc_adam_scalars *c, float g, float *p, float *m, float *v) {
    return acc_adam_update1(c, g, p, m, v, NULL);
}

#define ACC_ISA_BODY "adam_lowbit_body.inc"
#define ACC_ISA_LOWBIT
#include "isa_instances.inc"

static void q8_seg(void *ctx, size_t seg, size_t lo, size_t hi) {
    const lowbit_item *t = ((const lowbit_item *const *)ctx)[seg];
    ACC_SIMD_CALL(acc_simd_level_get(), adam_q8_blocks, t, lo, hi);
}

static void bf16s_seg(void *ctx, size_t seg, size_t lo, size_t hi) {
    const lowbit_item *t = ((const lowbit_item *const *)ctx)[seg];
    ACC_SIMD_CALL(acc_simd_level_get(), adam_bf16s_range, t, lo, hi);
}

/* acc_adam_check_tensor has run: only the state dtype's split is left (fp32 state is acc_adam_step's) */
static acc_status check(size_t k, const acc_adam_tensor *x) {
    if (x->state_dtype != ACC_BF16 && x->state_dtype != ACC_U8) {
        acc_set_error("tensor %zu: state dtype %s is acc_adam_step's", k, acc_dtype_name(x->state_dtype));
        return ACC_ERR_DTYPE;
    }
    return ACC_OK;
}

acc_status acc_adam_lowbit_step(const acc_adam_config *cfg, const acc_adam_tensor *const *ts, size_t nt,
                                int nthreads) {
    for (size_t k = 0; k < nt; k++) {
        acc_status st = acc_adam_check_tensor(cfg, k, ts[k]);
        if (!st) st = check(k, ts[k]);
        if (st) return st;
    }
    lowbit_item *items = (lowbit_item *)calloc(nt ? nt : 1, sizeof(lowbit_item));
    const lowbit_item **q8 = (const lowbit_item **)malloc((nt ? nt : 1) * sizeof(*q8));
    const lowbit_item **b16 = (const lowbit_item **)malloc((nt ? nt : 1) * sizeof(*b16));
    size_t *n8 = (size_t *)malloc((nt ? nt : 1) * sizeof(size_t));
    size_t *n16 = (size_t *)malloc((nt ? nt : 1) * sizeof(size_t));
    acc_status st = ACC_OK;
    if (!items || !q8 || !b16 || !n8 || !n16) {
        st = ACC_ERR_NOMEM;
        goto done;
    }
    size_t a = 0, b = 0, lp_total = 0;
    for (size_t k = 0; k < nt; k++) {
        const acc_adam_tensor *x = ts[k];
        lowbit_item *t = &items[k];
        *t = (lowbit_item){
            .param = x->param, .mirror = x->mirror, .absm = x->exp_avg_absmax, .absv = x->exp_avg_sq_absmax,
            .m = x->exp_avg, .v = x->exp_avg_sq, .lp_out = x->lp_out, .grad = x->grad, .n = x->n,
            .offset = x->offset, .seed = acc_sr_seed(x->step, x->salt), .grad_dtype = x->grad_dtype,
            .lp_dtype = x->lp_dtype,
        };
        acc_adam_scalars_for(cfg, x->step, &t->c);
        lp_total += x->lp_out ? x->n : 0;
        if (x->state_dtype == ACC_U8) {
            q8[a] = t;
            n8[a++] = (x->n + ACC_QBLOCK - 1) / ACC_QBLOCK;
        } else {
            b16[b] = t;
            n16[b++] = x->n;
        }
    }
    for (size_t k = 0; k < nt; k++) items[k].nt = lp_total >= ACC_OPTIM_NT_MIN;
    if (a) st = acc_segments_parallel_min(n8, a, nthreads, ACC_OPTIM_MIN_PER_THREAD / ACC_QBLOCK, q8_seg, q8);
    if (st == ACC_OK && b) st = acc_segments_parallel(n16, b, nthreads, bf16s_seg, b16);
done:
    free(items);
    free(q8);
    free(b16);
    free(n8);
    free(n16);
    return st;
}
