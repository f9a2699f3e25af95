/* optim_simd.h: per-ISA vector loads and stores by dtype for the optimizer kernels (on fpconv.h's conversions),
 * used by the macro sets (optim_ops.inc) that the shared update bodies (adam_body.inc, sgd_body.inc) are
 * instantiated with: one body text, three ISAs, so the
 * scalar, AVX2 and AVX-512 paths perform the same IEEE operations in the same order and give identical bits.
 * Include only from compute files compiled with `#pragma GCC optimize("fp-contract=off")` (no implicit FMA:
 * every FMA is written out as ACC_VFMA / fmaf).
 * Not for: anything beyond element-wise float32 math with fp32/bf16/fp16 loads and bf16/fp16 stores. */
#ifndef ACC_OPTIM_SIMD_H
#define ACC_OPTIM_SIMD_H

#include <math.h>

#include "optim_util.h"
#include "simd.h"

#ifdef ACC_X86

ACC_TARGET_AVX512 static inline __m512 acc_ld_g512(const void *g, acc_dtype dt, size_t i) {
    if (dt == ACC_F32) return _mm512_loadu_ps((const float *)g + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i));
    if (dt == ACC_BF16) return acc_bf16x16_to_f32(h);
    return acc_f16x16_to_f32(h);
}

/* Stores 16 rounded halves (bf16: NaN 0x7FC0, as acc_store_lp). nt: non-temporal store when the destination is
 * 32-byte aligned (the copy is not read back by this pass, so this saves the write-allocate read: 30 -> 28 B/param
 * for Adam + bf16 copy). */
ACC_TARGET_AVX512 static inline void acc_st_lp512(void *o, acc_dtype dt, size_t i, __m512 x, int nt) {
    __m256i *dst = (__m256i *)((uint16_t *)o + i);
    __m256i h;
    if (dt == ACC_BF16) h = acc_f32x16_to_bf16(x, 0x7fc0);
    else h = acc_f32x16_to_f16(x);
    if (nt && ((uintptr_t)dst & 31) == 0) _mm256_stream_si256(dst, h);
    else _mm256_storeu_si256(dst, h);
}

ACC_TARGET_AVX2 static inline __m256 acc_ld_g256(const void *g, acc_dtype dt, size_t i) {
    if (dt == ACC_F32) return _mm256_loadu_ps((const float *)g + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)g + i));
    if (dt == ACC_BF16) return acc_bf16x8_to_f32(h);
    return acc_f16x8_to_f32(h);
}

ACC_TARGET_AVX2 static inline void acc_st_lp256(void *o, acc_dtype dt, size_t i, __m256 x, int nt) {
    __m128i *dst = (__m128i *)((uint16_t *)o + i);
    __m128i h;
    if (dt == ACC_BF16) h = acc_f32x8_to_bf16(x, 0x7fc0);
    else h = acc_f32x8_to_f16(x);
    if (nt && ((uintptr_t)dst & 15) == 0) _mm_stream_si128(dst, h);
    else _mm_storeu_si128(dst, h);
}
#endif

/* Calls whose low-precision copies total at least this many elements use non-temporal stores for them
 * (smaller copies may still be in cache when the next forward pass reads them). */
#define ACC_OPTIM_NT_MIN ((size_t)1 << 21)

#endif
