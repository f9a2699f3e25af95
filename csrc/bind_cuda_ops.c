/* bind_cuda_ops.c: accelerate_c._C_cuda's element-wise and reduction wrappers (cast, multi_scale_, nonfinite,
 * multi_norm, multi_copy), each with its emulate_* twin on CPU tensors (see bind_cuda.c). Scalars that torch keeps on
 * the device (GradScaler's inverse scale, a clip coefficient, an fp8 scale) are read by the kernels from device
 * memory: no host read anywhere.
 * Not for: compute code (csrc/cuda/ops.cu) or the optimizer steps (bind_cuda.c). */
#include <stdlib.h>

#include "bind_cuda.h"

/* a list of float tensors as acc_cuda_buf (PyMem; the caller frees) */
static acc_cuda_buf *borrow_bufs(cu_ctx *c, PyObject *seq, const char *what, Py_ssize_t *count) {
    Py_ssize_t n = cu_seq_len(seq, what);
    if (n < 0) return NULL;
    acc_cuda_buf *b = (acc_cuda_buf *)PyMem_Calloc(n ? (size_t)n : 1, sizeof(acc_cuda_buf));
    if (!b) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        acc_tensor t;
        if (!(b[i].data = cu_borrow(c, cu_seq_item(seq, i), what, i, -1, -1, &t))) {
            PyMem_Free(b);
            return NULL;
        }
        b[i].n = (uint64_t)t.numel, b[i].dtype = t.dtype;
    }
    *count = n;
    return b;
}

/* cast(src, dst, scale, amax, stream): scale None, a number or a float32 scalar tensor on the device; amax None or
 * a float32 scalar tensor on the device */
static PyObject *cast_common(PyObject *module, PyObject *const *args, Py_ssize_t nargs, int dev) {
    if (nargs != 5) return PyErr_Format(PyExc_TypeError, "cast takes 5 arguments (src, dst, scale, amax, stream)");
    cu_ctx c = {module, dev, -1};
    acc_tensor src, dst, t;
    void *stream;
    const float *scale_dev = NULL;
    float *amax = NULL;
    double s = 1.0;
    float sf = 1.0f;
    if (!cu_borrow(&c, args[0], "cast: src", -1, -1, -1, &src) || !cu_borrow(&c, args[1], "cast: dst", -1, -1,
                                                                              src.numel, &dst))
        return NULL;
    if (args[2] != Py_None && cu_scalar(&c, args[2], "cast: scale", &s, &scale_dev) < 0) return NULL;
    if (args[3] != Py_None && !(amax = (float *)cu_borrow(&c, args[3], "cast: amax", -1, ACC_F32, 1, &t))) return NULL;
    if (cu_stream(args[4], &stream) < 0) return NULL;
    sf = (float)s;
    const float *scale_host = args[2] != Py_None && !scale_dev ? &sf : NULL;
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = dev == acc_kDLCPU ? acc_cuda_emulate_cast(src.data, src.dtype, dst.data, dst.dtype, (size_t)src.numel,
                                                   scale_dev ? scale_dev : scale_host, amax)
                           : acc_cuda_cast(src.data, src.dtype, dst.data, dst.dtype, (size_t)src.numel, scale_dev,
                                           scale_host, amax, stream);
    Py_END_ALLOW_THREADS
    if (st) return acc_raise_status(st, "cast");
    Py_RETURN_NONE;
}

/* multi_scale_(tensors, factor, found_inf, stream) */
static PyObject *scale_common(PyObject *module, PyObject *const *args, Py_ssize_t nargs, int dev) {
    if (nargs != 4) return PyErr_Format(PyExc_TypeError, "multi_scale_ takes 4 arguments");
    cu_ctx c = {module, dev, -1};
    Py_ssize_t n = 0;
    acc_tensor t;
    double f = 1.0;
    const float *fdev = NULL;
    float *found = NULL;
    void *stream;
    acc_cuda_buf *b = borrow_bufs(&c, args[0], "multi_scale_: tensors", &n);
    if (!b) return NULL;
    PyObject *ret = NULL;
    if (cu_scalar(&c, args[1], "multi_scale_: factor", &f, &fdev) < 0 || cu_stream(args[3], &stream) < 0) goto done;
    if (args[2] != Py_None &&
        !(found = (float *)cu_borrow(&c, args[2], "multi_scale_: found_inf", -1, ACC_F32, 1, &t)))
        goto done;
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    if (dev == acc_kDLCPU) st = fdev ? ACC_ERR_ARG : acc_cuda_emulate_multi_scale(b, (size_t)n, (float)f, found);
    else st = acc_cuda_multi_scale(b, (size_t)n, (float)f, fdev, found, stream);
    Py_END_ALLOW_THREADS
    if (st) {
        if (fdev && dev == acc_kDLCPU) acc_set_error("the emulation takes a number as the factor");
        acc_raise_status(st, "multi_scale_");
    } else {
        ret = Py_NewRef(Py_None);
    }
done:
    PyMem_Free(b);
    return ret;
}

/* nonfinite(tensors, scale, flag, stream) */
static PyObject *nonfinite_common(PyObject *module, PyObject *const *args, Py_ssize_t nargs, int dev) {
    if (nargs != 4) return PyErr_Format(PyExc_TypeError, "nonfinite takes 4 arguments (tensors, scale, flag, stream)");
    cu_ctx c = {module, dev, -1};
    Py_ssize_t n = 0;
    acc_tensor t;
    double s;
    float *flag;
    void *stream;
    acc_cuda_buf *b = borrow_bufs(&c, args[0], "nonfinite: tensors", &n);
    if (!b) return NULL;
    PyObject *ret = NULL;
    if (cu_double(args[1], &s, "nonfinite: scale") < 0 || cu_stream(args[3], &stream) < 0 ||
        !(flag = (float *)cu_borrow(&c, args[2], "nonfinite: flag", -1, ACC_F32, 1, &t)))
        goto done;
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = dev == acc_kDLCPU ? acc_cuda_emulate_nonfinite(b, (size_t)n, (float)s, flag)
                           : acc_cuda_nonfinite(b, (size_t)n, (float)s, flag, stream);
    Py_END_ALLOW_THREADS
    if (st) acc_raise_status(st, "nonfinite");
    else ret = Py_NewRef(Py_None);
done:
    PyMem_Free(b);
    return ret;
}

/* multi_norm(tensors, norm_type, partials, out, stream): partials a float64 device tensor of at least
 * norm_partials(tensors) elements (ignored by the emulation), out a float32 scalar tensor */
static PyObject *norm_common(PyObject *module, PyObject *const *args, Py_ssize_t nargs, int dev) {
    if (nargs != 5) return PyErr_Format(PyExc_TypeError, "multi_norm takes 5 arguments");
    cu_ctx c = {module, dev, -1};
    Py_ssize_t n = 0;
    acc_tensor t;
    double p;
    double *partials = NULL;
    float *out;
    void *stream;
    acc_cuda_buf *b = borrow_bufs(&c, args[0], "multi_norm: tensors", &n);
    if (!b) return NULL;
    PyObject *ret = NULL;
    if (cu_double(args[1], &p, "multi_norm: norm_type") < 0 || cu_stream(args[4], &stream) < 0 ||
        !(out = (float *)cu_borrow(&c, args[3], "multi_norm: out", -1, ACC_F32, 1, &t)))
        goto done;
    if (dev != acc_kDLCPU) {
        if (!(partials = (double *)cu_borrow(&c, args[2], "multi_norm: partials", -1, ACC_F64, -1, &t))) goto done;
        if ((size_t)t.numel < acc_cuda_norm_partials(b, (size_t)n)) {
            PyErr_Format(PyExc_ValueError, "multi_norm: partials has %lld elements, %zu needed", (long long)t.numel,
                         acc_cuda_norm_partials(b, (size_t)n));
            goto done;
        }
    }
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = dev == acc_kDLCPU ? acc_cuda_emulate_norm(b, (size_t)n, p, out)
                           : acc_cuda_multi_norm(b, (size_t)n, p, partials, out, stream);
    Py_END_ALLOW_THREADS
    if (st) acc_raise_status(st, "multi_norm");
    else ret = Py_NewRef(Py_None);
done:
    PyMem_Free(b);
    return ret;
}

static PyObject *py_norm_partials(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1) return PyErr_Format(PyExc_TypeError, "norm_partials takes 1 argument (a list of numels)");
    Py_ssize_t n = cu_seq_len(args[0], "numels");
    if (n < 0) return NULL;
    size_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long k = PyLong_AsUnsignedLongLong(cu_seq_item(args[0], i));
        if (PyErr_Occurred()) return NULL;
        total += (size_t)((k + ACC_CU_CHUNK - 1) / ACC_CU_CHUNK);
    }
    return PyLong_FromSize_t(total ? total : 1);
}

/* multi_copy(srcs, dsts, stream): dsts[i] = srcs[i] converted (same numel each) */
static PyObject *copy_common(PyObject *module, PyObject *const *args, Py_ssize_t nargs, int dev) {
    if (nargs != 3) return PyErr_Format(PyExc_TypeError, "multi_copy takes 3 arguments (srcs, dsts, stream)");
    cu_ctx c = {module, dev, -1};
    void *stream;
    PyObject *dsts;
    Py_ssize_t n = cu_seq_len(args[0], "multi_copy: srcs");
    if (n < 0 || cu_opt_list(args[1], n, "multi_copy: dsts", &dsts) < 0 || cu_stream(args[2], &stream) < 0)
        return NULL;
    acc_cuda_copy *cs = (acc_cuda_copy *)PyMem_Calloc(n ? (size_t)n : 1, sizeof(acc_cuda_copy));
    if (!cs) return PyErr_NoMemory();
    PyObject *ret = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        acc_tensor s, d;
        if (!(cs[i].src = cu_borrow(&c, cu_seq_item(args[0], i), "multi_copy: srcs", i, -1, -1, &s)) ||
            !(cs[i].dst = cu_borrow(&c, cu_seq_item(dsts, i), "multi_copy: dsts", i, -1, s.numel, &d)))
            goto done;
        cs[i].n = (uint64_t)s.numel, cs[i].src_dtype = s.dtype, cs[i].dst_dtype = d.dtype;
    }
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = dev == acc_kDLCPU ? acc_cuda_emulate_multi_copy(cs, (size_t)n) : acc_cuda_multi_copy(cs, (size_t)n, stream);
    Py_END_ALLOW_THREADS
    if (st) acc_raise_status(st, "multi_copy");
    else ret = Py_NewRef(Py_None);
done:
    PyMem_Free(cs);
    return ret;
}

#define TWINS(name, common)                                                                                       \
    static PyObject *py_##name(PyObject *m, PyObject *const *a, Py_ssize_t n) { return common(m, a, n, acc_kDLCUDA); } \
    static PyObject *py_emulate_##name(PyObject *m, PyObject *const *a, Py_ssize_t n) {                           \
        return common(m, a, n, acc_kDLCPU);                                                                       \
    }
TWINS(cast, cast_common)
TWINS(multi_scale, scale_common)
TWINS(nonfinite, nonfinite_common)
TWINS(multi_norm, norm_common)
TWINS(multi_copy, copy_common)

#define FC(f) (PyCFunction)(void (*)(void))(f), METH_FASTCALL
PyMethodDef acc_cuda_ops_methods[] = {
    {"cast", FC(py_cast),
     "cast($module, src, dst, scale, amax, stream, /)\n--\n\n_C.cast on CUDA tensors: dst = src * scale (None, a number\n"
     "or a float32 CUDA scalar), float8 saturated; amax (None or a float32 CUDA scalar) = max|src|, same pass."},
    {"multi_scale_", FC(py_multi_scale),
     "multi_scale_($module, tensors, factor, found_inf, stream, /)\n--\n\nEvery tensor *= factor (a number or a float32\n"
     "CUDA scalar); found_inf (None or a float32 CUDA scalar) set to 1 if an element was inf/NaN before scaling."},
    {"nonfinite", FC(py_nonfinite),
     "nonfinite($module, tensors, scale, flag, stream, /)\n--\n\nflag (float32 CUDA scalar) = 1 if any element times\n"
     "scale is inf/NaN, else 0; nothing read back on the host."},
    {"multi_norm", FC(py_multi_norm),
     "multi_norm($module, tensors, norm_type, partials, out, stream, /)\n--\n\nThe global norm (1, 2, inf) in fp64 into\n"
     "out (float32 CUDA scalar); partials: float64 CUDA scratch of norm_partials([numel, ...]) elements."},
    {"norm_partials", FC(py_norm_partials),
     "norm_partials($module, numels, /)\n--\n\nThe scratch multi_norm needs for tensors of these sizes."},
    {"multi_copy", FC(py_multi_copy),
     "multi_copy($module, srcs, dsts, stream, /)\n--\n\ndsts[i] = srcs[i] converted (float32/bfloat16/float16), one launch\n"
     "for the list: the sharded engine's copy-in and copy-out."},
    {"emulate_cast", FC(py_emulate_cast), "cast's plan and thread code on CPU tensors (tests)."},
    {"emulate_multi_scale_", FC(py_emulate_multi_scale), "multi_scale_'s, on CPU tensors (tests)."},
    {"emulate_nonfinite", FC(py_emulate_nonfinite), "nonfinite's, on CPU tensors (tests)."},
    {"emulate_multi_norm", FC(py_emulate_multi_norm), "multi_norm's, on CPU tensors (tests; partials ignored)."},
    {"emulate_multi_copy", FC(py_emulate_multi_copy), "multi_copy's, on CPU tensors (tests)."},
    {NULL, NULL, 0, NULL},
};
