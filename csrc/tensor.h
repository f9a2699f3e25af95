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

/* Same, and also requires: contiguous, on the CPU, and (when want >= 0) dtype == want. A tensor on another device
 * is a ValueError naming `what` and the device ("cuda:0", "meta", ...), never a pointer handed to CPU code: this
 * is the one gate every CPU kernel and shared-memory path is behind (bind_*.c borrow through it only). */
int acc_tensor_borrow_cpu(PyObject *module, PyObject *obj, acc_tensor *out, const char *what, int want);

/* The name of a DLPack device ("cuda", "rocm", "metal", ...; "device type N" for codes we do not name). */
const char *acc_dl_device_name(int device_type);

/* Same as acc_tensor_borrow, and also requires a tensor on `device_type` (a DLPack code) that is contiguous and,
 * when want >= 0, of dtype `want`: the CUDA extension's gate (its kernels take device pointers only). */
int acc_tensor_borrow_on(PyObject *module, PyObject *obj, acc_tensor *out, const char *what, int want,
                         int device_type);

#endif
