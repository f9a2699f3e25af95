/* adam_update.h: the Adam/AdamW element update of the vector bodies (adam_body.inc, adam_lowbit_body.inc), written
 * once as macros over optim_ops.inc's operations, in adam.h's order (adam_math.h's acc_adam_update1 is the same
 * update in scalar float ops). They expand where a body uses them, so one definition serves every ISA instance.
 * The update's flags are arguments (ADAM_FLAGS): a general loop passes the call's (scaled, maximize, wd_mode,
 * from_end), a loop for the common AdamW call (ADAM_COMMON_CALL) literals the compiler folds, so it carries no
 * per-element tests (a fifth of the in-cache rate on a host with slow division, AVX2 AMD) and gives the same bits.
 * Once the second moment's bias correction has rounded to 1 in fp32 (sqrt(bc2) == 1.0f: from step 16,628 with
 * beta2 0.999, 1,656 with 0.99, 325 with 0.95) its division is x / 1 == x, and a common-call loop with `common` 2
 * leaves it out: the same bits, one division per element fewer.
 * Not for: the state loads and stores (each body's own), the scalars (adam_math.h). */
#ifndef ACC_ADAM_UPDATE_H
#define ACC_ADAM_UPDATE_H

/* The update's vector constants and flags from an acc_adam_scalars pointer `c`, as the macros below name them. */
#define ADAM_CONSTS(c)                                                                                              \
    const V gs = VSET1((c)->grad_scale), lw = VSET1((c)->lerp_coeff), b2 = VSET1((c)->beta2);                       \
    const V c2 = VSET1((c)->one_m_beta2), decay = VSET1((c)->decay), wd = VSET1((c)->wd);                           \
    const V bc2s = VSET1((c)->bc2_sqrt), eps = VSET1((c)->eps), nss = VSET1((c)->neg_step_size);                    \
    const int scaled = (c)->scaled, maximize = (c)->maximize, wd_mode = (c)->wd_mode;                               \
    const int from_end = (c)->lerp_from_end, unit_bc2 = (c)->bc2_sqrt == 1.0f /* unit_bc2: `common` 2 applies */

/* The common AdamW call: fp32 gradients, no scale, not maximize, decoupled decay, lerp from the start, and no
 * copies of the param (mirror, low-precision output). `extra`: a body's own condition (1 when it has none). */
#define ADAM_COMMON_CALL(gdt, mirror, lp, extra)                                                                    \
    ((gdt) == ACC_F32 && !scaled && !maximize && wd_mode == 1 && !from_end && !(mirror) && !(lp) && (extra))
/* The update's flags, in ADAM_MOMENTS' order: `common` 1 gives the common call's as literals (folded away), 0 the
 * call's own, 2 the common call's where unit_bc2 holds (the last flag: no division by sqrt(bc2)). A body writes its
 * loop once over a `common` macro argument and instantiates it with 2, 1 and 0 (ADAM_COMMON_LOOPS). */
#define ADAM_FLAGS(common)                                                                                          \
    (!(common) && scaled), (!(common) && maximize), ((common) ? 1 : wd_mode), (!(common) && from_end), ((common) == 2)
/* A body's loops: LOOP(2) or LOOP(1) for the common call (`is_common`, ADAM_COMMON_CALL), by unit_bc2, then LOOP(0)
 * for what is left (everything, for any other call). */
#define ADAM_COMMON_LOOPS(is_common, LOOP)                                                                          \
    if (is_common) {                                                                                                \
        if (unit_bc2) LOOP(2)                                                                                       \
        else LOOP(1)                                                                                                \
    }                                                                                                               \
    LOOP(0)

/* The gradient at i as fp32: `common` 1 knows it is fp32 already (ADAM_COMMON_CALL), 0 converts by the call's dtype */
#define ADAM_LDG(common, G, gdt, i) ((common) ? VLD((const float *)(G) + (i)) : VLDG((G), (gdt), (i)))

/* Gradient, decay and moments: ADAM_MOMENTS(ADAM_FLAGS(common), g, p, m, v) makes g, p, m, v (V lvalues) the
 * scaled gradient, the decayed param and the new moments. */
#define ADAM_MOMENTS(...) ADAM_MOMENTS_(__VA_ARGS__)
#define ADAM_MOMENTS_(sc, mx, wdm, fe, u1, g, p, m, v)                                                              \
    do {                                                                                                            \
        if (sc) g = VMUL(g, gs);                                                                                    \
        if (mx) g = VNEG(g);                                                                                        \
        if ((wdm) == 1) p = VMUL(p, decay);                                                                         \
        else if ((wdm) == 2) g = VFMA(p, wd, g);                                                                    \
        m = VFMA(lw, VSUB(g, m), (fe) ? g : m);                                                                     \
        v = VFMA(VMUL(c2, g), g, VMUL(v, b2));                                                                      \
    } while (0)

/* The param step from the new m and the second moment vu the update uses (v, or amsgrad's max of the two);
 * ADAM_PARAM(common, ...), or ADAM_PARAM_ with ADAM_FLAGS' last flag (u1: sqrt(bc2) is 1, its division left out). */
#define ADAM_PARAM(common, p, m, vu) ADAM_PARAM_(((common) == 2), p, m, vu)
#define ADAM_PARAM_(u1, p, m, vu)                                                                                   \
    (p = VADD(p, VDIV(VMUL(nss, m), VADD((u1) ? VSQRT(vu) : VDIV(VSQRT(vu), bc2s), eps))))

/* Both, without amsgrad: ADAM_UPDATE(ADAM_FLAGS(common), g, p, m, v) */
#define ADAM_UPDATE(...) ADAM_UPDATE_(__VA_ARGS__)
#define ADAM_UPDATE_(sc, mx, wdm, fe, u1, g, p, m, v)                                                               \
    do {                                                                                                            \
        ADAM_MOMENTS_(sc, mx, wdm, fe, u1, g, p, m, v);                                                             \
        ADAM_PARAM_(u1, p, m, v);                                                                                   \
    } while (0)

#endif
