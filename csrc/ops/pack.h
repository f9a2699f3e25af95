/* pack.h: the sharded engine's copy-in: many source tensors gathered into one flat destination at given
 * element offsets, each converted to the destination's dtype (fp32 <-> bf16 / fp16, or a plain copy), every
 * element no piece covers (gaps between pieces, the padding tail) written as +0. This is what a unit's
 * reduce-scatter input (its parameters' gradients, in the reduce dtype) and a stage-3 gather input are built
 * with. Conversions are acc_cast's (cast.h: the bits of torch's .to(), round-to-nearest-even).
 * Not for: Python (the binding is bind_ops.c), strided sources, scaling, or overlapping pieces.
 *
 * Work is split over `nthreads` threads by destination element (acc_parallel_for), so a unit of many small
 * tensors and a unit of one big tensor split the same way; every thread count and SIMD level gives the same
 * bits. Interface shape (pointers, sizes, dtypes, stream) so a CUDA variant can take the same arguments; on the
 * CPU `stream` must be NULL. */
#ifndef ACC_KERNELS_PACK_H
#define ACC_KERNELS_PACK_H

#include "acc.h"

typedef struct {
    const void *src;   /* n elements of dtype */
    acc_dtype dtype;   /* ACC_F32, ACC_BF16, ACC_F16 */
    size_t offset;     /* first destination element */
    size_t n;
} acc_pack_piece;

/* dst[0..dst_n) of dst_dtype (F32, BF16, F16) = the pieces at their offsets, zeros elsewhere. Pieces must be in
 * increasing offset order, must not overlap one another, must lie inside dst and must not overlap dst's
 * memory. Everything is checked before any byte is written. */
acc_status acc_pack(const acc_pack_piece *pieces, size_t npieces, void *dst, acc_dtype dst_dtype, size_t dst_n,
                    int nthreads, void *stream);

#endif
