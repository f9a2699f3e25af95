/* bind_util.c: status -> exception mapping for the binding layer (see bind_util.h). */
#include <errno.h>
#include <string.h>

#include "bind_util.h"

acc_module_state *acc_get_state(PyObject *module) { return (acc_module_state *)PyModule_GetState(module); }

PyObject *acc_raise_status(acc_status st, const char *where) {
    const char *detail = acc_last_error();
    PyObject *exc;
    switch (st) {
    case ACC_ERR_ARG: exc = PyExc_ValueError; break;
    case ACC_ERR_DTYPE: exc = PyExc_TypeError; break;
    case ACC_ERR_NOMEM: exc = PyExc_MemoryError; break;
    case ACC_ERR_OS: exc = PyExc_OSError; break;
    case ACC_ERR_TIMEOUT: exc = PyExc_TimeoutError; break;
    default: exc = PyExc_RuntimeError; break;
    }
    if (detail && detail[0]) PyErr_Format(exc, "%s: %s", where, detail);
    else PyErr_Format(exc, "%s failed (status %d)", where, (int)st);
    return NULL;
}
