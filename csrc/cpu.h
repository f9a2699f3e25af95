/* cpu.h: the run-time SIMD level. The CPU's features are read once with CPUID; the level kernels use starts
 * at the detected one and can be set to any level up to it with acc_simd_level_set() (Python:
 * _C.simd_level("scalar" | "avx2" | "avx512"), which accelerate_c calls for ACCELERATE_C_SIMD=scalar|avx2),
 * so tests can run every path on one machine. Not for: the target attributes and the dispatch style
 * (simd.h), or choosing at build time (no -march=native anywhere). */
#ifndef ACC_CPU_H
#define ACC_CPU_H

typedef enum { ACC_SIMD_SCALAR = 0, ACC_SIMD_AVX2 = 1, ACC_SIMD_AVX512 = 2 } acc_simd_level;

acc_simd_level acc_simd_detected(void);  /* what the CPU (and OS) support */
acc_simd_level acc_simd_level_get(void); /* what kernels use now */
int acc_simd_level_set(acc_simd_level lvl); /* returns the level actually set (min of asked, detected) */
const char *acc_simd_name(acc_simd_level lvl);

#endif
