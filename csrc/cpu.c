/* cpu.c: CPUID-based feature detection and the process-wide SIMD level (see cpu.h). */
#include "cpu.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
static unsigned long long acc_xgetbv(unsigned idx) {
    unsigned eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(idx));
    return ((unsigned long long)edx << 32) | eax;
}
static acc_simd_level detect(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return ACC_SIMD_SCALAR;
    int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    if (!osxsave || !avx) return ACC_SIMD_SCALAR;
    unsigned long long xcr0 = acc_xgetbv(0);
    if ((xcr0 & 0x6) != 0x6) return ACC_SIMD_SCALAR;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return ACC_SIMD_SCALAR;
    int avx2 = (b >> 5) & 1, avx512f = (b >> 16) & 1, avx512bw = (b >> 30) & 1, avx512dq = (b >> 17) & 1,
        avx512vl = (b >> 31) & 1, avx512cd = (b >> 28) & 1; /* CD: vplzcntd (8-bit state decode) */
    acc_simd_level lvl = ACC_SIMD_SCALAR;
    if (avx2 && fma && f16c) lvl = ACC_SIMD_AVX2;
    if (lvl == ACC_SIMD_AVX2 && avx512f && avx512bw && avx512dq && avx512vl && avx512cd && (xcr0 & 0xe0) == 0xe0)
        lvl = ACC_SIMD_AVX512;
    return lvl;
}
#else
static acc_simd_level detect(void) { return ACC_SIMD_SCALAR; }
#endif

static int g_detected = -1;
static int g_level = -1;

acc_simd_level acc_simd_detected(void) {
    if (g_detected < 0) g_detected = (int)detect();
    return (acc_simd_level)g_detected;
}

acc_simd_level acc_simd_level_get(void) {
    if (g_level < 0) g_level = (int)acc_simd_detected();
    return (acc_simd_level)g_level;
}

int acc_simd_level_set(acc_simd_level lvl) {
    acc_simd_level det = acc_simd_detected();
    g_level = (int)(lvl < det ? lvl : det);
    return g_level;
}

const char *acc_simd_name(acc_simd_level lvl) {
    switch (lvl) {
    case ACC_SIMD_AVX512: return "avx512";
    case ACC_SIMD_AVX2: return "avx2";
    default: return "scalar";
    }
}
