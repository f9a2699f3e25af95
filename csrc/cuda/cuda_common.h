/* cuda/cuda_common.h: what the two kernel files (optim.cu, ops.cu) share, for nvcc only: the multi-tensor plan
 * (a launch holds up to ACC_CU_MT tensors; block b of the grid works on tensor mt_find(plan, b), chunk
 * b - first[t]), loads and stores of 4 consecutive elements (one 16- or 8-byte access where aligned), the
 * device's bf16/fp16 store, and launch-error handling. Every function a thread runs is ACC_HD: the host emulation
 * (tests) runs the same code.
 * Not for: gcc (this header is CUDA C), Python, kernels themselves. */
#ifndef ACC_CUDA_COMMON_H
#define ACC_CUDA_COMMON_H

#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "cuda/kernels.h"
#include "fpconv.h"
#include "optim/optim_util.h"

#define ACC_CU_MT 32                    /* tensors per launch (the launch struct travels as a kernel parameter) */
#define ACC_CU_MAX_GRID (1u << 30)      /* blocks per launch */

typedef struct {
    int k;                              /* tensors in this launch */
    uint32_t first[ACC_CU_MT + 1];      /* first block of tensor t; first[k] = the grid */
} mt_plan;

/* The tensor block b belongs to: the last t with first[t] <= b (a tensor without blocks shares its first with
 * the next, which is then found). */
static inline ACC_HD int mt_find(const mt_plan *p, uint32_t b) {
    int lo = 0, hi = p->k - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (p->first[mid] <= b) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

static inline ACC_HD uint64_t cu_min64(uint64_t a, uint64_t b) { return a < b ? a : b; }

static inline int cu_aligned(const void *p, unsigned bytes) { return p == NULL || ((uintptr_t)p % bytes) == 0; }

/* 4 consecutive elements 4q .. 4q+3 of a F32 / BF16 / F16 array as floats (one aligned access) */
static inline ACC_HD void ld4f(const void *a, acc_dtype dt, uint64_t q, float x[4]) {
    if (dt == ACC_F32) {
        float4 v = ((const float4 *)a)[q];
        x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
        return;
    }
    ushort4 h = ((const ushort4 *)a)[q];
    const uint16_t u[4] = {h.x, h.y, h.z, h.w};
    for (int j = 0; j < 4; j++) x[j] = dt == ACC_BF16 ? acc_bf16_to_f32(u[j]) : acc_f16_to_f32(u[j]);
}

static inline ACC_HD void st4f32(float *a, uint64_t q, const float x[4]) {
    float4 v;
    v.x = x[0], v.y = x[1], v.z = x[2], v.w = x[3];
    ((float4 *)a)[q] = v;
}

/* 4 16-bit codes into elements 4q .. 4q+3 of a 16-bit array (one 8-byte store) */
static inline ACC_HD void st4u16(void *a, uint64_t q, const uint16_t u[4]) {
    ushort4 h;
    h.x = u[0], h.y = u[1], h.z = u[2], h.w = u[3];
    ((ushort4 *)a)[q] = h;
}

/* the optimizers' bf16/fp16 copy of a param (optim_util.h acc_store_lp's bits), 4 at once */
static inline ACC_HD void st4lp(void *a, acc_dtype dt, uint64_t q, const float x[4]) {
    uint16_t u[4];
    for (int j = 0; j < 4; j++) u[j] = dt == ACC_BF16 ? acc_f32_to_bf16(x[j], 0x7fc0) : acc_f32_to_f16(x[j]);
    st4u16(a, q, u);
}

/* torch's conversion on a CUDA device: round to nearest even, canonical NaN (fpconv.h ACC_CUDA_NAN16) */
static inline ACC_HD uint16_t cu_to16(float x, acc_dtype dt) {
    if (dt == ACC_BF16) return acc_f32_to_bf16(x, ACC_CUDA_NAN16);
    return x != x ? ACC_CUDA_NAN16 : acc_f32_to_f16(x);
}

/* The device's own conversion instructions for 4 elements at once, where it has them (device code only; the host
 * emulation and older GPUs run the functions above, whose bits these give, as the GPU check verifies against the
 * CPU kernel and torch): sm_80 cvt.rn.{bf16,f16}x2.f32 (canonical NaN 0x7FFF, as cu_to16), sm_89
 * cvt.rn.satfinite.{e4m3,e5m2}x2.f32 (inf saturates to the largest finite, as acc_f32_to_e4m3 / e5m2; NaN comes
 * out as 0x7F, so its sign bit is put back as those functions keep it). */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define ACC_CU_HW16 1
static __device__ inline uint2 cu_hw16x4(const float y[4], int bf16) {
    uint2 w;
    if (bf16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w.x) : "f"(y[1]), "f"(y[0]));
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w.y) : "f"(y[3]), "f"(y[2]));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w.x) : "f"(y[1]), "f"(y[0]));
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w.y) : "f"(y[3]), "f"(y[2]));
    }
    return w;
}
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define ACC_CU_HW8 1
static __device__ inline uint32_t cu_hw8x4(const float y[4], int e4m3) {
    unsigned short lo, hi;
    if (e4m3) {
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(y[1]), "f"(y[0]));
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(y[3]), "f"(y[2]));
    } else {
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(y[1]), "f"(y[0]));
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(y[3]), "f"(y[2]));
    }
    uint32_t r = (uint32_t)lo | (uint32_t)hi << 16;
    for (int j = 0; j < 4; j++) {
        const uint32_t u = acc_f2u(y[j]);
        if ((u & 0x7fffffffu) > 0x7f800000u) r |= (u >> 31) << (8 * j + 7);
    }
    return r;
}
#endif

/* |x| widened to fp32 as an ordered key (cast.c's amax rule on the device): every NaN becomes the canonical
 * 0x7FC00000, above +inf, so the maximum of the keys is the amax's bits whatever the order */
static inline ACC_HD uint32_t cu_amax_key(float x) {
    uint32_t k = acc_f2u(x) & 0x7fffffffu;
    return k > 0x7f800000u ? 0x7fc00000u : k;
}

/* After a launch: the CUDA error (a bad configuration, no device) as ACC_ERR_STATE with its text. */
static inline acc_status cu_check(const char *what) {
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) return ACC_OK;
    acc_set_error("%s: CUDA error %d (%s)", what, (int)e, cudaGetErrorString(e));
    return ACC_ERR_STATE;
}

#endif
