/* gradops.h: fused passes over many gradient buffers at once, for mixed-precision training steps:
 * non-finite check + unscale (torch._amp_foreach_non_finite_check_and_unscale_), the global norm used by
 * gradient clipping (torch.nn.utils.clip_grad_norm_'s total norm), and "multiply every gradient by one
 * factor" (applying the clip coefficient). All buffers are flattened into one index space, split over
 * threads, so many small tensors cost one call and one thread launch. Not for: Python, strided buffers.
 *
 * Interface shape (pointers, sizes, dtypes, stream) so a CUDA variant can take the same arguments; on the
 * CPU `stream` must be NULL. Supported dtypes: F32, BF16, F16 (values are computed in fp32 and rounded
 * back to nearest-even, like torch's opmath). */
#ifndef ACC_KERNELS_GRADOPS_H
#define ACC_KERNELS_GRADOPS_H

#include "acc.h"

typedef struct {
    void *data;
    size_t n;        /* elements */
    acc_dtype dtype;
} acc_buf;

/* For every element x of every buffer: if x is not finite (checked before scaling, like torch), set
 * *found_inf = 1.0f (found_inf may be NULL: no check); then x = round(x * factor), skipped entirely when
 * factor == 1.0f (torch leaves the values untouched then too). */
acc_status acc_multi_scale(const acc_buf *bufs, size_t nbufs, float factor, float *found_inf, int nthreads,
                           void *stream);

/* Global norm over all elements of all buffers: norm_type 2.0 (sqrt of the sum of squares), 1.0 (sum of
 * |x|) or INFINITY (max |x|). Accumulated in fp64 per chunk, chunks combined in index order, so for a
 * given thread count and SIMD level the result is deterministic; the relative error of the fp64 sum is
 * ~1e-15, far below fp32 rounding. Any NaN gives NaN, any inf (without NaN) gives inf. */
acc_status acc_multi_norm(const acc_buf *bufs, size_t nbufs, double norm_type, double *out, int nthreads,
                          void *stream);

#endif
