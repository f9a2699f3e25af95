/* cpu.h: run-time SIMD dispatch. The CPU's features are read once with CPUID; the level used can be
 * lowered (never raised) with ACCELERATE_C_SIMD=scalar|avx2|avx512 or acc_simd_set_level(), so tests can
 * run every path on one machine. Not for: choosing at build time (no -march=native anywhere). */
#ifndef ACC_CPU_H
#define ACC_CPU_H

typedef enum { ACC_SIMD_SCALAR = 0, ACC_SIMD_AVX2 = 1, ACC_SIMD_AVX512 = 2 } acc_simd_level;

acc_simd_level acc_simd_detected(void);  /* what the CPU (and OS) support */
acc_simd_level acc_simd_level_get(void); /* what kernels use now */
int acc_simd_level_set(acc_simd_level lvl); /* returns the level actually set (min of asked, detected) */
const char *acc_simd_name(acc_simd_level lvl);

#endif
