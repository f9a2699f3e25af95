/* fpconv.h: every conversion between fp32 and bf16 / fp16 / float8 (e4m3fn, e5m2), scalar and vector, written
 * to give the same bits as torch 2.13's CPU vectorised casts (and as the F16C instructions for fp16). The
 * scalar functions are the definition: the vector ones below (8 lanes AVX2, 16 lanes AVX-512) give their
 * bits lane by lane, and every kernel (ops/, optim/, shm/) converts through this file.
 * Not for: anything that needs Python, or rounding modes other than round-to-nearest-even (one exception:
 * the stochastic rounding the bf16 optimizer state is written with, acc_f32_to_bf16_sr).
 *
 * NaN encodings chosen (what torch 2.13 produces on its vectorised path):
 *   fp32 -> bf16 : 0xFFFF for every NaN (ATen's vec trick); torch's scalar c10 path gives 0x7FC0, which
 *                  torch uses for fp16 -> bf16 without a multiply, so the caller picks the pattern
 *                  (acc_f32_to_bf16(x, nan)). Who uses which: casts 0xFFFF (0x7FC0 for unscaled fp16 ->
 *                  bf16), gradient scaling 0xFFFF, the optimizers' bf16 copies and bf16 state 0x7FC0.
 *                  The shm reduction keeps the NaN instead: acc_f32_to_bf16_quiet, sign and top payload
 *                  bits kept, quiet bit set (vcvtneps2bf16's rule), so a reduced NaN keeps its sign.
 *   fp32 -> fp16 : sign | 0x7E00 | top mantissa bits (what vcvtps2ph does: quiet bit set, payload kept).
 *   fp16 -> fp32 : sign | 0x7FC00000 | mantissa << 13 (vcvtph2ps: quiet bit set).
 *   bf16 -> fp32 : plain shift (signalling NaNs stay signalling).
 *   fp32 -> fp8  : sign | 0x7F for both formats; finite overflow saturates to +-max (448 / 57344),
 *                  as torch's clamp(-max, max) before .to() does; +-inf also saturates.
 * On a CUDA device torch converts with the hardware's cvt instructions, whose NaN is canonical: fp32 -> bf16
 * 0x7FFF and fp32 -> fp16 0x7FFF (ACC_CUDA_NAN16); the CUDA casts (csrc/cuda/) pass that pattern, every finite
 * value gets the same bits as here (round to nearest even either way). Unverified on a GPU so far.
 *
 * The scalar functions are ACC_HD (acc.h): nvcc compiles them for the device as well, from this one text. */
#ifndef ACC_FPCONV_H
#define ACC_FPCONV_H
#define ACC_CUDA_NAN16 ((uint16_t)0x7fff)

#include <stdint.h>
#include <string.h>

#include "acc.h"
#ifdef __CUDACC__
/* nvcc (csrc/cuda/): the scalar definitions only, for host and device (ACC_HD); no CPU vector code */
#ifndef ACC_AI
#define ACC_AI __attribute__((always_inline))
#endif
#else
#include "simd.h"
#endif

#ifdef __CUDA_ARCH__
static inline ACC_HD uint32_t acc_f2u(float f) { return __float_as_uint(f); }
static inline ACC_HD float acc_u2f(uint32_t u) { return __uint_as_float(u); }
#else
static inline ACC_HD uint32_t acc_f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline ACC_HD float acc_u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
#endif

static inline ACC_AI ACC_HD float acc_bf16_to_f32(uint16_t h) { return acc_u2f((uint32_t)h << 16); }

static inline ACC_HD float acc_f16_to_f32(uint16_t h) {
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0x1f) return acc_u2f(s | 0x7f800000u | (m ? 0x400000u | (m << 13) : 0));
    if (e == 0) { /* zero or subnormal: m * 2^-24, exact in fp32 */
        float f = (float)m * 0x1p-24f;
        return acc_u2f(acc_f2u(f) | s);
    }
    return acc_u2f(s | ((e + 112) << 23) | (m << 13));
}

/* |x| (bits a, sign cleared, finite, below the target's smallest normal) rounded to nearest-even in
 * units of 2^-k, where k = bias - 1 + mantissa_bits of the target (fp16: 24, e4m3: 9, e5m2: 16). The
 * result may equal 2^mantissa_bits, which is the encoding of the smallest normal: no special case. */
static inline ACC_HD uint32_t acc_rne_subnormal(uint32_t a, int k) {
    uint32_t e = a >> 23;
    if (e == 0) return 0; /* fp32 subnormal: far below half the smallest target subnormal */
    int sh = 150 - k - (int)e; /* >= 13 for every caller */
    if (sh > 24) return 0;     /* < half a unit, never a tie (mantissa < 2^24) */
    uint32_t m = (a & 0x7fffffu) | 0x800000u, q = m >> sh, r = m & ((1u << sh) - 1), h = 1u << (sh - 1);
    return q + (r > h || (r == h && (q & 1)));
}

/* round to nearest even; every NaN -> nan. Branch-free, so loops over it vectorise. */
static inline ACC_AI ACC_HD uint16_t acc_f32_to_bf16(float f, uint16_t nan) {
    uint32_t u = acc_f2u(f);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : r);
}

/* The same rounding; a NaN keeps its sign and top 7 payload bits and gets the quiet bit ((bits >> 16) | 0x40):
 * the shm reduction's rule (a bf16 NaN that is widened, reduced and narrowed comes back as itself, quietened). */
static inline ACC_AI ACC_HD uint16_t acc_f32_to_bf16_quiet(float f) {
    uint32_t u = acc_f2u(f);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t q = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? q : r);
}

/* fp32 -> bf16 with stochastic rounding: the 16 bits dropped are compared with `rnd` (uniform in
 * [0, 2^16)), so the result rounds up with probability (dropped bits) / 2^16 and E[result] = f. NaN -> 0x7FC0;
 * a finite value may round up to inf only from above the largest bf16 (as RNE would). The SIMD paths in
 * optim/lowbit_ops.inc do the same integer add and must give the same bits. */
static inline ACC_HD uint16_t acc_f32_to_bf16_sr(float f, uint32_t rnd) {
    uint32_t u = acc_f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + (rnd & 0xffffu)) >> 16);
}

static inline ACC_HD uint16_t acc_f32_to_f16(float f) {
    uint32_t u = acc_f2u(f), s = (u >> 16) & 0x8000, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(s | 0x7e00 | ((a >> 13) & 0x3ff));
    if (a >= 0x477ff000u) return (uint16_t)(s | 0x7c00); /* >= 65520 rounds to inf (ties to even) */
    if (a >= 0x38800000u) {                               /* >= 2^-14: normal fp16 */
        a = a - (112u << 23) + 0xfffu + ((a >> 13) & 1);
        return (uint16_t)(s | (a >> 13));
    }
    return (uint16_t)(s | acc_rne_subnormal(a, 24));
}

#if defined(__FLT16_MAX__) && !defined(__CUDACC__)
/* fp16 as the compiler's _Float16 (vcvtph2ps / vcvtps2ph in AVX2 and AVX-512 functions, libgcc's soft-float
 * otherwise, which gcc vectorises over _Float16 arrays: shm/shm_reduce.c). The same bits as acc_f16_to_f32 /
 * acc_f32_to_f16 for every input (checked for all 65536 halves and 4e7 floats, NaN payloads included). */
static inline ACC_AI float acc_f16n_to_f32(_Float16 h) { return (float)h; }
static inline ACC_AI _Float16 acc_f32_to_f16n(float f) { return (_Float16)f; }
#endif

/* Saturating fp32 -> float8. e4m3fn: bias 7, 3 mantissa bits, max 448 (0x7E), NaN 0x7F.
 * e5m2: bias 15, 2 mantissa bits, max 57344 (0x7B), NaN 0x7F (inf 0x7C is never produced). */
static inline ACC_HD uint8_t acc_f32_to_e4m3(float f) {
    uint32_t u = acc_f2u(f), s = (u >> 24) & 0x80, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint8_t)(s | 0x7f);
    if (a >= 0x43e00000u) return (uint8_t)(s | 0x7e);            /* >= 448 */
    if (a < 0x3c800000u) return (uint8_t)(s | acc_rne_subnormal(a, 9)); /* < 2^-6 */
    a = a - (120u << 23) + 0x7ffffu + ((a >> 20) & 1);
    return (uint8_t)(s | (a >> 20));
}

static inline ACC_HD uint8_t acc_f32_to_e5m2(float f) {
    uint32_t u = acc_f2u(f), s = (u >> 24) & 0x80, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint8_t)(s | 0x7f);
    if (a >= 0x47600000u) return (uint8_t)(s | 0x7b);              /* >= 57344 */
    if (a < 0x38800000u) return (uint8_t)(s | acc_rne_subnormal(a, 16)); /* < 2^-14 */
    a = a - (112u << 23) + 0xfffffu + ((a >> 21) & 1);
    return (uint8_t)(s | (a >> 21));
}


/* ---- vectors: lane i gives the scalar function's bits for element i ------------------------------------ */
#ifdef ACC_X86
static inline ACC_AI ACC_TARGET_AVX2 __m256 acc_bf16x8_to_f32(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline ACC_AI ACC_TARGET_AVX512 __m512 acc_bf16x16_to_f32(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline ACC_AI ACC_TARGET_AVX2 __m256 acc_f16x8_to_f32(__m128i h) { return _mm256_cvtph_ps(h); }

static inline ACC_AI ACC_TARGET_AVX512 __m512 acc_f16x16_to_f32(__m256i h) { return _mm512_cvtph_ps(h); }

/* acc_f32_to_bf16(x, nan) per lane */
static inline ACC_AI ACC_TARGET_AVX2 __m128i acc_f32x8_to_bf16(__m256 x, uint16_t nan) {
    __m256i u = _mm256_castps_si256(x);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                     _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    r = _mm256_srli_epi32(r, 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(nan), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)); /* each lane <= 0xFFFF */
}

static inline ACC_AI ACC_TARGET_AVX512 __m256i acc_f32x16_to_bf16(__m512 x, uint16_t nan) {
    __m512i u = _mm512_castps_si512(x);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_srli_epi32(r, 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(nan));
    return _mm512_cvtepi32_epi16(r);
}

/* acc_f32_to_bf16_sr(x, r) per lane (r's low 16 bits) */
static inline ACC_AI ACC_TARGET_AVX2 __m128i acc_f32x8_to_bf16_sr(__m256 x, __m256i r) {
    __m256i u = _mm256_castps_si256(x);
    __m256i h = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_and_si256(r, _mm256_set1_epi32(0xffff))), 16);
    h = _mm256_blendv_epi8(h, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* The same for 16 lanes, x0's 8 then x1's, as one vector of 16 bf16; r0 / r1 must already be below 2^16 (the caller's
 * mask or shift). NaN lanes take 0x7fc0 in the 32-bit sums, then one byte shuffle per vector moves each sum's top
 * half into its 128-bit lane's low (x0) or high (x1) 8 bytes, a dword blend joins them and a qword permute restores
 * the order: three shuffle-port ops for 16 lanes instead of six (shifts, extracts, packs), the port the Adam
 * update's divisions leave to everything else on Zen 3. */
static inline ACC_AI ACC_TARGET_AVX2 __m256i acc_f32x8x2_to_bf16_sr16(__m256 x0, __m256 x1, __m256i r0, __m256i r1) {
    const __m256i qnan = _mm256_set1_epi32(0x7fc00000);
    const __m256i lo = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                        2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i hi = _mm256_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7, 10, 11, 14, 15,
                                        -1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7, 10, 11, 14, 15);
    __m256i s0 = _mm256_blendv_epi8(_mm256_add_epi32(_mm256_castps_si256(x0), r0), qnan,
                                    _mm256_castps_si256(_mm256_cmp_ps(x0, x0, _CMP_UNORD_Q)));
    __m256i s1 = _mm256_blendv_epi8(_mm256_add_epi32(_mm256_castps_si256(x1), r1), qnan,
                                    _mm256_castps_si256(_mm256_cmp_ps(x1, x1, _CMP_UNORD_Q)));
    __m256i h = _mm256_blend_epi32(_mm256_shuffle_epi8(s0, lo), _mm256_shuffle_epi8(s1, hi), 0xcc);
    return _mm256_permute4x64_epi64(h, 0xd8);
}

static inline ACC_AI ACC_TARGET_AVX512 __m256i acc_f32x16_to_bf16_sr(__m512 x, __m512i r) {
    __m512i u = _mm512_castps_si512(x);
    __m512i h = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_and_si512(r, _mm512_set1_epi32(0xffff))), 16);
    h = _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(h);
}

/* The same for 32 lanes, x0's 16 then x1's, as one vector of 32 bf16; r0 / r1 must already be below 2^16 (the
 * caller's mask or shift), so the sums need no mask. The top halves of the sums are taken with one two-source
 * word permute instead of two shifts and two narrowing moves, and the NaN lanes are patched in one masked move. */
static inline ACC_AI ACC_TARGET_AVX512 __m512i acc_f32x32_to_bf16_sr16(__m512 x0, __m512 x1, __m512i r0, __m512i r1) {
    static const uint16_t odd_words[32] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
                                           33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
    const __m512i odd = _mm512_loadu_si512((const void *)odd_words);
    __m512i s0 = _mm512_add_epi32(_mm512_castps_si512(x0), r0), s1 = _mm512_add_epi32(_mm512_castps_si512(x1), r1);
    __m512i h = _mm512_permutex2var_epi16(s0, odd, s1);
    __mmask32 nan = _mm512_kunpackw((__mmask32)_mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q),
                                    (__mmask32)_mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q));
    return _mm512_mask_mov_epi16(h, nan, _mm512_set1_epi16(0x7fc0));
}

static inline ACC_AI ACC_TARGET_AVX2 __m128i acc_f32x8_to_f16(__m256 x) {
    return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

static inline ACC_AI ACC_TARGET_AVX512 __m256i acc_f32x16_to_f16(__m512 x) {
    return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* acc_f32_to_e4m3 (e4 != 0) or acc_f32_to_e5m2 per lane: AVX2 gives the codes in 32-bit lanes (the caller packs
 * two vectors into one 16-byte store), AVX-512 the 16 bytes. */
static inline ACC_AI ACC_TARGET_AVX2 __m256i acc_f32x8_to_fp8_lanes(__m256 v, const int e4) {
    const int sh = e4 ? 20 : 21;
    const uint32_t maxb = e4 ? 0x43e00000u : 0x47600000u, minn = e4 ? 0x3c800000u : 0x38800000u;
    const uint32_t adj = (uint32_t)0 - ((e4 ? 120u : 112u) << 23) + ((1u << (sh - 1)) - 1);
    const float k = e4 ? 0x1p9f : 0x1p16f;
    __m256i u = _mm256_castps_si256(v), a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    __m256i s = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
    __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000));
    __m256i sat = _mm256_cmpgt_epi32(a, _mm256_set1_epi32((int)maxb - 1));
    __m256i sub = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)minn), a);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, sh), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32((int)adj)), odd), sh);
    __m256 scaled = _mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(k)); /* exact: power of two */
    __m256i q = _mm256_cvttps_epi32(_mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    r = _mm256_blendv_epi8(r, q, sub);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(e4 ? 0x7e : 0x7b), sat);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7f), nan);
    return _mm256_or_si256(r, s);
}

static inline ACC_AI ACC_TARGET_AVX512 __m128i acc_f32x16_to_fp8(__m512 v, const int e4) {
    const int sh = e4 ? 20 : 21;
    const uint32_t maxb = e4 ? 0x43e00000u : 0x47600000u, minn = e4 ? 0x3c800000u : 0x38800000u;
    const uint32_t adj = (uint32_t)0 - ((e4 ? 120u : 112u) << 23) + ((1u << (sh - 1)) - 1);
    const float k = e4 ? 0x1p9f : 0x1p16f;
    __m512i u = _mm512_castps_si512(v), a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    __m512i s = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
    __mmask16 nan = _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7f800000));
    __mmask16 sat = _mm512_cmpge_epi32_mask(a, _mm512_set1_epi32((int)maxb));
    __mmask16 sub = _mm512_cmplt_epi32_mask(a, _mm512_set1_epi32((int)minn));
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, sh), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32((int)adj)), odd), sh);
    __m512 scaled = _mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(k)); /* exact: power of two */
    __m512i q = _mm512_cvt_roundps_epi32(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_mask_mov_epi32(r, sub, q);
    r = _mm512_mask_mov_epi32(r, sat, _mm512_set1_epi32(e4 ? 0x7e : 0x7b));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7f));
    return _mm512_cvtepi32_epi8(_mm512_or_si512(r, s));
}
#endif

#endif
