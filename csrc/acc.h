/* acc.h: types shared by every C file of accelerate_c: status codes, dtypes, small macros.
 * Not for: anything that needs Python.h. Compute files include only this (and their own header),
 * take pointers + sizes + a dtype, and return an acc_status that the binding layer turns into an
 * exception (see bind_util.h). Nothing here calls abort()/exit(). */
#ifndef ACC_H
#define ACC_H

#include <stddef.h>
#include <stdint.h>

/* ACC_HD marks the scalar definitions (fpconv.h, qmap.h, optim_util.h, adam_math.h, sgd.h) that the CUDA kernels
 * (csrc/cuda/, compiled by nvcc) use on the device too: one definition of every conversion and update, two
 * compilers. Under gcc it is empty. */
#ifdef __CUDACC__
#define ACC_HD __host__ __device__
#else
#define ACC_HD
#endif

/* nvcc compiles .cu files as C++: the C functions these headers declare keep C linkage there. */
#ifdef __cplusplus
#define ACC_EXTERN_C_BEGIN extern "C" {
#define ACC_EXTERN_C_END }
#else
#define ACC_EXTERN_C_BEGIN
#define ACC_EXTERN_C_END
#endif

typedef enum {
    ACC_OK = 0,
    ACC_ERR_ARG = 1,        /* bad argument: maps to ValueError */
    ACC_ERR_DTYPE = 2,      /* unsupported dtype: TypeError */
    ACC_ERR_NOMEM = 3,      /* MemoryError */
    ACC_ERR_OS = 4,         /* errno is set: OSError */
    ACC_ERR_TIMEOUT = 5,    /* a peer did not arrive in time: TimeoutError */
    ACC_ERR_PEER = 6,       /* a peer died or disagreed: RuntimeError */
    ACC_ERR_STATE = 7,      /* called in the wrong state: RuntimeError */
} acc_status;

/* Element types the kernels understand. Values are ours (not torch's, not DLPack's). */
typedef enum {
    ACC_F32 = 0,
    ACC_BF16 = 1,
    ACC_F16 = 2,
    ACC_F64 = 3,
    ACC_E4M3 = 4,   /* torch.float8_e4m3fn */
    ACC_E5M2 = 5,   /* torch.float8_e5m2 */
    ACC_I64 = 6,
    ACC_I32 = 7,
    ACC_U8 = 8,
    ACC_I8 = 9,
    ACC_BOOL = 10,
    ACC_I16 = 11,
    ACC_NDTYPES
} acc_dtype;

static inline ACC_HD size_t acc_dtype_size(acc_dtype t) {
    switch (t) {
    case ACC_F64: case ACC_I64: return 8;
    case ACC_F32: case ACC_I32: return 4;
    case ACC_BF16: case ACC_F16: case ACC_I16: return 2;
    default: return 1;
    }
}

ACC_EXTERN_C_BEGIN
const char *acc_dtype_name(acc_dtype t);

/* Error detail for the last failing call on this thread (the binding layer appends it to the
 * exception message). Compute code sets it with acc_set_error(). */
void acc_set_error(const char *fmt, ...);
const char *acc_last_error(void);
ACC_EXTERN_C_END

#define ACC_ALIGN 64

#endif
