/* cuda/kernels.h: the CUDA kernels of accelerate_c._C_cuda (kernels.cu, built by nvcc only when it is found) as
 * plain C entry points: device pointers, sizes, acc_dtype codes and a stream (torch's current cudaStream_t, as
 * void *); each enqueues its work on that stream and returns an acc_status (a failed launch: ACC_ERR_STATE with the
 * CUDA error text set). Nothing here allocates device memory or synchronises: scratch space (the norm's partial
 * sums) is passed in, flags and results stay in device memory.
 * The per-element math is the CPU kernels' own scalar definitions (fpconv.h, qmap.h, adam_math.h, sgd.h: ACC_HD),
 * compiled with -fmad=false and IEEE division and square root, so an update gives the CPU kernel's bits and the
 * optimizer state keeps the CPU's formats (a checkpoint moves between devices).
 * The launch planning and each thread's work are ACC_HD functions too, so tests/test_cuda_ext.py runs them on the
 * CPU (acc_cuda_emulate_*: the same plan, every block and thread in turn) against the CPU kernels.
 * Not for: Python (bind_cuda.c), CPU tensors, strided tensors. */
#ifndef ACC_CUDA_KERNELS_H
#define ACC_CUDA_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "acc.h"
#include "optim/adam_math.h"

#define ACC_CU_THREADS 256      /* threads per block (every kernel) */
#define ACC_CU_CHUNK 4096       /* elements per block of the multi-tensor kernels (16 per thread) */
#define ACC_CU_QBLOCKS 8        /* 8-bit Adam: quantisation blocks per CUDA block (one warp each) */

/* One tensor of an Adam step (fp32, bf16 or 8-bit state: state_dtype), as acc_adam_tensor on the CPU. */
typedef struct {
    float *param;
    const void *grad;
    void *exp_avg, *exp_avg_sq;
    float *max_exp_avg_sq;            /* amsgrad (fp32 state only) or NULL */
    void *lp_out;                     /* bf16/fp16 copy of the new param or NULL */
    float *exp_avg_absmax, *exp_avg_sq_absmax; /* 8-bit state: one per 256 elements */
    float *step_dev;                  /* device mode: this tensor's step count (float32, before the update; the
                                         update makes step + 1 and the count is advanced after it), else NULL */
    double step;                      /* host mode: the step this update makes (>= 1) */
    uint64_t n, offset, salt;         /* offset, salt: as acc_adam_tensor (bf16 rounding bits, 8-bit blocks) */
    acc_dtype grad_dtype, lp_dtype, state_dtype;
} acc_cuda_adam_tensor;

/* Steps every tensor; cfg as the CPU's. lr_dev: NULL, or a float32 device scalar read instead of cfg->lr (with
 * lr_is_f32_tensor's rounding). found_inf: NULL, or a float32 device scalar: nonzero skips the whole step (nothing
 * written, no step count advanced: GradScaler's skip, decided on the device). Device mode (step_dev set on every
 * tensor, which must then be all or none) is what CUDA graph capture needs: step, lr and the rounding seed are
 * read at run time, so each replay makes the next step. */
ACC_EXTERN_C_BEGIN
acc_status acc_cuda_adam_step(const acc_adam_config *cfg, const acc_cuda_adam_tensor *ts, size_t nt,
                              const float *lr_dev, const float *found_inf, void *stream);

typedef struct {
    float *param;
    const void *grad;
    float *momentum_buf;              /* NULL without momentum */
    void *lp_out;
    uint64_t n;
    int init_buf;
    acc_dtype grad_dtype, lp_dtype;
} acc_cuda_sgd_tensor;

typedef struct {
    double lr, momentum, dampening, weight_decay, grad_scale;
    int nesterov, maximize;
} acc_cuda_sgd_config;

acc_status acc_cuda_sgd_step(const acc_cuda_sgd_config *cfg, const acc_cuda_sgd_tensor *ts, size_t nt,
                             const float *found_inf, void *stream);

/* One element-wise conversion of a multi-tensor copy: dst[0..n) = src[0..n) converted (F32, BF16, F16 both ways;
 * the device's NaN for bf16/fp16 outputs, fpconv.h ACC_CUDA_NAN16). The sharded engine's copy-in (each source
 * tensor into its slice of a flat buffer) and copy-out (each slice back into its tensor). */
typedef struct {
    const void *src;
    void *dst;
    uint64_t n;
    acc_dtype src_dtype, dst_dtype;
} acc_cuda_copy;

acc_status acc_cuda_multi_copy(const acc_cuda_copy *cs, size_t nc, void *stream);

/* acc_cast on the device: dst = src * scale (scale_dev: a float32 device scalar, else scale_host: a host float,
 * else no multiply), float8 saturated, NaN per the device's convention for bf16/fp16 outputs; amax_out: NULL or a
 * float32 device scalar set to max|src| (before scaling; NaN if any), in the same pass. */
acc_status acc_cuda_cast(const void *src, acc_dtype src_dtype, void *dst, acc_dtype dst_dtype, size_t n,
                         const float *scale_dev, const float *scale_host, float *amax_out, void *stream);

/* A buffer of a multi-tensor gradient pass (gradops.h's acc_buf, on the device). */
typedef struct {
    void *data;
    uint64_t n;
    acc_dtype dtype;
} acc_cuda_buf;

/* Every element: if not finite (before scaling) and found_inf: *found_inf = 1; x = x * factor (factor: *factor_dev
 * when set, else factor; no write where it is 1). found_inf, factor_dev: float32 device scalars or NULL. */
acc_status acc_cuda_multi_scale(const acc_cuda_buf *bufs, size_t nb, float factor, const float *factor_dev,
                                float *found_inf, void *stream);

/* *flag = 1 if any element times scale is inf or NaN, else 0 (the flag is zeroed first, on the stream). */
acc_status acc_cuda_nonfinite(const acc_cuda_buf *bufs, size_t nb, float scale, float *flag, void *stream);

/* The global norm (norm_type 1, 2 or inf) of every element of every buffer into *out (float32 device scalar),
 * accumulated in fp64 in a fixed order: `partials` (fp64 device scratch) must hold acc_cuda_norm_partials(...). */
size_t acc_cuda_norm_partials(const acc_cuda_buf *bufs, size_t nb);
acc_status acc_cuda_multi_norm(const acc_cuda_buf *bufs, size_t nb, double norm_type, double *partials,
                               float *out, void *stream);

/* The device (CUDA runtime) the extension was built for, and the runtime version; 0 devices is not an error. */
acc_status acc_cuda_info(int *devices, int *runtime_version);

/* ---- host emulation (tests): the same launch plans and per-thread functions, run on the CPU over host memory.
 * Each returns what the launcher would (argument errors), having done the kernels' work. */
acc_status acc_cuda_emulate_adam(const acc_adam_config *cfg, const acc_cuda_adam_tensor *ts, size_t nt,
                                 const float *lr, const float *found_inf);
acc_status acc_cuda_emulate_sgd(const acc_cuda_sgd_config *cfg, const acc_cuda_sgd_tensor *ts, size_t nt,
                                const float *found_inf);
acc_status acc_cuda_emulate_cast(const void *src, acc_dtype src_dtype, void *dst, acc_dtype dst_dtype, size_t n,
                                 const float *scale, float *amax_out);
acc_status acc_cuda_emulate_multi_copy(const acc_cuda_copy *cs, size_t nc);
acc_status acc_cuda_emulate_multi_scale(const acc_cuda_buf *bufs, size_t nb, float factor, float *found_inf);
acc_status acc_cuda_emulate_nonfinite(const acc_cuda_buf *bufs, size_t nb, float scale, float *flag);
acc_status acc_cuda_emulate_norm(const acc_cuda_buf *bufs, size_t nb, double norm_type, float *out);
ACC_EXTERN_C_END

#endif
