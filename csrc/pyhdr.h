/* pyhdr.h: the one place that includes Python.h, with the limited-API version fixed by setup.py.
 * Included only by binding files (module.c, accel_type.c, tensor.c, bind_*.c). */
#ifndef ACC_PYHDR_H
#define ACC_PYHDR_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#endif
