/* tensor.c: DLPack borrowing of torch tensors into acc_tensor views (see tensor.h).
 * Fast path: torch >= 2.10 publishes a C exchange table on the tensor type
 * (__dlpack_c_exchange_api__, a capsule named "dlpack_exchange_api"); its
 * dltensor_from_py_object_no_sync fills a stack DLTensor without allocating. We cache the table the
 * first time a type offers it. Fallback: obj.detach().__dlpack__() and a "dltensor" capsule, dropped
 * before returning (the Python object keeps the storage alive; we copy the shape). */
#include <string.h>

#include "bind_util.h"
#include "tensor.h"

static int map_dtype(acc_DLDataType t, acc_dtype *out) {
    if (t.lanes != 1) return -1;
    switch (t.code) {
    case acc_kDLFloat:
        if (t.bits == 32) { *out = ACC_F32; return 0; }
        if (t.bits == 16) { *out = ACC_F16; return 0; }
        if (t.bits == 64) { *out = ACC_F64; return 0; }
        return -1;
    case acc_kDLBfloat: if (t.bits == 16) { *out = ACC_BF16; return 0; } return -1;
    case acc_kDLFloat8_e4m3fn: *out = ACC_E4M3; return 0;
    case acc_kDLFloat8_e5m2: *out = ACC_E5M2; return 0;
    case acc_kDLInt:
        if (t.bits == 64) { *out = ACC_I64; return 0; }
        if (t.bits == 32) { *out = ACC_I32; return 0; }
        if (t.bits == 16) { *out = ACC_I16; return 0; }
        if (t.bits == 8) { *out = ACC_I8; return 0; }
        return -1;
    case acc_kDLUInt: if (t.bits == 8) { *out = ACC_U8; return 0; } return -1;
    case acc_kDLBool: *out = ACC_BOOL; return 0;
    default: return -1;
    }
}

static int fill_from_dl(const acc_DLTensor *dl, acc_tensor *out, const char *what) {
    if (dl->ndim > 8) {
        PyErr_Format(PyExc_ValueError, "%s: tensors of more than 8 dimensions are not supported (got %d)", what,
                     (int)dl->ndim);
        return -1;
    }
    if (map_dtype(dl->dtype, &out->dtype) < 0) {
        PyErr_Format(PyExc_TypeError, "%s: unsupported dtype (DLPack code %d, %d bits)", what, dl->dtype.code,
                     dl->dtype.bits);
        return -1;
    }
    out->data = (char *)dl->data + dl->byte_offset;
    out->ndim = dl->ndim;
    out->device_type = dl->device.device_type;
    out->device_id = dl->device.device_id;
    int64_t numel = 1, expect = 1;
    int contiguous = 1;
    for (int i = 0; i < dl->ndim; i++) {
        out->shape[i] = dl->shape[i];
        numel *= dl->shape[i];
    }
    if (dl->strides) {
        for (int i = dl->ndim - 1; i >= 0; i--) {
            if (dl->shape[i] != 1 && dl->strides[i] != expect) contiguous = 0;
            expect *= dl->shape[i];
        }
    }
    out->numel = numel;
    out->contiguous = contiguous || numel == 0;
    return 0;
}

/* __dlpack__ refused obj (an exception is set). A tensor on a device DLPack has no code for (torch's "meta": "Cannot
 * pack tensors on meta") becomes a ValueError naming the argument and the device; anything else keeps its error. */
static void name_unexportable(PyObject *obj, const char *what) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *dev = PyObject_GetAttrString(obj, "device");
    PyObject *kind = dev ? PyObject_GetAttrString(dev, "type") : NULL;
    int cpu = kind ? PyUnicode_Check(kind) && PyUnicode_CompareWithASCIIString(kind, "cpu") == 0 : 1;
    if (!kind) PyErr_Clear();
    if (!cpu) {
        PyErr_Format(PyExc_ValueError, "%s: expected a CPU tensor, got one on %S (it has no memory a CPU kernel could "
                     "read)", what, dev);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
    } else {
        PyErr_Restore(type, value, tb);
    }
    Py_XDECREF(kind);
    Py_XDECREF(dev);
}

const char *acc_dl_device_name(int device_type) {
    switch (device_type) {
    case acc_kDLCPU: return "cpu";
    case acc_kDLCUDA: return "cuda";
    case acc_kDLCUDAHost: return "cuda_host";
    case acc_kDLCUDAManaged: return "cuda_managed";
    case acc_kDLROCM: return "rocm";
    case acc_kDLROCMHost: return "rocm_host";
    case acc_kDLMetal: return "mps";
    case acc_kDLOneAPI: return "xpu";
    case acc_kDLOpenCL: return "opencl";
    case acc_kDLVulkan: return "vulkan";
    case acc_kDLVPI: return "vpi";
    case acc_kDLExtDev: return "ext_dev";
    case acc_kDLWebGPU: return "webgpu";
    case acc_kDLHexagon: return "hexagon";
    case acc_kDLMAIA: return "maia";
    default: return NULL;
    }
}

/* "expected a <want> tensor, got one on <device>:<id>" as a ValueError */
static int wrong_device(const acc_tensor *t, const char *what, const char *want) {
    const char *name = acc_dl_device_name(t->device_type);
    if (name)
        PyErr_Format(PyExc_ValueError, "%s: expected a %s tensor, got one on %s:%d", what, want, name, t->device_id);
    else
        PyErr_Format(PyExc_ValueError, "%s: expected a %s tensor, got one on DLPack device type %d (id %d)", what,
                     want, t->device_type, t->device_id);
    return -1;
}

static const acc_DLPackExchangeAPI *lookup_api(acc_module_state *st, PyObject *obj) {
    PyObject *tp = (PyObject *)Py_TYPE(obj);
    if (st->exchange_api && st->exchange_api_type == tp) return st->exchange_api;
    PyObject *cap = PyObject_GetAttrString(tp, "__dlpack_c_exchange_api__");
    if (!cap) {
        PyErr_Clear();
        return NULL;
    }
    const acc_DLPackExchangeAPI *api = NULL;
    api = (const acc_DLPackExchangeAPI *)PyCapsule_GetPointer(cap, "dlpack_exchange_api");
    if (!api) PyErr_Clear();
    Py_DECREF(cap); /* the table is a static object inside libtorch; it outlives the capsule */
    if (api && api->header.version.major == 1 && api->dltensor_from_py_object_no_sync) {
        PyObject *old = st->exchange_api_type;
        st->exchange_api_type = Py_NewRef(tp);
        Py_XDECREF(old);
        st->exchange_api = api;
        return api;
    }
    return NULL;
}

int acc_tensor_borrow(PyObject *module, PyObject *obj, acc_tensor *out, const char *what) {
    acc_module_state *st = acc_get_state(module);
    const acc_DLPackExchangeAPI *api = lookup_api(st, obj);
    if (api) {
        acc_DLTensor dl;
        memset(&dl, 0, sizeof dl);
        if (api->dltensor_from_py_object_no_sync(obj, &dl) == 0) return fill_from_dl(&dl, out, what);
        PyErr_Clear(); /* fall through to the slow path, which raises a readable error */
    }
    PyObject *det = PyObject_CallMethodObjArgs(obj, st->str_detach, NULL);
    if (!det) {
        PyErr_Clear();
        det = Py_NewRef(obj);
    }
    PyObject *cap = PyObject_CallMethodObjArgs(det, st->str_dlpack, NULL);
    Py_DECREF(det);
    if (!cap) {
        PyObject *exc = PyErr_Occurred();
        if (exc && PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s: expected a tensor, got %R", what, (PyObject *)Py_TYPE(obj));
        } else if (exc) {
            name_unexportable(obj, what);
        }
        return -1;
    }
    acc_DLManagedTensor *mt = (acc_DLManagedTensor *)PyCapsule_GetPointer(cap, "dltensor");
    if (!mt) {
        Py_DECREF(cap);
        return -1;
    }
    int rc = fill_from_dl(&mt->dl_tensor, out, what);
    Py_DECREF(cap); /* capsule destructor calls the deleter: borrow model, the caller keeps obj alive */
    return rc;
}

int acc_tensor_borrow_on(PyObject *module, PyObject *obj, acc_tensor *out, const char *what, int want,
                         int device_type) {
    if (acc_tensor_borrow(module, obj, out, what) < 0) return -1;
    if (out->device_type != device_type) {
        const char *name = device_type == acc_kDLCPU ? "CPU" : acc_dl_device_name(device_type);
        return wrong_device(out, what, name ? name : "device");
    }
    if (!out->contiguous) {
        PyErr_Format(PyExc_ValueError, "%s: expected a contiguous tensor", what);
        return -1;
    }
    if (want >= 0 && (int)out->dtype != want) {
        PyErr_Format(PyExc_TypeError, "%s: expected dtype %s, got %s", what, acc_dtype_name((acc_dtype)want),
                     acc_dtype_name(out->dtype));
        return -1;
    }
    return 0;
}

int acc_tensor_borrow_cpu(PyObject *module, PyObject *obj, acc_tensor *out, const char *what, int want) {
    return acc_tensor_borrow_on(module, obj, out, what, want, acc_kDLCPU);
}
