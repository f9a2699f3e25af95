/* bind_shm.c: Python bindings of the shm subsystem (METH_FASTCALL wrappers: parse, borrow tensors through
 * DLPack, release the GIL, call the compute code, turn its acc_status into an exception).
 * Not for: compute code (that lives in kernels/ or shm/ and never includes Python.h). */
#include "bind_util.h"

PyMethodDef acc_shm_methods[] = {
    {NULL, NULL, 0, NULL},
};
