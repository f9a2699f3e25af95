/* simd.h: the one place that names CPU targets, and the one way kernels instantiate and pick per-ISA code.
 * Not for: detecting the CPU or choosing the level (cpu.h), or any vector math (fpconv.h holds the vector
 * conversions; optim/optim_ops.inc, ops/cast.c the kernels' own).
 *
 * One target string per level. AVX-512 means F, BW, VL, DQ and CD (cpu.c only reports the level when all five
 * are there; the 8-bit optimizer state decodes with vplzcntd, CD), always with FMA and F16C; AVX2 means AVX2,
 * FMA and F16C. Nothing is built with -march=native: the level is chosen at run time.
 *
 * The style, in every kernel file: per-ISA code is a triple of functions name_scalar, name_avx2 and name_avx512
 * (the vector ones marked ACC_TARGET_AVX2 / ACC_TARGET_AVX512, as are their always-inline helpers) and is
 * called through ACC_SIMD_CALL(level, name, args...) with level = acc_simd_level_get() (or a copy of it taken
 * once per call). A triple comes from one of:
 *   ACC_SIMD_INSTANCES   an always-inline generic body with a constant `ISA` last argument (0, 1, 2) that the
 *                        compiler specialises and vectorises per target (ops/gradops.c, shm/shm_reduce.c);
 *   optim/isa_instances.inc  a body file written in per-ISA operation macros (the optimizer kernels);
 *   hand-written functions with intrinsics (ops/cast.c, optim/optim_util.c).
 * Off x86 only the scalar member exists and ACC_SIMD_CALL always calls it. */
#ifndef ACC_SIMD_H
#define ACC_SIMD_H

#include "cpu.h"

#define ACC_AI __attribute__((always_inline))

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ACC_X86 1
#define ACC_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ACC_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512cd,fma,f16c")))

#define ACC_SIMD_CALL(level, name, ...)                                                                        \
    ((level) == ACC_SIMD_AVX512 ? name##_avx512(__VA_ARGS__)                                                  \
     : (level) == ACC_SIMD_AVX2 ? name##_avx2(__VA_ARGS__)                                                    \
                                : name##_scalar(__VA_ARGS__))

/* static ret name_<isa> params { return impl(args..., ISA); } for ISA 0 (scalar), 1 (AVX2), 2 (AVX-512);
 * impl is an ACC_AI function whose last parameter is `const int ISA`. */
#define ACC_SIMD_INSTANCES(ret, name, params, impl, ...)                                                       \
    static ret name##_scalar params { return impl(__VA_ARGS__, 0); }                                          \
    ACC_TARGET_AVX2 static ret name##_avx2 params { return impl(__VA_ARGS__, 1); }                            \
    ACC_TARGET_AVX512 static ret name##_avx512 params { return impl(__VA_ARGS__, 2); }
#else
#define ACC_SIMD_CALL(level, name, ...) ((void)(level), name##_scalar(__VA_ARGS__))
#define ACC_SIMD_INSTANCES(ret, name, params, impl, ...)                                                       \
    static ret name##_scalar params { return impl(__VA_ARGS__, 0); }
#endif

#endif
