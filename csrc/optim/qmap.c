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

static void build_all(void) {
    acc_qmap_build(&maps[0], 8);
    acc_qmap_build(&maps[1], 7);
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
