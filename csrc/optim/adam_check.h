/* adam_check.h: the argument rules every Adam tensor passes whatever its state and device: gradient and
 * low-precision-copy dtypes, the state dtype, amsgrad's buffer, missing buffers, the 8-bit state's block scales and
 * block-aligned slices. The CPU step (adam.c, adam_lowbit.c) and the CUDA step (csrc/cuda/optim.cu) describe a
 * tensor by the fields below and check it here; each adds only its own rule for the step count (host double vs
 * device counter). Header-only: the CUDA extension does not link the CPU objects.
 * Not for: the update itself (adam_math.h) or Python. */
#ifndef ACC_ADAM_CHECK_H
#define ACC_ADAM_CHECK_H

#include <stddef.h>
#include <stdint.h>

#include "acc.h"
#include "optim/adam_math.h"
#include "optim/optim_util.h"
#include "optim/qmap.h"

typedef struct {
    acc_dtype grad_dtype, lp_dtype, state_dtype;
    const void *lp_out;     /* the low-precision copy or NULL */
    int has_buffers;        /* param, grad, exp_avg and exp_avg_sq all given */
    int has_max;            /* max_exp_avg_sq given */
    int has_absmax;         /* both 8-bit block-scale arrays given */
    uint64_t n, offset;
} acc_adam_shape;

/* ACC_OK, or the failing rule's status with the error text naming tensor k */
static inline acc_status acc_adam_check_shape(const acc_adam_config *cfg, size_t k, const acc_adam_shape *s) {
    acc_status st = acc_optim_check_dtypes(k, s->grad_dtype, s->lp_out, s->lp_dtype);
    if (st) return st;
    if (s->state_dtype != ACC_F32 && s->state_dtype != ACC_BF16 && s->state_dtype != ACC_U8) {
        acc_set_error("tensor %zu: state dtype %s is not supported (float32, bfloat16, 8-bit codes)", k,
                      acc_dtype_name(s->state_dtype));
        return ACC_ERR_DTYPE;
    }
    if (cfg->amsgrad && (!s->has_max || s->state_dtype != ACC_F32)) {
        acc_set_error("tensor %zu: amsgrad needs max_exp_avg_sq and float32 state", k);
        return ACC_ERR_ARG;
    }
    if (s->n && !s->has_buffers) {
        acc_set_error("tensor %zu: missing buffer", k);
        return ACC_ERR_ARG;
    }
    if (s->state_dtype == ACC_U8 && s->n && !s->has_absmax) {
        acc_set_error("tensor %zu: 8-bit state needs exp_avg_absmax and exp_avg_sq_absmax", k);
        return ACC_ERR_ARG;
    }
    if (s->state_dtype == ACC_U8 && s->offset % ACC_QBLOCK) {
        acc_set_error("tensor %zu: an 8-bit state slice must start on a %d-element block (offset %llu)", k,
                      ACC_QBLOCK, (unsigned long long)s->offset);
        return ACC_ERR_ARG;
    }
    return ACC_OK;
}

/* An initializer of the shape of either tensor struct (adam.h acc_adam_tensor, cuda/kernels.h acc_cuda_adam_tensor:
 * same field names): acc_adam_shape s = ACC_ADAM_SHAPE_INIT(x); */
#define ACC_ADAM_SHAPE_INIT(x)                                                                                    \
    {(x)->grad_dtype, (x)->lp_dtype, (x)->state_dtype, (x)->lp_out,                                               \
     (x)->param && (x)->grad && (x)->exp_avg && (x)->exp_avg_sq, (x)->max_exp_avg_sq != NULL,                     \
     (x)->exp_avg_absmax && (x)->exp_avg_sq_absmax, (x)->n, (x)->offset}

#endif
