/* bind_optim.c: Python bindings of the optim subsystem (METH_FASTCALL wrappers: parse, borrow tensors through
 * DLPack, release the GIL, call the compute code, turn its acc_status into an exception).
 * Not for: compute code (that lives in kernels/ or optim/ and never includes Python.h). */
#include "bind_util.h"

PyMethodDef acc_optim_methods[] = {
    {NULL, NULL, 0, NULL},
};
