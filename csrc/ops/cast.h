/* cast.h: element-wise dtype casts with an optional fp32 scale and a fused amax, for mixed precision and
 * fp8 (per-tensor "current" or "delayed" scaling: the amax of the tensor being cast comes out of the same
 * pass). Not for: Python (the binding is bind_ops.c), strided tensors (callers make inputs contiguous),
 * or reductions over many tensors (gradops.h).
 *
 * Semantics, bit for bit those of torch 2.13 on the CPU (see fpconv.h for NaN encodings):
 *   y = to(dst_dtype, x_fp32 * scale)                        for bf16 / fp16 / fp32 outputs
 *   y = to(dst_dtype, clamp(x_fp32 * scale, -max, max))      for float8 outputs (saturating, NaN kept)
 * where x_fp32 is the exact fp32 value of x and the product is one fp32 multiply (round to nearest even,
 * current MXCSR mode; no multiply at all when scale is NULL). amax = max |x| over the input *before*
 * scaling, as fp32; NaN anywhere gives a NaN amax (canonical 0x7FC00000); an empty input gives 0.
 *
 * Interface shape (pointer, size, dtype, stream) so a CUDA variant can take the same arguments; on the
 * CPU `stream` must be NULL. `scale` and `amax_out` are host pointers here (device pointers in a CUDA
 * variant). Work is split over `nthreads` threads; every thread count and SIMD level gives the same
 * bits. */
#ifndef ACC_KERNELS_CAST_H
#define ACC_KERNELS_CAST_H

#include "acc.h"

/* src: n elements of src_dtype (F32, BF16, F16); dst: n elements of dst_dtype (F32, BF16, F16, E4M3,
 * E5M2). src and dst must not overlap unless they are the same buffer with the same element size.
 * scale: NULL or one fp32 value. amax_out: NULL or where to write max|x| (fp32). */
acc_status acc_cast(const void *src, acc_dtype src_dtype, void *dst, acc_dtype dst_dtype, size_t n,
                    const float *scale, float *amax_out, int nthreads, void *stream);

/* One span on the calling thread, no scale, no amax: dst[0..n) = src[0..n) converted exactly as acc_cast
 * does (same bits, same NaN patterns) at the current SIMD level. For kernels that split their own work over
 * threads (pack.c). Arguments are not checked: src F32/BF16/F16, dst F32/BF16/F16/E4M3/E5M2, no overlap.
 * nt: streaming stores for the 64-byte-aligned part (the caller's sfence is not needed: the span issues one). */
void acc_cast_span(const void *src, acc_dtype src_dtype, void *dst, acc_dtype dst_dtype, size_t n, int nt);

/* Output bytes above which the cast uses non-temporal stores (the output would not stay in cache anyway,
 * and streaming stores skip the read-for-ownership of the destination). */
#define ACC_CAST_NT_BYTES ((size_t)16 << 20)

#endif
