/* bind_ops.c: Python bindings of the ops subsystem (METH_FASTCALL wrappers: parse, borrow tensors through
 * DLPack, release the GIL, call the compute code, turn its acc_status into an exception).
 * Not for: compute code (ops/cast.c, ops/gradops.c) or allocation: accelerate_c/ops.py allocates
 * every output and passes it in, and falls back to torch for tensors these functions do not take
 * (non-CPU, non-contiguous, other dtypes). */
#include <stdio.h>
#include <stdlib.h>

#include "bind_util.h"
#include "ops/cast.h"
#include "ops/gradops.h"
#include "ops/pack.h"
#include "parallel.h"
#include "tensor.h"

/* A 1-element fp32 CPU tensor (scale, amax, found_inf, inv_scale). */
static int borrow_scalar(PyObject *m, PyObject *obj, acc_tensor *t, const char *what) {
    if (acc_tensor_borrow_cpu(m, obj, t, what, ACC_F32) < 0) return -1;
    if (t->numel != 1) {
        PyErr_Format(PyExc_ValueError, "%s: expected one element, got %lld", what, (long long)t->numel);
        return -1;
    }
    return 0;
}

static int get_threads(PyObject *obj, int *out) {
    long v = PyLong_AsLong(obj);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = v < 1 ? 1 : (v > ACC_MAX_THREADS ? ACC_MAX_THREADS : (int)v);
    return 0;
}

static PyObject *ops_cast(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) return PyErr_Format(PyExc_TypeError, "cast takes 5 arguments (src, dst, scale, amax, nthreads)");
    acc_tensor src, dst, sc, am;
    int nthreads;
    if (acc_tensor_borrow_cpu(m, args[0], &src, "cast: src", -1) < 0) return NULL;
    if (acc_tensor_borrow_cpu(m, args[1], &dst, "cast: dst", -1) < 0) return NULL;
    if (src.numel != dst.numel)
        return PyErr_Format(PyExc_ValueError, "cast: src has %lld elements, dst %lld", (long long)src.numel,
                            (long long)dst.numel);
    float scale, amax = 0.0f;
    const float *scale_p = NULL;
    if (args[2] != Py_None) {
        if (PyFloat_Check(args[2]) || PyLong_Check(args[2])) {
            double d = PyFloat_AsDouble(args[2]);
            if (d == -1.0 && PyErr_Occurred()) return NULL;
            scale = (float)d; /* round to nearest, as torch does with a Python scalar */
        } else {
            if (borrow_scalar(m, args[2], &sc, "cast: scale") < 0) return NULL;
            scale = *(const float *)sc.data;
        }
        scale_p = &scale;
    }
    if (args[3] != Py_None && borrow_scalar(m, args[3], &am, "cast: amax") < 0) return NULL;
    if (get_threads(args[4], &nthreads) < 0) return NULL;
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = acc_cast(src.data, src.dtype, dst.data, dst.dtype, (size_t)src.numel, scale_p,
                  args[3] != Py_None ? &amax : NULL, nthreads, NULL);
    Py_END_ALLOW_THREADS
    if (st) return acc_raise_status(st, "cast");
    if (args[3] != Py_None) *(float *)am.data = amax;
    Py_RETURN_NONE;
}

/* Borrows every tensor of a sequence into a freshly allocated acc_buf array. *hold keeps the items alive
 * (a tuple copy of the sequence) while the GIL is released. */
static acc_buf *borrow_list(PyObject *m, PyObject *seq, size_t *n, PyObject **hold, const char *what) {
    PyObject *tup = PySequence_Tuple(seq);
    if (!tup) return NULL;
    Py_ssize_t cnt = PyTuple_Size(tup);
    acc_buf *bufs = (acc_buf *)PyMem_Malloc(sizeof(acc_buf) * (size_t)(cnt ? cnt : 1));
    if (!bufs) {
        Py_DECREF(tup);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < cnt; i++) {
        acc_tensor t;
        char name[96];
        snprintf(name, sizeof name, "%s[%zd]", what, i);
        if (acc_tensor_borrow_cpu(m, PyTuple_GetItem(tup, i), &t, name, -1) < 0) {
            PyMem_Free(bufs);
            Py_DECREF(tup);
            return NULL;
        }
        bufs[i] = (acc_buf){t.data, (size_t)t.numel, t.dtype};
    }
    *n = (size_t)cnt;
    *hold = tup;
    return bufs;
}

static PyObject *ops_multi_scale(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4)
        return PyErr_Format(PyExc_TypeError, "multi_scale_ takes 4 arguments (tensors, factor, found_inf, nthreads)");
    acc_tensor fi, fa;
    float factor;
    int nthreads;
    if (PyFloat_Check(args[1]) || PyLong_Check(args[1])) {
        double d = PyFloat_AsDouble(args[1]);
        if (d == -1.0 && PyErr_Occurred()) return NULL;
        factor = (float)d;
    } else {
        if (borrow_scalar(m, args[1], &fa, "multi_scale_: factor") < 0) return NULL;
        factor = *(const float *)fa.data;
    }
    float found = 0.0f;
    if (args[2] != Py_None && borrow_scalar(m, args[2], &fi, "multi_scale_: found_inf") < 0) return NULL;
    if (get_threads(args[3], &nthreads) < 0) return NULL;
    size_t n;
    PyObject *hold;
    acc_buf *bufs = borrow_list(m, args[0], &n, &hold, "multi_scale_: tensors");
    if (!bufs) return NULL;
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = acc_multi_scale(bufs, n, factor, args[2] != Py_None ? &found : NULL, nthreads, NULL);
    Py_END_ALLOW_THREADS
    PyMem_Free(bufs);
    Py_DECREF(hold);
    if (st) return acc_raise_status(st, "multi_scale_");
    if (args[2] != Py_None && found != 0.0f) *(float *)fi.data = 1.0f;
    Py_RETURN_NONE;
}

static PyObject *ops_multi_norm(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) return PyErr_Format(PyExc_TypeError, "multi_norm takes 3 arguments (tensors, norm_type, nthreads)");
    double p = PyFloat_AsDouble(args[1]);
    if (p == -1.0 && PyErr_Occurred()) return NULL;
    int nthreads;
    if (get_threads(args[2], &nthreads) < 0) return NULL;
    size_t n;
    PyObject *hold;
    acc_buf *bufs = borrow_list(m, args[0], &n, &hold, "multi_norm: tensors");
    if (!bufs) return NULL;
    double out = 0;
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = acc_multi_norm(bufs, n, p, &out, nthreads, NULL);
    Py_END_ALLOW_THREADS
    PyMem_Free(bufs);
    Py_DECREF(hold);
    if (st) return acc_raise_status(st, "multi_norm");
    return PyFloat_FromDouble(out);
}

/* pack(dst, srcs, offsets, nthreads): srcs[i] (a contiguous CPU tensor, or None: zeros) at element
 * offsets[i] of dst, converted to dst's dtype; everything else in dst zeroed. */
static PyObject *ops_pack(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) return PyErr_Format(PyExc_TypeError, "pack takes 4 arguments (dst, srcs, offsets, nthreads)");
    acc_tensor dst;
    int nthreads;
    if (acc_tensor_borrow_cpu(m, args[0], &dst, "pack: dst", -1) < 0) return NULL;
    if (get_threads(args[3], &nthreads) < 0) return NULL;
    PyObject *srcs = PySequence_Tuple(args[1]);
    if (!srcs) return NULL;
    PyObject *offs = PySequence_Tuple(args[2]);
    if (!offs) {
        Py_DECREF(srcs);
        return NULL;
    }
    Py_ssize_t cnt = PyTuple_Size(srcs);
    acc_pack_piece *pieces = NULL;
    PyObject *result = NULL;
    if (PyTuple_Size(offs) != cnt) {
        PyErr_Format(PyExc_ValueError, "pack: %zd sources but %zd offsets", cnt, PyTuple_Size(offs));
        goto done;
    }
    pieces = (acc_pack_piece *)PyMem_Malloc(sizeof(acc_pack_piece) * (size_t)(cnt ? cnt : 1));
    if (!pieces) {
        PyErr_NoMemory();
        goto done;
    }
    size_t np = 0;
    for (Py_ssize_t i = 0; i < cnt; i++) {
        PyObject *s = PyTuple_GetItem(srcs, i);
        if (s == Py_None) continue; /* zeros: the kernel zeroes whatever no piece covers */
        long long off = PyLong_AsLongLong(PyTuple_GetItem(offs, i));
        if (off == -1 && PyErr_Occurred()) goto done;
        if (off < 0) {
            PyErr_Format(PyExc_ValueError, "pack: offsets[%zd] = %lld is negative", i, off);
            goto done;
        }
        acc_tensor t;
        char name[64];
        snprintf(name, sizeof name, "pack: srcs[%zd]", i);
        if (acc_tensor_borrow_cpu(m, s, &t, name, -1) < 0) goto done;
        pieces[np++] = (acc_pack_piece){t.data, t.dtype, (size_t)off, (size_t)t.numel};
    }
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = acc_pack(pieces, np, dst.data, dst.dtype, (size_t)dst.numel, nthreads, NULL);
    Py_END_ALLOW_THREADS
    if (st) {
        acc_raise_status(st, "pack");
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(pieces);
    Py_DECREF(srcs);
    Py_DECREF(offs);
    return result;
}

PyMethodDef acc_ops_methods[] = {
    {"cast", (PyCFunction)(void (*)(void))ops_cast, METH_FASTCALL,
     "cast($module, src, dst, scale, amax, nthreads, /)\n--\n\n"
     "dst[:] = src * scale, rounded to dst's dtype (float8: saturated). src, dst: contiguous CPU tensors of\n"
     "the same numel; scale: None, a float or a 1-element fp32 tensor; amax: None or a 1-element fp32 tensor\n"
     "that receives max|src| (before scaling)."},
    {"multi_scale_", (PyCFunction)(void (*)(void))ops_multi_scale, METH_FASTCALL,
     "multi_scale_($module, tensors, factor, found_inf, nthreads, /)\n--\n\n"
     "Multiply every tensor in place by factor (float or 1-element fp32 tensor; 1.0 writes nothing). When\n"
     "found_inf (1-element fp32 tensor) is given, set it to 1.0 if any input element is inf or NaN."},
    {"multi_norm", (PyCFunction)(void (*)(void))ops_multi_norm, METH_FASTCALL,
     "multi_norm($module, tensors, norm_type, nthreads, /)\n--\n\n"
     "The norm (1, 2 or inf) of all elements of all tensors, accumulated in fp64; returns a float."},
    {"pack", (PyCFunction)(void (*)(void))ops_pack, METH_FASTCALL,
     "pack($module, dst, srcs, offsets, nthreads, /)\n--\n\n"
     "dst[offsets[i]:offsets[i] + srcs[i].numel()] = srcs[i] converted to dst's dtype (float32 / bfloat16 /\n"
     "float16, round-to-nearest-even as torch's .to()); every element no source covers (None sources, gaps, the\n"
     "tail) is zeroed. Sources: contiguous CPU tensors in increasing offset order, not overlapping; dst contiguous."},
    {NULL, NULL, 0, NULL},
};
