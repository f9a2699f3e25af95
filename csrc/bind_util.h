/* bind_util.h: helpers for the binding layer: module state, status -> exception, argument checks.
 * Not for: compute code (that returns acc_status and never sees Python). */
#ifndef ACC_BIND_UTIL_H
#define ACC_BIND_UTIL_H

#include "pyhdr.h"
#include "acc.h"
#include "dlpack.h"

typedef struct {
    PyObject *accelerator_type;        /* the Accelerator heap type */
    PyObject *exchange_api_type;       /* the type whose exchange table we cached (torch.Tensor) */
    const acc_DLPackExchangeAPI *exchange_api; /* NULL: use __dlpack__ */
    PyObject *str_dlpack;              /* interned "__dlpack__" */
    PyObject *str_detach;              /* interned "detach" */
} acc_module_state;

acc_module_state *acc_get_state(PyObject *module);

/* Raises the Python exception matching `st` with "<where>: <detail>" and returns NULL. */
PyObject *acc_raise_status(acc_status st, const char *where);

/* Each subsystem's functions, added to the module in the exec slot (module.c). Every table ends with
 * a {NULL} sentinel; a subsystem with no functions yet still provides an empty table. */
extern PyMethodDef acc_core_methods[];
extern PyMethodDef acc_ops_methods[];
extern PyMethodDef acc_optim_methods[];
extern PyMethodDef acc_shm_methods[];
extern PyMethodDef acc_p2p_methods[];

/* The C group behind a ShmGroup's handle (bind_shm.c), or NULL with an exception set (a closed group too). */
struct acc_shm_group *acc_shm_group_of(PyObject *cap, const char *what);

/* Creates the Accelerator heap type for `module` (accel_type.c). */
PyObject *acc_accelerator_type_create(PyObject *module);

/* Creates the BucketCounter heap type (bucket_type.c). */
PyObject *acc_bucket_counter_type_create(PyObject *module);

#endif
