/* module.c: the accelerate_c._C module: multi-phase init (PEP 489), module state, and the function
 * tables of each subsystem (core here; ops, optim and shm in their bind_*.c files).
 * Not for: compute code or per-subsystem logic. */
#include <string.h>

#include "bind_util.h"
#include "cpu.h"
#include "heap.h"
#include "options.h"
#include "parallel.h"
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

/* spin time option: an int (not a bool) in 0 .. ACC_OPT_SPIN_MAX_US */
static int spin_arg(PyObject *v, const char *name, long *out) {
    if (!PyLong_Check(v) || PyBool_Check(v)) {
        PyErr_Format(PyExc_TypeError, "set_options: %s must be an int (microseconds), got %R", name, v);
        return -1;
    }
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (overflow || x < 0 || x > ACC_OPT_SPIN_MAX_US) {
        PyErr_Format(PyExc_ValueError, "set_options: %s must be between 0 and %ld microseconds, got %R", name,
                     ACC_OPT_SPIN_MAX_US, v);
        return -1;
    }
    *out = (long)x;
    return 0;
}

/* set_options(*, cast_thp=..., shm_spin_us=..., shm_inner_spin_us=...): every given option is checked before
 * any is applied; options not given keep their value. */
static PyObject *core_set_options(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (nargs) return PyErr_Format(PyExc_TypeError, "set_options takes keyword arguments only (%zd positional given)",
                                   nargs);
    acc_options o;
    acc_options_get(&o);
    Py_ssize_t nk = kwnames ? PyTuple_Size(kwnames) : 0;
    for (Py_ssize_t i = 0; i < nk; i++) {
        PyObject *key = PyTuple_GetItem(kwnames, i), *v = args[i];
        if (!key) return NULL;
        if (PyUnicode_CompareWithASCIIString(key, "cast_thp") == 0) {
            if (!PyBool_Check(v))
                return PyErr_Format(PyExc_TypeError, "set_options: cast_thp must be a bool, got %R", v);
            o.cast_thp = v == Py_True;
        } else if (PyUnicode_CompareWithASCIIString(key, "openmp_pool") == 0) {
            if (!PyBool_Check(v))
                return PyErr_Format(PyExc_TypeError, "set_options: openmp_pool must be a bool, got %R", v);
            o.openmp_pool = v == Py_True;
        } else if (PyUnicode_CompareWithASCIIString(key, "shm_spin_us") == 0) {
            if (spin_arg(v, "shm_spin_us", &o.shm_spin_us) < 0) return NULL;
        } else if (PyUnicode_CompareWithASCIIString(key, "shm_inner_spin_us") == 0) {
            if (spin_arg(v, "shm_inner_spin_us", &o.shm_inner_spin_us) < 0) return NULL;
        } else {
            return PyErr_Format(PyExc_TypeError,
                                "set_options: unknown option %R (cast_thp, openmp_pool, shm_spin_us, shm_inner_spin_us)",
                                key);
        }
    }
    acc_options_set(&o);
    Py_RETURN_NONE;
}

static PyObject *core_get_options(PyObject *module, PyObject *unused) {
    acc_options o;
    acc_options_get(&o);
    return Py_BuildValue("{s:O,s:O,s:l,s:l}", "cast_thp", o.cast_thp ? Py_True : Py_False, "openmp_pool",
                         o.openmp_pool ? Py_True : Py_False, "shm_spin_us", o.shm_spin_us, "shm_inner_spin_us",
                         o.shm_inner_spin_us);
}

static PyObject *core_parallel_backend(PyObject *module, PyObject *unused) {
    return PyUnicode_FromString(acc_parallel_backend() ? "openmp" : "threads");
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

static PyObject *core_heap_trim(PyObject *module, PyObject *unused) {
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = acc_heap_trim();
    Py_END_ALLOW_THREADS
    if (r < 0) Py_RETURN_NONE;
    return PyBool_FromLong(r);
}

static PyObject *core_heap_mmap_threshold(PyObject *module, PyObject *arg) {
    unsigned long bytes = PyLong_AsUnsignedLong(arg);
    int r;
    if (bytes == (unsigned long)-1 && PyErr_Occurred()) return NULL;
    r = acc_heap_mmap_threshold(bytes);
    if (r < 0) Py_RETURN_NONE;
    return PyBool_FromLong(r);
}

PyMethodDef acc_core_methods[] = {
    {"simd_level", (PyCFunction)(void (*)(void))core_simd_level, METH_FASTCALL,
     "simd_level($module, level=None, /)\n--\n\nGet (or lower) the SIMD level kernels use: scalar, avx2, avx512."},
    {"set_options", (PyCFunction)(void (*)(void))core_set_options, METH_FASTCALL | METH_KEYWORDS,
     "set_options($module, /, *, cast_thp=False, openmp_pool=True, shm_spin_us=50, shm_inner_spin_us=1000)\n--\n\n"
     "Set the C core's run-time options (options not given keep their value; defaults shown):\n"
     "cast_thp (bool): transparent huge pages for large fresh cast outputs; openmp_pool (bool): multi-threaded\n"
     "kernels called from the main thread run on the OpenMP pool torch loaded; shm_spin_us, shm_inner_spin_us\n"
     "(int, 0 .. 10_000_000): the spin budgets of a shm wait before it sleeps, at the first arrival of a\n"
     "collective and between its phases; a shm group takes the values current when it is opened."},
    {"get_options", core_get_options, METH_NOARGS,
     "get_options($module, /)\n--\n\nThe current run-time options as a dict (see set_options)."},
    {"parallel_backend", core_parallel_backend, METH_NOARGS,
     "parallel_backend($module, /)\n--\n\nWhere a multi-threaded kernel called from this thread now runs its chunks:\n"
     "'openmp' (the OpenMP pool torch loaded) or 'threads' (threads created for the call)."},
    {"simd_detected", core_simd_detected, METH_NOARGS,
     "simd_detected($module, /)\n--\n\nThe best SIMD level this CPU supports."},
    {"tensor_info", (PyCFunction)(void (*)(void))core_tensor_info, METH_FASTCALL,
     "tensor_info($module, t, /)\n--\n\n(data_ptr, dtype, numel, contiguous, device_type) as seen through DLPack."},
    {"has_exchange_api", core_has_exchange_api, METH_NOARGS,
     "has_exchange_api($module, /)\n--\n\nTrue once torch's DLPack C exchange table has been found and cached."},
    {"heap_trim", core_heap_trim, METH_NOARGS,
     "heap_trim($module, /)\n--\n\nReturns the C heap's free pages to the system (glibc malloc_trim): True when some\n"
     "were released, False when none, None where the C library has no such call."},
    {"heap_mmap_threshold", core_heap_mmap_threshold, METH_O,
     "heap_mmap_threshold($module, nbytes, /)\n--\n\nFixes the size from which the C heap serves a block from a mapping\n"
     "of its own, given back when freed (glibc mallopt M_MMAP_THRESHOLD; its dynamic raising stops): True when set,\n"
     "False when refused, None where the C library has no such setting."},
    {NULL, NULL, 0, NULL},
};

/* ---- module lifecycle ---------------------------------------------------------------------------- */

/* C reads no environment variables: once the functions exist, accelerate_c.base.settings.apply_native_options(m)
 * reads and validates the ones the C core uses (ACCELERATE_C_SIMD, _CAST_THP, _SHM_SPIN_US, _SHM_INNER_SPIN_US)
 * and calls m.simd_level / m.set_options. Here, because this is the one place every first import of _C passes. */
static int apply_env_options(PyObject *m) {
    PyObject *mod = PyImport_ImportModule("accelerate_c.base.settings");
    if (!mod) return -1;
    PyObject *r = PyObject_CallMethod(mod, "apply_native_options", "O", m);
    Py_DECREF(mod);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

static int acc_exec(PyObject *m) {
    acc_module_state *st = acc_get_state(m);
    st->str_dlpack = PyUnicode_InternFromString("__dlpack__");
    st->str_detach = PyUnicode_InternFromString("detach");
    if (!st->str_dlpack || !st->str_detach) return -1;
    PyMethodDef *tables[] = {acc_core_methods, acc_ops_methods, acc_optim_methods, acc_shm_methods,
                             acc_p2p_methods};
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
    acc_parallel_init();
    return apply_env_options(m);
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
