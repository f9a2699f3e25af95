/* optim_simd.h: per-ISA vector helpers for the optimizer kernels, and the macro sets that the shared
 * update bodies (adam_body.inc, sgd_body.inc) are instantiated with: one body text, three ISAs, so the
 * scalar, AVX2 and AVX-512 paths perform the same IEEE operations in the same order and give identical bits.
 * Include only from compute files compiled with `#pragma GCC optimize("fp-contract=off")` (no implicit FMA:
 * every FMA is written out as ACC_VFMA / fmaf).
 * Not for: anything beyond element-wise float32 math with fp32/bf16/fp16 loads and bf16/fp16 stores. */
#ifndef ACC_OPTIM_SIMD_H
#define ACC_OPTIM_SIMD_H

#include <math.h>

#include "optim_util.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ACC_OPTIM_X86 1
#define ACC_T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512cd,fma,f16c")))
#define ACC_T256 __attribute__((target("avx2,fma,f16c")))

ACC_T512 static inline __m512 acc_ld_g512(const void *g, acc_dtype dt, size_t i) {
    if (dt == ACC_F32) return _mm512_loadu_ps((const float *)g + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i));
    if (dt == ACC_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* Stores 16 rounded halves. nt: non-temporal store when the destination is 32-byte aligned (the copy is not
 * read back by this pass, so this saves the write-allocate read: 30 -> 28 B/param for Adam + bf16 copy). */
ACC_T512 static inline void acc_st_lp512(void *o, acc_dtype dt, size_t i, __m512 x, int nt) {
    __m256i *dst = (__m256i *)((uint16_t *)o + i);
    __m256i h;
    if (dt == ACC_BF16) {
        __m512i u = _mm512_castps_si512(x);
        __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                         _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
        r = _mm512_srli_epi32(r, 16);
        r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
        h = _mm512_cvtepi32_epi16(r);
    } else {
        h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    if (nt && ((uintptr_t)dst & 31) == 0) _mm256_stream_si256(dst, h);
    else _mm256_storeu_si256(dst, h);
}

ACC_T256 static inline __m256 acc_ld_g256(const void *g, acc_dtype dt, size_t i) {
    if (dt == ACC_F32) return _mm256_loadu_ps((const float *)g + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)g + i));
    if (dt == ACC_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

ACC_T256 static inline void acc_st_lp256(void *o, acc_dtype dt, size_t i, __m256 x, int nt) {
    __m128i *dst = (__m128i *)((uint16_t *)o + i);
    __m128i h;
    if (dt == ACC_BF16) {
        __m256i u = _mm256_castps_si256(x);
        __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                         _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
        r = _mm256_srli_epi32(r, 16);
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
        h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    } else {
        h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    if (nt && ((uintptr_t)dst & 15) == 0) _mm_stream_si128(dst, h);
    else _mm_storeu_si128(dst, h);
}
#endif

/* Calls whose low-precision copies total at least this many elements use non-temporal stores for them
 * (smaller copies may still be in cache when the next forward pass reads them). */
#define ACC_OPTIM_NT_MIN ((size_t)1 << 21)

#endif
