/* bind_cuda.h: what the two binding files of accelerate_c._C_cuda (bind_cuda.c, bind_cuda_ops.c) share: argument
 * helpers over DLPack borrows that require every tensor on one device of one type (CUDA, or the CPU for the
 * emulate_* twins), and the ops' function table. Not for: the CPU module _C (bind_util.h) or compute code. */
#ifndef ACC_BIND_CUDA_H
#define ACC_BIND_CUDA_H

#include <stdio.h>
#include <string.h>

#include "bind_util.h"
#include "cuda/kernels.h"
#include "tensor.h"

typedef struct {
    PyObject *module;
    int dev;        /* DLPack device type every tensor must have: acc_kDLCUDA, or acc_kDLCPU (emulation) */
    int device_id;  /* the first tensor's device index (-1: none yet); every other tensor must share it */
} cu_ctx;

Py_ssize_t cu_seq_len(PyObject *seq, const char *what);
PyObject *cu_seq_item(PyObject *seq, Py_ssize_t i); /* borrowed */
/* None -> *out = NULL; else a list/tuple of length n */
int cu_opt_list(PyObject *obj, Py_ssize_t n, const char *what, PyObject **out);
/* obj as a contiguous tensor on c's device (dtype `want` unless -1, `numel` elements unless -1); the error names
 * what[i] (i < 0: what). Returns its data pointer, NULL with an exception set. */
void *cu_borrow(cu_ctx *c, PyObject *obj, const char *what, Py_ssize_t i, int want, int64_t numel, acc_tensor *t);
int cu_double(PyObject *o, double *out, const char *what);
int cu_stream(PyObject *o, void **out); /* an int (cudaStream_t) or None (the legacy default stream) */
/* a number (*host) or a 1-element float32 tensor on c's device (*dev, read by the kernels) */
int cu_scalar(cu_ctx *c, PyObject *o, const char *what, double *host, const float **dev);

extern PyMethodDef acc_cuda_ops_methods[];

#endif
