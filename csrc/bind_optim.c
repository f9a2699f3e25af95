/* bind_optim.c: Python bindings of the optim subsystem (METH_FASTCALL wrappers: parse, borrow tensors through
 * DLPack, release the GIL, call the compute code, turn its acc_status into an exception).
 * Each call takes *lists* of tensors (one optimizer param group, or one flat buffer in a 1-element list), so
 * ~150 tensors cost one call, ~50 ns of borrowing per tensor and one parallel region.
 * adam_step also splits its tensors between the fp32-state and the low-precision-state kernels (adam_run).
 * Not for: compute code (optim/adam.c, optim/sgd.c, optim/optim_util.c never include Python.h). */
#include <stdlib.h>

#include "bind_util.h"
#include "optim/adam.h"
#include "optim/optim_util.h"
#include "optim/qmap.h"
#include "optim/sgd.h"
#include "tensor.h"

/* ---- small helpers --------------------------------------------------------------------------------- */

static Py_ssize_t seq_len(PyObject *seq, const char *what) {
    if (PyList_Check(seq)) return PyList_Size(seq);
    if (PyTuple_Check(seq)) return PyTuple_Size(seq);
    PyErr_Format(PyExc_TypeError, "%s must be a list or tuple of tensors", what);
    return -1;
}

static PyObject *seq_item(PyObject *seq, Py_ssize_t i) { /* borrowed */
    return PyList_Check(seq) ? PyList_GetItem(seq, i) : PyTuple_GetItem(seq, i);
}

/* Optional list argument: None -> NULL; otherwise must have length n. */
static int opt_list(PyObject *obj, Py_ssize_t n, const char *what, PyObject **out) {
    if (obj == Py_None) {
        *out = NULL;
        return 0;
    }
    Py_ssize_t k = seq_len(obj, what);
    if (k < 0) return -1;
    if (k != n) {
        PyErr_Format(PyExc_ValueError, "%s has %zd entries, expected %zd", what, k, n);
        return -1;
    }
    *out = obj;
    return 0;
}

/* Borrows seq[i] as a contiguous CPU tensor of `want` dtype (-1: any) with `numel` elements (-1: any). */
static void *borrow_item(PyObject *module, PyObject *seq, Py_ssize_t i, const char *what, int want, int64_t numel,
                         acc_tensor *t) {
    PyObject *obj = seq_item(seq, i);
    if (!obj) return NULL;
    if (acc_tensor_borrow_cpu(module, obj, t, what, want) < 0) return NULL;
    if (numel >= 0 && t->numel != numel) {
        PyErr_Format(PyExc_ValueError, "%s[%zd] has %lld elements, the param has %lld", what, i, (long long)t->numel,
                     (long long)numel);
        return NULL;
    }
    /* a 0-element tensor may have a NULL data pointer; kernels never touch it */
    static char dummy[64];
    return t->data ? t->data : dummy;
}

static int grad_dtype_ok(acc_dtype d) { return d == ACC_F32 || d == ACC_BF16 || d == ACC_F16; }

static int get_double(PyObject *o, double *out, const char *what) {
    *out = PyFloat_AsDouble(o);
    if (*out == -1.0 && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "%s must be a number", what);
        return -1;
    }
    return 0;
}

static int get_int(PyObject *o, int *out) {
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = (int)v;
    return 0;
}

/* Item i's param (fp32) and grad (fp32/bf16/fp16, same numel): the part every optimizer kernel shares. */
static int borrow_param_grad(PyObject *module, PyObject *params, PyObject *grads, Py_ssize_t i, float **param,
                             const void **grad, acc_dtype *grad_dtype, int64_t *numel) {
    acc_tensor t;
    if (!(*param = borrow_item(module, params, i, "params", ACC_F32, -1, &t))) return -1;
    *numel = t.numel;
    if (!(*grad = borrow_item(module, grads, i, "grads", -1, *numel, &t))) return -1;
    *grad_dtype = t.dtype;
    if (!grad_dtype_ok(t.dtype)) {
        PyErr_Format(PyExc_TypeError, "grads[%zd]: dtype %s not supported", i, acc_dtype_name(t.dtype));
        return -1;
    }
    return 0;
}

/* Item i's optional outputs: a bf16/fp16 copy (low_precision_outs) and an fp32 copy (mirrors) of the
 * updated param; lists or entries that are None leave the pointer NULL. */
static int borrow_outputs(PyObject *module, PyObject *lps, PyObject *mirrors, Py_ssize_t i, int64_t numel,
                          void **lp_out, acc_dtype *lp_dtype, float **mirror) {
    acc_tensor t;
    if (lps && seq_item(lps, i) != Py_None) {
        if (!(*lp_out = borrow_item(module, lps, i, "low_precision_outs", -1, numel, &t))) return -1;
        if (t.dtype != ACC_BF16 && t.dtype != ACC_F16) {
            PyErr_Format(PyExc_TypeError, "low_precision_outs[%zd] must be bfloat16 or float16", i);
            return -1;
        }
        *lp_dtype = t.dtype;
    }
    if (mirrors && seq_item(mirrors, i) != Py_None &&
        !(*mirror = borrow_item(module, mirrors, i, "mirrors", ACC_F32, numel, &t)))
        return -1;
    return 0;
}

/* Item i's exp_avg / exp_avg_sq: fp32, bf16 or 8-bit codes (uint8, with per-block fp32 absmax lists), the same
 * dtype for both; optional slice offset and rounding salt (non-negative ints). */
static int borrow_state(PyObject *module, PyObject *ms, PyObject *vs, PyObject *am_list, PyObject *av_list,
                        PyObject *offsets, PyObject *salts, Py_ssize_t i, int64_t numel, acc_adam_tensor *x) {
    acc_tensor t;
    if (!(x->exp_avg = borrow_item(module, ms, i, "exp_avgs", -1, numel, &t))) return -1;
    acc_dtype sd = t.dtype;
    if (sd != ACC_F32 && sd != ACC_BF16 && sd != ACC_U8) {
        PyErr_Format(PyExc_TypeError, "exp_avgs[%zd]: state dtype %s not supported (float32, bfloat16, uint8 codes)",
                     i, acc_dtype_name(sd));
        return -1;
    }
    if (!(x->exp_avg_sq = borrow_item(module, vs, i, "exp_avg_sqs", (int)sd, numel, &t))) return -1;
    x->state_dtype = sd;
    if (sd == ACC_U8) {
        int64_t nb = (numel + ACC_QBLOCK - 1) / ACC_QBLOCK;
        if (!am_list || !av_list || seq_item(am_list, i) == Py_None || seq_item(av_list, i) == Py_None) {
            PyErr_Format(PyExc_ValueError, "exp_avgs[%zd] holds 8-bit codes: its absmax tensors are required", i);
            return -1;
        }
        if (!(x->exp_avg_absmax = borrow_item(module, am_list, i, "exp_avg_absmaxes", ACC_F32, nb, &t))) return -1;
        if (!(x->exp_avg_sq_absmax = borrow_item(module, av_list, i, "exp_avg_sq_absmaxes", ACC_F32, nb, &t)))
            return -1;
    }
    if (offsets && seq_item(offsets, i) != Py_None) {
        x->offset = PyLong_AsUnsignedLongLong(seq_item(offsets, i));
        if (PyErr_Occurred()) return -1;
    }
    if (salts && seq_item(salts, i) != Py_None) {
        x->salt = PyLong_AsUnsignedLongLong(seq_item(salts, i));
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}

/* ---- adam_step --------------------------------------------------------------------------------------- */

/* The fp32 / low-precision-state split of one call: every tensor passes acc_adam_check first (no memory touched
 * before all are valid), then the bf16 / 8-bit state tensors go to adam_lowbit.c's kernel and the fp32 ones to
 * adam.c's. The compute files do not call each other for this. */
static acc_status adam_run(const acc_adam_config *cfg, const acc_adam_tensor *ts, size_t n, int nthreads) {
    acc_status st = acc_adam_check(cfg, ts, n);
    if (st) return st;
    size_t nlow = 0;
    for (size_t k = 0; k < n; k++) nlow += ts[k].state_dtype != ACC_F32;
    if (!nlow) return acc_adam_step(cfg, ts, n, nthreads);
    const acc_adam_tensor **low = (const acc_adam_tensor **)malloc(nlow * sizeof(*low));
    acc_adam_tensor *rest = (acc_adam_tensor *)malloc((n - nlow + 1) * sizeof(*rest));
    if (!low || !rest) {
        free(low);
        free(rest);
        return ACC_ERR_NOMEM;
    }
    size_t a = 0, b = 0;
    for (size_t k = 0; k < n; k++) {
        if (ts[k].state_dtype != ACC_F32) low[a++] = &ts[k];
        else rest[b++] = ts[k];
    }
    st = acc_adam_lowbit_step(cfg, low, nlow, nthreads);
    if (st == ACC_OK && b) st = acc_adam_step(cfg, rest, b, nthreads);
    free(low);
    free(rest);
    return st;
}

static PyObject *py_adam_step(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 18 || nargs > 23)
        return PyErr_Format(PyExc_TypeError, "adam_step takes 18 to 23 positional arguments (%zd given)", nargs);
    PyObject *params = args[0], *grads = args[1], *ms = args[2], *vs = args[3], *maxs = NULL, *lps = NULL;
    PyObject *mirrors = NULL, *am_list = NULL, *av_list = NULL, *offsets = NULL, *salts = NULL;
    PyObject *steps = args[5];
    acc_adam_config cfg;
    int nthreads = 1, step_list = 0;
    double step_value = 0;
    if (get_double(args[7], &cfg.lr, "lr") < 0 || get_double(args[8], &cfg.beta1, "beta1") < 0 ||
        get_double(args[9], &cfg.beta2, "beta2") < 0 || get_double(args[10], &cfg.eps, "eps") < 0 ||
        get_double(args[11], &cfg.weight_decay, "weight_decay") < 0 ||
        get_double(args[15], &cfg.grad_scale, "grad_scale") < 0)
        return NULL;
    cfg.decoupled = PyObject_IsTrue(args[12]);
    cfg.amsgrad = PyObject_IsTrue(args[13]);
    cfg.maximize = PyObject_IsTrue(args[14]);
    cfg.lr_is_f32_tensor = PyObject_IsTrue(args[17]);
    if (cfg.decoupled < 0 || cfg.amsgrad < 0 || cfg.maximize < 0 || cfg.lr_is_f32_tensor < 0 ||
        get_int(args[16], &nthreads) < 0)
        return NULL;
    Py_ssize_t n = seq_len(params, "params");
    if (n < 0) return NULL;
    PyObject *tmp;
    if (opt_list(grads, n, "grads", &tmp) < 0 || !tmp || opt_list(ms, n, "exp_avgs", &tmp) < 0 || !tmp ||
        opt_list(vs, n, "exp_avg_sqs", &tmp) < 0 || !tmp) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "grads, exp_avgs and exp_avg_sqs are required");
        return NULL;
    }
    if (opt_list(args[4], n, "max_exp_avg_sqs", &maxs) < 0 || opt_list(args[6], n, "low_precision_outs", &lps) < 0 ||
        (nargs > 18 && opt_list(args[18], n, "mirrors", &mirrors) < 0) ||
        (nargs > 19 && opt_list(args[19], n, "exp_avg_absmaxes", &am_list) < 0) ||
        (nargs > 20 && opt_list(args[20], n, "exp_avg_sq_absmaxes", &av_list) < 0) ||
        (nargs > 21 && opt_list(args[21], n, "offsets", &offsets) < 0) ||
        (nargs > 22 && opt_list(args[22], n, "salts", &salts) < 0))
        return NULL;
    if (cfg.amsgrad && !maxs) return PyErr_Format(PyExc_ValueError, "amsgrad needs max_exp_avg_sqs");
    if (PyList_Check(steps) || PyTuple_Check(steps)) {
        if (opt_list(steps, n, "steps", &tmp) < 0) return NULL;
        step_list = 1;
    } else if (get_double(steps, &step_value, "step") < 0) {
        return NULL;
    }
    acc_adam_tensor *ts = (acc_adam_tensor *)calloc(n ? (size_t)n : 1, sizeof(acc_adam_tensor));
    acc_tensor *st_t = step_list ? (acc_tensor *)calloc(n ? (size_t)n : 1, sizeof(acc_tensor)) : NULL;
    if (!ts || (step_list && !st_t)) {
        free(ts);
        free(st_t);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        acc_tensor t;
        acc_adam_tensor *x = &ts[i];
        int64_t numel;
        if (borrow_param_grad(module, params, grads, i, &x->param, &x->grad, &x->grad_dtype, &numel) < 0) goto fail;
        x->n = (size_t)numel;
        if (borrow_state(module, ms, vs, am_list, av_list, offsets, salts, i, numel, x) < 0) goto fail;
        if (cfg.amsgrad && !(x->max_exp_avg_sq = borrow_item(module, maxs, i, "max_exp_avg_sqs", ACC_F32, numel, &t)))
            goto fail;
        if (borrow_outputs(module, lps, mirrors, i, numel, &x->lp_out, &x->lp_dtype, &x->mirror) < 0) goto fail;
        if (step_list) {
            if (!borrow_item(module, steps, i, "steps", -1, 1, &st_t[i])) goto fail;
            if (st_t[i].dtype == ACC_F32) x->step = (double)*(float *)st_t[i].data + 1.0;
            else if (st_t[i].dtype == ACC_F64) x->step = *(double *)st_t[i].data + 1.0;
            else {
                PyErr_Format(PyExc_TypeError, "steps[%zd] must be a float32 or float64 scalar tensor", i);
                goto fail;
            }
        } else {
            x->step = step_value;
        }
    }
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = adam_run(&cfg, ts, (size_t)n, nthreads);
    Py_END_ALLOW_THREADS
    if (st != ACC_OK) {
        acc_raise_status(st, "adam_step");
        goto fail;
    }
    /* the step counters advance only once the update has been applied (torch: step_t += 1) */
    for (Py_ssize_t i = 0; step_list && i < n; i++) {
        if (st_t[i].dtype == ACC_F32) *(float *)st_t[i].data = (float)ts[i].step;
        else *(double *)st_t[i].data = ts[i].step;
    }
    free(ts);
    free(st_t);
    Py_RETURN_NONE;
fail:
    free(ts);
    free(st_t);
    return NULL;
}

/* ---- sgd_step ---------------------------------------------------------------------------------------- */

static PyObject *py_sgd_step(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 13 && nargs != 14)
        return PyErr_Format(PyExc_TypeError, "sgd_step takes 13 or 14 positional arguments (%zd given)", nargs);
    PyObject *params = args[0], *grads = args[1], *bufs = NULL, *inits = NULL, *lps = NULL, *mirrors = NULL, *tmp;
    acc_sgd_config cfg;
    int nthreads = 1;
    if (get_double(args[5], &cfg.lr, "lr") < 0 || get_double(args[6], &cfg.momentum, "momentum") < 0 ||
        get_double(args[7], &cfg.dampening, "dampening") < 0 ||
        get_double(args[8], &cfg.weight_decay, "weight_decay") < 0 ||
        get_double(args[11], &cfg.grad_scale, "grad_scale") < 0)
        return NULL;
    cfg.nesterov = PyObject_IsTrue(args[9]);
    cfg.maximize = PyObject_IsTrue(args[10]);
    if (cfg.nesterov < 0 || cfg.maximize < 0 || get_int(args[12], &nthreads) < 0) return NULL;
    Py_ssize_t n = seq_len(params, "params");
    if (n < 0) return NULL;
    if (opt_list(grads, n, "grads", &tmp) < 0) return NULL;
    if (!tmp) return PyErr_Format(PyExc_TypeError, "grads is required");
    if (opt_list(args[2], n, "momentum_buffers", &bufs) < 0 || opt_list(args[3], n, "init_buffers", &inits) < 0 ||
        opt_list(args[4], n, "low_precision_outs", &lps) < 0 ||
        (nargs == 14 && opt_list(args[13], n, "mirrors", &mirrors) < 0))
        return NULL;
    if (cfg.momentum != 0.0 && !bufs) return PyErr_Format(PyExc_ValueError, "momentum != 0 needs momentum_buffers");
    acc_sgd_tensor *ts = (acc_sgd_tensor *)calloc(n ? (size_t)n : 1, sizeof(acc_sgd_tensor));
    if (!ts) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        acc_tensor t;
        acc_sgd_tensor *x = &ts[i];
        int64_t numel;
        if (borrow_param_grad(module, params, grads, i, &x->param, &x->grad, &x->grad_dtype, &numel) < 0) goto fail;
        x->n = (size_t)numel;
        if (cfg.momentum != 0.0) {
            if (!(x->momentum_buf = borrow_item(module, bufs, i, "momentum_buffers", ACC_F32, numel, &t))) goto fail;
            if (inits) {
                int b = PyObject_IsTrue(seq_item(inits, i));
                if (b < 0) goto fail;
                x->init_buf = b;
            }
        }
        if (borrow_outputs(module, lps, mirrors, i, numel, &x->lp_out, &x->lp_dtype, &x->mirror) < 0) goto fail;
    }
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = acc_sgd_step(&cfg, ts, (size_t)n, nthreads);
    Py_END_ALLOW_THREADS
    free(ts);
    if (st != ACC_OK) return acc_raise_status(st, "sgd_step");
    Py_RETURN_NONE;
fail:
    free(ts);
    return NULL;
}

/* ---- grads_nonfinite --------------------------------------------------------------------------------- */

static PyObject *py_grads_nonfinite(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) return PyErr_Format(PyExc_TypeError, "grads_nonfinite takes 3 positional arguments");
    double scale;
    int nthreads;
    if (get_double(args[1], &scale, "scale") < 0 || get_int(args[2], &nthreads) < 0) return NULL;
    Py_ssize_t n = seq_len(args[0], "grads");
    if (n < 0) return NULL;
    size_t cap = n ? (size_t)n : 1;
    const void **ptrs = (const void **)malloc(cap * sizeof(void *));
    acc_dtype *dts = (acc_dtype *)malloc(cap * sizeof(acc_dtype));
    size_t *ns = (size_t *)malloc(cap * sizeof(size_t));
    PyObject *ret = NULL;
    if (!ptrs || !dts || !ns) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        acc_tensor t;
        if (!(ptrs[i] = borrow_item(module, args[0], i, "grads", -1, -1, &t))) goto done;
        if (!grad_dtype_ok(t.dtype)) {
            PyErr_Format(PyExc_TypeError, "grads[%zd]: dtype %s not supported", i, acc_dtype_name(t.dtype));
            goto done;
        }
        dts[i] = t.dtype;
        ns[i] = (size_t)t.numel;
    }
    int found = 0;
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = acc_grads_nonfinite(ptrs, dts, ns, (size_t)n, (float)scale, nthreads, &found);
    Py_END_ALLOW_THREADS
    if (st != ACC_OK) acc_raise_status(st, "grads_nonfinite");
    else ret = PyBool_FromLong(found);
done:
    free(ptrs);
    free(dts);
    free(ns);
    return ret;
}

/* ---- 8-bit block-wise conversions and the code maps ---------------------------------------------------- */

static PyObject *py_quantize_blockwise(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) return PyErr_Format(PyExc_TypeError, "quantize_blockwise takes 5 positional arguments");
    acc_tensor x, c, a;
    int sg = PyObject_IsTrue(args[3]), nthreads;
    if (sg < 0 || get_int(args[4], &nthreads) < 0) return NULL;
    if (acc_tensor_borrow_cpu(module, args[0], &x, "x", ACC_F32) < 0 ||
        acc_tensor_borrow_cpu(module, args[1], &c, "codes", ACC_U8) < 0 ||
        acc_tensor_borrow_cpu(module, args[2], &a, "absmax", ACC_F32) < 0)
        return NULL;
    if (c.numel != x.numel || a.numel != (x.numel + ACC_QBLOCK - 1) / ACC_QBLOCK)
        return PyErr_Format(PyExc_ValueError, "quantize_blockwise: codes must have %lld elements and absmax %lld",
                            (long long)x.numel, (long long)((x.numel + ACC_QBLOCK - 1) / ACC_QBLOCK));
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = acc_quantize_blockwise((const float *)x.data, (size_t)x.numel, sg, (uint8_t *)c.data, (float *)a.data,
                                nthreads);
    Py_END_ALLOW_THREADS
    if (st != ACC_OK) return acc_raise_status(st, "quantize_blockwise");
    Py_RETURN_NONE;
}

static PyObject *py_dequantize_blockwise(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) return PyErr_Format(PyExc_TypeError, "dequantize_blockwise takes 5 positional arguments");
    acc_tensor x, c, a;
    int sg = PyObject_IsTrue(args[3]), nthreads;
    if (sg < 0 || get_int(args[4], &nthreads) < 0) return NULL;
    if (acc_tensor_borrow_cpu(module, args[0], &c, "codes", ACC_U8) < 0 ||
        acc_tensor_borrow_cpu(module, args[1], &a, "absmax", ACC_F32) < 0 ||
        acc_tensor_borrow_cpu(module, args[2], &x, "out", ACC_F32) < 0)
        return NULL;
    if (c.numel != x.numel || a.numel != (x.numel + ACC_QBLOCK - 1) / ACC_QBLOCK)
        return PyErr_Format(PyExc_ValueError, "dequantize_blockwise: codes must have %lld elements and absmax %lld",
                            (long long)x.numel, (long long)((x.numel + ACC_QBLOCK - 1) / ACC_QBLOCK));
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = acc_dequantize_blockwise((const uint8_t *)c.data, (const float *)a.data, (size_t)x.numel, sg,
                                  (float *)x.data, nthreads);
    Py_END_ALLOW_THREADS
    if (st != ACC_OK) return acc_raise_status(st, "dequantize_blockwise");
    Py_RETURN_NONE;
}

static PyObject *float_list(const float *v, int n) {
    PyObject *l = PyList_New(n);
    for (int i = 0; l && i < n; i++) {
        PyObject *f = PyFloat_FromDouble((double)v[i]);
        if (!f) {
            Py_DECREF(l);
            return NULL;
        }
        PyList_SetItem(l, i, f);
    }
    return l;
}

static PyObject *code_list(const acc_qmap *q, int sg) {
    float v[256];
    for (int c = 0; c < 256; c++) v[c] = acc_q_decode(q, sg, (uint8_t)c, 1.0f);
    return float_list(v, 256);
}

static PyObject *py_qmap_tables(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1) return PyErr_Format(PyExc_TypeError, "qmap_tables takes 1 positional argument");
    int sg = PyObject_IsTrue(args[0]);
    if (sg < 0) return NULL;
    const acc_qmap *q = acc_qmap_get(sg);
    return Py_BuildValue("{s:i,s:N,s:N,s:N,s:N,s:N,s:N}", "nd", q->nd, "thr", float_list(q->thr, q->nd),
                         "k1", float_list(q->k1, q->nd), "k0", float_list(q->k0, q->nd),
                         "step", float_list(q->step, q->nd), "off", float_list(q->off, q->nd),
                         "code", code_list(q, sg));
}

PyMethodDef acc_optim_methods[] = {
    {"adam_step", (PyCFunction)(void (*)(void))py_adam_step, METH_FASTCALL,
     "adam_step($module, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, low_precision_outs, lr, "
     "beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize, grad_scale, nthreads, lr_is_f32_tensor, "
     "mirrors=None, exp_avg_absmaxes=None, exp_avg_sq_absmaxes=None, offsets=None, salts=None, /)\n--\n\n"
     "One fused Adam/AdamW step over lists of contiguous CPU tensors (fp32 params/state; fp32, bf16 or fp16 grads).\n"
     "max_exp_avg_sqs: list (amsgrad) or None. steps: list of 0-d float tensors (incremented by 1 after the\n"
     "update, torch's state['step']) or a number (the step this update makes, >= 1). low_precision_outs: None or a\n"
     "list of bf16/fp16 tensors (or None entries) that receive the updated params. Gradients are multiplied by\n"
     "grad_scale. No non-finite check here (see grads_nonfinite). lr_is_f32_tensor: round lr/bc1 and 1-lr*wd in\n"
     "float32 like torch does when the group's lr is a float32 tensor. mirrors: None or a list of fp32 tensors (or\n"
     "None entries) that also receive the updated params in the same pass (e.g. a peer rank's replica).\n"
     "exp_avgs/exp_avg_sqs may be bfloat16 (stochastic rounding seeded by the step and salts[i]) or uint8 8-bit\n"
     "codes with exp_avg_absmaxes/exp_avg_sq_absmaxes (fp32, one per 256 elements); offsets[i]: the slice's first\n"
     "element in its logical tensor (8-bit: a multiple of 256)."},
    {"sgd_step", (PyCFunction)(void (*)(void))py_sgd_step, METH_FASTCALL,
     "sgd_step($module, params, grads, momentum_buffers, init_buffers, low_precision_outs, lr, momentum, dampening, "
     "weight_decay, nesterov, maximize, grad_scale, nthreads, mirrors=None, /)\n--\n\n"
     "One fused SGD step over lists of contiguous CPU fp32 tensors. momentum_buffers: list (momentum != 0) or None;\n"
     "init_buffers: None or a list of bools, True where the buffer is new (written with the gradient like torch's\n"
     "first step, not read). mirrors: as for adam_step."},
    {"quantize_blockwise", (PyCFunction)(void (*)(void))py_quantize_blockwise, METH_FASTCALL,
     "quantize_blockwise($module, x, codes, absmax, signed, nthreads, /)\n--\n\n"
     "8-bit block-wise dynamic quantisation (optim/qmap.h) of a contiguous fp32 CPU tensor x into codes (uint8,\n"
     "x.numel()) and absmax (fp32, one per 256 elements). signed: exp_avg's map, else exp_avg_sq's."},
    {"dequantize_blockwise", (PyCFunction)(void (*)(void))py_dequantize_blockwise, METH_FASTCALL,
     "dequantize_blockwise($module, codes, absmax, out, signed, nthreads, /)\n--\n\n"
     "Inverse of quantize_blockwise into the fp32 tensor out."},
    {"qmap_tables", (PyCFunction)(void (*)(void))py_qmap_tables, METH_FASTCALL,
     "qmap_tables($module, signed, /)\n--\n\n"
     "The constants of the signed (exp_avg) or unsigned (exp_avg_sq) 8-bit code map, and its 256 values ('code')."},
    {"grads_nonfinite", (PyCFunction)(void (*)(void))py_grads_nonfinite, METH_FASTCALL,
     "grads_nonfinite($module, grads, scale, nthreads, /)\n--\n\n"
     "True when any element of any gradient in the list, multiplied by scale, is inf or NaN."},
    {NULL, NULL, 0, NULL},
};
