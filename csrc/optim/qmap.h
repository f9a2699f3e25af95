/* qmap.h: the definitions of the low-precision optimizer state: the 8-bit block-wise dynamic quantisation
 * (Dettmers et al., "8-bit Optimizers via Block-wise Quantization"): its code maps, the exact fp32 operations
 * that define quantise and dequantise, the block-level entry points; and the random bits of the bf16 state's
 * stochastic rounding. Every SIMD path (optim/lowbit_ops.inc) must give these functions' bits.
 * Not for: the Adam update itself (adam_lowbit.c) or Python.
 *
 * Blocks: a state tensor is cut into blocks of ACC_QBLOCK elements (the last may be shorter); each block stores
 * absmax = max |x| (fp32) and one byte per element. x is normalised as a = |x| * (1/absmax) (0 when absmax == 0).
 *
 * Code maps ("dynamic tree": a decade exponent and a linear fraction whose width shrinks with the exponent):
 *   signed (exp_avg):     byte = sign << 7 | idx, idx in 0..127, ND = 7 decades
 *   unsigned (exp_avg_sq): byte = idx, idx in 0..255, ND = 8 decades
 * idx 0 is zero. For idx >= 1 let d = floor(log2 idx) (0 .. ND-1), e = ND-1-d (the decade) and n = 2^d; then
 *   value(idx) = 10^-e * (0.1 + 0.9 * (idx - n + 1) / n)
 * so decade e holds n evenly spaced values in (10^-(e+1), 10^-e], its top value is 10^-e (1.0 for the largest
 * code) and its lowest step continues to the decade below. In fp32 (the definition used everywhere), a block
 * with scale absmax decodes idx as
 *   fmaf((float)idx, STEP[d] * absmax, OFF[d] * absmax)   (the two products rounded to fp32 once per block),
 *   STEP = fl(0.9 / (n * 10^e)), OFF = fl(fl(10^-e) - (2n-1) * STEP)   (see acc_qmap_tables()),
 * so the normalised code values (absmax = 1) are fmaf(idx, STEP, OFF), within 2e-6 of the formula above.
 * Quantise a in [0, 1]: the decade e = #{k in 1..ND-1 : a <= fl(10^-k)}; then
 *   idx = rint(clamp(fmaf(a, K1[e], K0[e]), 0, 2^ND - 1)),  K1 = fl(10^e n / 0.9), K0 = fl(8n/9 - 1)
 * (idx = n + j - 1 with j the real position on decade e's grid: nearest code up to ~1e-5 of a step; NaN -> 0);
 * for the last decade (everything at or below 10^-(ND-1)) K1 = fl(10^(ND-1)), K0 = 0: rounds to 0 or the
 * smallest code. */
#ifndef ACC_QMAP_H
#define ACC_QMAP_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "acc.h"
#include "fpconv.h"

#define ACC_QBLOCK 256

/* Per-decade constants of one map, indexed by decade e (quantise) or d = ND-1-e (dequantise). Padded to 8
 * entries so a vector permute can read them (unused entries are 0). */
typedef struct {
    int nd;         /* decades: 7 (signed) or 8 (unsigned) */
    float thr[8];   /* thr[k] = fl(10^-k), k = 1 .. nd-1 (thr[0] unused) */
    float k1[8], k0[8];       /* by decade e */
    float step[8], off[8];    /* by d */
} acc_qmap;

/* The two maps (built once, on first use, thread-safe). */
ACC_EXTERN_C_BEGIN
const acc_qmap *acc_qmap_get(int is_signed);
ACC_EXTERN_C_END

/* Builds a map of nd decades (8: unsigned, 7: signed). Every constant is one double expression of exact integers
 * and decimal literals, rounded once to float, so Python (tests/test_optim_lowbit.py) rebuilds the same bits; the
 * CUDA extension builds its copy with this same function and hands it to its kernels by value. */
static inline void acc_qmap_build(acc_qmap *q, int nd) {
    static const double ten_neg[] = {1e0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7};
    static const double ten_pos[] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7};
    memset(q, 0, sizeof *q);
    q->nd = nd;
    for (int k = 1; k < nd; k++) q->thr[k] = (float)ten_neg[k];
    for (int e = 0; e < nd; e++) {
        double n = (double)(1 << (nd - 1 - e));
        if (e < nd - 1) {
            q->k1[e] = (float)(ten_pos[e] * n / 0.9);
            q->k0[e] = (float)(8.0 * n / 9.0 - 1.0);
        } else { /* the last decade rounds between zero and the smallest code */
            q->k1[e] = (float)ten_pos[e];
            q->k0[e] = 0.0f;
        }
    }
    for (int d = 0; d < nd; d++) {
        int e = nd - 1 - d;
        double n = (double)(1 << d);
        q->step[d] = (float)(0.9 / (n * ten_pos[e]));
        q->off[d] = (float)((double)(float)ten_neg[e] - (2.0 * n - 1.0) * (double)q->step[d]);
    }
}

static inline ACC_HD float acc_q_fmin(float a, float b) { return a < b ? a : b; }
static inline ACC_HD float acc_q_fmax(float a, float b) { return a > b ? a : b; } /* maxps: NaN -> b */

/* floor(log2 x) of x >= 1 */
static inline ACC_HD int acc_q_log2(uint32_t x) {
#ifdef __CUDA_ARCH__
    return 31 - __clz(x);
#else
    return 31 - __builtin_clz(x);
#endif
}

/* |x| -> magnitude index (a already normalised). */
static inline ACC_HD uint32_t acc_q_index(const acc_qmap *q, float a) {
    int e = 0;
    for (int k = 1; k < q->nd; k++) e += a <= q->thr[k];
    float r = fmaf(a, q->k1[e], q->k0[e]);
    r = acc_q_fmin(acc_q_fmax(r, 0.0f), (float)((1 << q->nd) - 1));
    return (uint32_t)lrintf(r);
}

/* magnitude index -> value, with the block's scaled tables (step[d] * absmax, off[d] * absmax) */
static inline ACC_HD float acc_q_value_scaled(const acc_qmap *q, uint32_t idx, float absmax) {
    if (idx == 0) return 0.0f;
    int d = acc_q_log2(idx);
    return fmaf((float)idx, q->step[d] * absmax, q->off[d] * absmax);
}

static inline ACC_HD float acc_q_value(const acc_qmap *q, uint32_t idx) { return acc_q_value_scaled(q, idx, 1.0f); }

/* One element: x (fp32 state value) with the block's inverse absmax -> code byte. */
static inline ACC_HD uint8_t acc_q_encode(const acc_qmap *q, int is_signed, float x, float inv) {
    uint32_t u = acc_f2u(x);
    uint32_t idx = acc_q_index(q, acc_u2f(u & 0x7fffffffu) * inv);
    return (uint8_t)(is_signed ? (idx | ((u >> 24) & 0x80u)) : idx);
}

static inline ACC_HD float acc_q_decode(const acc_qmap *q, int is_signed, uint8_t c, float absmax) {
    if (!is_signed) return acc_q_value_scaled(q, c, absmax);
    float v = acc_q_value_scaled(q, c & 0x7fu, absmax);
    return acc_u2f(acc_f2u(v) | ((uint32_t)(c & 0x80u) << 24));
}

/* The inverse scale of a block: 1/absmax, or 0 for a block whose absmax is zero or subnormal (its values are
 * below 1.2e-38: they become zero codes). absmax is the largest |x| compared as bit patterns (order-independent,
 * NaN included), so every path and thread split finds the same one. With a normal absmax, a = |x| * inv is at
 * most 1 + 2^-23 (or NaN), so the upper clamp of the code index never acts: the SIMD paths leave it out. */
static inline ACC_HD float acc_q_inverse(float absmax) { return absmax < 0x1p-126f ? 0.0f : 1.0f / absmax; }

/* ---- bf16 state: the random bits of its stochastic rounding ---------------------------------------------
 * A counter-based hash of the element's index within its tensor and a per-(tensor, step) seed: the bits do not
 * depend on threads, SIMD level or how a tensor is sliced, and a run is reproducible. The low 16 bits round
 * exp_avg, the high 16 bits exp_avg_sq. */
#define ACC_SR_K1 0x9e3779b1u
#define ACC_SR_K2 0x85ebca6bu

static inline ACC_HD uint32_t acc_sr_hash(uint32_t index, uint32_t seed) {
    uint32_t x = index * ACC_SR_K1 + seed;
    x ^= x >> 16;
    x *= ACC_SR_K2;
    return x ^ (x >> 15);
}

/* The seed of one tensor's update: mixes the step number and the caller's salt (the tensor's position in its
 * optimizer). Element indices are taken mod 2^32. */
static inline ACC_HD uint32_t acc_sr_seed(double step, uint64_t salt) {
    uint64_t z = (uint64_t)step * 0x9e3779b97f4a7c15ull ^ (salt + 0x632be59bd9b4e019ull) * 0xbf58476d1ce4e5b9ull;
    z ^= z >> 31;
    z *= 0xd6e8feb86659fd93ull;
    return (uint32_t)(z ^ (z >> 32));
}

/* Block-wise conversions of whole tensors (state_dict conversion, tests): x has n fp32 elements; codes n bytes;
 * absmax ceil(n / ACC_QBLOCK) floats. Parallel over blocks; results independent of nthreads and SIMD level. */
ACC_EXTERN_C_BEGIN
acc_status acc_quantize_blockwise(const float *x, size_t n, int is_signed, uint8_t *codes, float *absmax,
                                  int nthreads);
acc_status acc_dequantize_blockwise(const uint8_t *codes, const float *absmax, size_t n, int is_signed, float *x,
                                    int nthreads);
ACC_EXTERN_C_END

#endif
