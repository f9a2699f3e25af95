/* fpconv.h: exact scalar conversions between fp32 and bf16 / fp16 / float8 (e4m3fn, e5m2), written to
 * give the same bits as torch 2.13's CPU vectorised casts (and as the F16C instructions for fp16).
 * These are the reference the SIMD paths in cast.c must match bit for bit, and the scalar fallback.
 * Not for: anything that needs Python, or rounding modes other than round-to-nearest-even (one exception:
 * acc_f32_to_bf16_sr, the stochastic rounding the bf16 optimizer state is written with).
 *
 * NaN encodings chosen (what torch 2.13 produces on its vectorised path):
 *   fp32 -> bf16 : 0xFFFF for every NaN (ATen's vec trick); torch's scalar c10 path gives 0x7FC0, which
 *                  torch uses for fp16 -> bf16 without a multiply, so the caller picks the pattern.
 *   fp32 -> fp16 : sign | 0x7E00 | top mantissa bits (what vcvtps2ph does: quiet bit set, payload kept).
 *   fp16 -> fp32 : sign | 0x7FC00000 | mantissa << 13 (vcvtph2ps: quiet bit set).
 *   bf16 -> fp32 : plain shift (signalling NaNs stay signalling).
 *   fp32 -> fp8  : sign | 0x7F for both formats; finite overflow saturates to +-max (448 / 57344),
 *                  as torch's clamp(-max, max) before .to() does; +-inf also saturates. */
#ifndef ACC_FPCONV_H
#define ACC_FPCONV_H

#include <stdint.h>
#include <string.h>

static inline uint32_t acc_f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float acc_u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float acc_bf16_to_f32(uint16_t h) { return acc_u2f((uint32_t)h << 16); }

static inline float acc_f16_to_f32(uint16_t h) {
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
static inline uint32_t acc_rne_subnormal(uint32_t a, int k) {
    uint32_t e = a >> 23;
    if (e == 0) return 0; /* fp32 subnormal: far below half the smallest target subnormal */
    int sh = 150 - k - (int)e; /* >= 13 for every caller */
    if (sh > 24) return 0;     /* < half a unit, never a tie (mantissa < 2^24) */
    uint32_t m = (a & 0x7fffffu) | 0x800000u, q = m >> sh, r = m & ((1u << sh) - 1), h = 1u << (sh - 1);
    return q + (r > h || (r == h && (q & 1)));
}

static inline uint16_t acc_f32_to_bf16(float f, uint16_t nan) {
    uint32_t u = acc_f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return nan;
    u += 0x7fffu + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

/* fp32 -> bf16 with stochastic rounding: the 16 bits dropped are compared with `rnd` (uniform in
 * [0, 2^16)), so the result rounds up with probability (dropped bits) / 2^16 and E[result] = f. NaN -> 0x7FC0;
 * a finite value may round up to inf only from above the largest bf16 (as RNE would). The SIMD paths in
 * optim/lowbit_ops.inc do the same integer add and must give the same bits. */
static inline uint16_t acc_f32_to_bf16_sr(float f, uint32_t rnd) {
    uint32_t u = acc_f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + (rnd & 0xffffu)) >> 16);
}

static inline uint16_t acc_f32_to_f16(float f) {
    uint32_t u = acc_f2u(f), s = (u >> 16) & 0x8000, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(s | 0x7e00 | ((a >> 13) & 0x3ff));
    if (a >= 0x477ff000u) return (uint16_t)(s | 0x7c00); /* >= 65520 rounds to inf (ties to even) */
    if (a >= 0x38800000u) {                               /* >= 2^-14: normal fp16 */
        a = a - (112u << 23) + 0xfffu + ((a >> 13) & 1);
        return (uint16_t)(s | (a >> 13));
    }
    return (uint16_t)(s | acc_rne_subnormal(a, 24));
}

/* Saturating fp32 -> float8. e4m3fn: bias 7, 3 mantissa bits, max 448 (0x7E), NaN 0x7F.
 * e5m2: bias 15, 2 mantissa bits, max 57344 (0x7B), NaN 0x7F (inf 0x7C is never produced). */
static inline uint8_t acc_f32_to_e4m3(float f) {
    uint32_t u = acc_f2u(f), s = (u >> 24) & 0x80, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint8_t)(s | 0x7f);
    if (a >= 0x43e00000u) return (uint8_t)(s | 0x7e);            /* >= 448 */
    if (a < 0x3c800000u) return (uint8_t)(s | acc_rne_subnormal(a, 9)); /* < 2^-6 */
    a = a - (120u << 23) + 0x7ffffu + ((a >> 20) & 1);
    return (uint8_t)(s | (a >> 20));
}

static inline uint8_t acc_f32_to_e5m2(float f) {
    uint32_t u = acc_f2u(f), s = (u >> 24) & 0x80, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint8_t)(s | 0x7f);
    if (a >= 0x47600000u) return (uint8_t)(s | 0x7b);              /* >= 57344 */
    if (a < 0x38800000u) return (uint8_t)(s | acc_rne_subnormal(a, 16)); /* < 2^-14 */
    a = a - (112u << 23) + 0xfffffu + ((a >> 21) & 1);
    return (uint8_t)(s | (a >> 21));
}

#endif
