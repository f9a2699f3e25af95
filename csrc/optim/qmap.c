/* qmap.c: builds the two 8-bit code maps of qmap.h and converts whole fp32 tensors to block-wise codes and back
 * (optimizer state_dict conversion, tests, the error benchmark), on every SIMD path, parallel over blocks.
 * Not for: the fused optimizer update (adam_lowbit.c). */
#pragma GCC optimize("fp-contract=off")
#include <pthread.h>
#include <stdlib.h>

#include "simd.h"
#include "optim_simd.h"
#include "qmap.h"

static acc_qmap maps[2]; /* [0] unsigned, [1] signed */
static pthread_once_t maps_once = PTHREAD_ONCE_INIT;

/* Every constant is one double expression of exact integers and decimal literals, rounded once to float, so
 * Python (tests/test_optim_lowbit.py) rebuilds the same bits. */
static void build(acc_qmap *q, int nd) {
    static const double ten_neg[] = {1e0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7};
    static const double ten_pos[] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7};
    *q = (acc_qmap){.nd = nd};
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

static void build_all(void) {
    build(&maps[0], 8);
    build(&maps[1], 7);
}

const acc_qmap *acc_qmap_get(int is_signed) {
    pthread_once(&maps_once, build_all);
    return &maps[is_signed ? 1 : 0];
}

typedef struct {
    float *x;
    uint8_t *codes;
    float *absmax;
    size_t n;
    int is_signed;
} qconv;

#define ACC_ISA_BODY "qconv_body.inc"
#define ACC_ISA_LOWBIT
#include "isa_instances.inc"

static void q_seg(void *ctx, size_t seg, size_t lo, size_t hi) {
    const qconv *c = (const qconv *)ctx;
    ACC_SIMD_CALL(acc_simd_level_get(), quant_blocks, c, lo, hi);
}

static void dq_seg(void *ctx, size_t seg, size_t lo, size_t hi) {
    const qconv *c = (const qconv *)ctx;
    ACC_SIMD_CALL(acc_simd_level_get(), dequant_blocks, c, lo, hi);
}

acc_status acc_quantize_blockwise(const float *x, size_t n, int is_signed, uint8_t *codes, float *absmax,
                                  int nthreads) {
    qconv c = {(float *)x, codes, absmax, n, is_signed};
    size_t nb = (n + ACC_QBLOCK - 1) / ACC_QBLOCK;
    return nb ? acc_segments_parallel_min(&nb, 1, nthreads, ACC_OPTIM_MIN_PER_THREAD / ACC_QBLOCK, q_seg, &c)
              : ACC_OK;
}

acc_status acc_dequantize_blockwise(const uint8_t *codes, const float *absmax, size_t n, int is_signed, float *x,
                                    int nthreads) {
    qconv c = {x, (uint8_t *)codes, (float *)absmax, n, is_signed};
    size_t nb = (n + ACC_QBLOCK - 1) / ACC_QBLOCK;
    return nb ? acc_segments_parallel_min(&nb, 1, nthreads, ACC_OPTIM_MIN_PER_THREAD / ACC_QBLOCK, dq_seg, &c)
              : ACC_OK;
}
