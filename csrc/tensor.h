/* tensor.h: borrowing a torch tensor's memory from Python objects, for the binding layer only.
 * acc_tensor is a plain view (pointer, dtype, numel, contiguity) valid while the GIL-holding caller keeps
 * the Python object alive. Compute files never see PyObject: they get acc_tensor fields.
 * Not for: allocation (Python allocates outputs and passes them in) or autograd. */
#ifndef ACC_TENSOR_H
#define ACC_TENSOR_H

#include "pyhdr.h"
#include "acc.h"

typedef struct {
    void *data;
    acc_dtype dtype;
    int64_t numel;
    int ndim;
    int64_t shape[8];
    int contiguous; /* 1 when the elements are dense and row-major */
    int device_type; /* 1 = CPU, 2 = CUDA (DLPack codes) */
    int device_id;
} acc_tensor;

/* Fills *out from a torch tensor (or any DLPack producer). Uses torch's C exchange table when the
 * object's type has one (no allocation, ~50 ns), else __dlpack__ (detaching Parameters first).
 * On failure sets a Python exception naming `what` and returns -1. */
int acc_tensor_borrow(PyObject *module, PyObject *obj, acc_tensor *out, const char *what);

/* Same, and also requires: contiguous, on the CPU, and (when want >= 0) dtype == want. */
int acc_tensor_borrow_cpu(PyObject *module, PyObject *obj, acc_tensor *out, const char *what, int want);

#endif
