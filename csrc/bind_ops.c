/* bind_ops.c: Python bindings of the ops subsystem (METH_FASTCALL wrappers: parse, borrow tensors through
 * DLPack, release the GIL, call the compute code, turn its acc_status into an exception).
 * Not for: compute code (that lives in kernels/ or ops/ and never includes Python.h). */
#include "bind_util.h"

PyMethodDef acc_ops_methods[] = {
    {NULL, NULL, 0, NULL},
};
