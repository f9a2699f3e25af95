/* module.c: the accelerate_c._C module: multi-phase init (PEP 489), module state, and the function
 * tables of each subsystem (core here; ops, optim and shm in their bind_*.c files).
 * Not for: compute code or per-subsystem logic. */
#include <string.h>

#include "bind_util.h"
#include "cpu.h"
#include "tensor.h"

/* ---- core functions ------------------------------------------------------------------------------ */

static PyObject *core_simd_level(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs > 1) return PyErr_Format(PyExc_TypeError, "simd_level takes at most 1 argument");
    if (nargs == 1) {
        const char *name = PyUnicode_AsUTF8AndSize(args[0], NULL);
        if (!name) return NULL;
        acc_simd_level want;
        if (!strcmp(name, "scalar")) want = ACC_SIMD_SCALAR;
        else if (!strcmp(name, "avx2")) want = ACC_SIMD_AVX2;
        else if (!strcmp(name, "avx512")) want = ACC_SIMD_AVX512;
        else return PyErr_Format(PyExc_ValueError, "simd_level: unknown level %R (allowed: scalar, avx2, avx512)", args[0]);
        if ((acc_simd_level)acc_simd_level_set(want) != want)
            return PyErr_Format(PyExc_ValueError, "simd_level: this CPU does not support %s (detected: %s)", name,
                                acc_simd_name(acc_simd_detected()));
    }
    return PyUnicode_FromString(acc_simd_name(acc_simd_level_get()));
}

static PyObject *core_simd_detected(PyObject *module, PyObject *unused) {
    return PyUnicode_FromString(acc_simd_name(acc_simd_detected()));
}

/* tensor_info(t) -> (data_ptr, dtype_name, numel, contiguous, device_type): the DLPack borrow as Python
 * sees it; used by tests to check the boundary and by benchmarks to time it. */
static PyObject *core_tensor_info(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1) return PyErr_Format(PyExc_TypeError, "tensor_info takes exactly 1 argument");
    acc_tensor t;
    if (acc_tensor_borrow(module, args[0], &t, "tensor_info") < 0) return NULL;
    return Py_BuildValue("(KsLOi)", (unsigned long long)(uintptr_t)t.data, acc_dtype_name(t.dtype), (long long)t.numel,
                         t.contiguous ? Py_True : Py_False, t.device_type);
}

static PyObject *core_has_exchange_api(PyObject *module, PyObject *unused) {
    return PyBool_FromLong(acc_get_state(module)->exchange_api != NULL);
}

PyMethodDef acc_core_methods[] = {
    {"simd_level", (PyCFunction)(void (*)(void))core_simd_level, METH_FASTCALL,
     "simd_level($module, level=None, /)\n--\n\nGet (or lower) the SIMD level kernels use: scalar, avx2, avx512."},
    {"simd_detected", core_simd_detected, METH_NOARGS,
     "simd_detected($module, /)\n--\n\nThe best SIMD level this CPU supports."},
    {"tensor_info", (PyCFunction)(void (*)(void))core_tensor_info, METH_FASTCALL,
     "tensor_info($module, t, /)\n--\n\n(data_ptr, dtype, numel, contiguous, device_type) as seen through DLPack."},
    {"has_exchange_api", core_has_exchange_api, METH_NOARGS,
     "has_exchange_api($module, /)\n--\n\nTrue once torch's DLPack C exchange table has been found and cached."},
    {NULL, NULL, 0, NULL},
};

/* ---- module lifecycle ---------------------------------------------------------------------------- */

static int acc_exec(PyObject *m) {
    acc_module_state *st = acc_get_state(m);
    st->str_dlpack = PyUnicode_InternFromString("__dlpack__");
    st->str_detach = PyUnicode_InternFromString("detach");
    if (!st->str_dlpack || !st->str_detach) return -1;
    PyMethodDef *tables[] = {acc_core_methods, acc_ops_methods, acc_optim_methods, acc_shm_methods};
    for (size_t i = 0; i < sizeof tables / sizeof tables[0]; i++)
        if (PyModule_AddFunctions(m, tables[i]) < 0) return -1;
    st->accelerator_type = acc_accelerator_type_create(m);
    if (!st->accelerator_type) return -1;
    if (PyModule_AddObjectRef(m, "Accelerator", st->accelerator_type) < 0) return -1;
    PyObject *bucket_type = acc_bucket_counter_type_create(m);
    if (!bucket_type) return -1;
    int rc = PyModule_AddObjectRef(m, "BucketCounter", bucket_type);
    Py_DECREF(bucket_type);
    if (rc < 0) return -1;
    if (PyModule_AddIntConstant(m, "LIMITED_API", Py_LIMITED_API) < 0) return -1;
    return 0;
}

static int acc_traverse(PyObject *m, visitproc visit, void *arg) {
    acc_module_state *st = acc_get_state(m);
    Py_VISIT(st->accelerator_type);
    Py_VISIT(st->exchange_api_type);
    return 0;
}

static int acc_clear(PyObject *m) {
    acc_module_state *st = acc_get_state(m);
    Py_CLEAR(st->accelerator_type);
    Py_CLEAR(st->exchange_api_type);
    Py_CLEAR(st->str_dlpack);
    Py_CLEAR(st->str_detach);
    st->exchange_api = NULL;
    return 0;
}

static void acc_free(void *m) { acc_clear((PyObject *)m); }

static PyModuleDef_Slot acc_slots[] = {
    {Py_mod_exec, acc_exec},
    {0, NULL},
};

static struct PyModuleDef acc_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "accelerate_c._C",
    .m_doc = "accelerate_c's C core: the Accelerator base type, kernels and the shared-memory transport.",
    .m_size = sizeof(acc_module_state),
    .m_slots = acc_slots,
    .m_traverse = acc_traverse,
    .m_clear = acc_clear,
    .m_free = acc_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&acc_module); }
