/* bind_cuda.c: the module accelerate_c._C_cuda (built by setup.py only where nvcc is found; imported by
 * accelerate_c/optim/cuda.py only when torch sees a GPU): multi-phase init, and the optimizer steps (adam_step,
 * sgd_step) over lists of CUDA tensors; the other kernels' wrappers are bind_cuda_ops.c. Tensors come through DLPack
 * (tensor.c, as for the CPU kernels) and must all be CUDA tensors of one device (acc_tensor_borrow_on): a CPU tensor
 * is a ValueError naming the argument. `stream` is torch.cuda.current_stream().cuda_stream (an int): the kernels are
 * enqueued there, nothing is allocated or synchronised. Every function has an emulate_* twin that takes CPU tensors
 * and runs the same launch plan and thread code on the CPU (kernels.h; the tests' way to run the CUDA code without a
 * GPU). Errors: the kernels' acc_status turned into exceptions (bind_util.c).
 * Not for: compute code (the .cu files of csrc/cuda), choosing between CPU and CUDA (accelerate_c/optim/cuda.py does). */
#pragma GCC optimize("fp-contract=off") /* the 8-bit maps are built here (qmap.h): no contraction, as in qmap.c */
#include <stdlib.h>

#include "bind_cuda.h"
#include "optim/qmap.h"

/* ---- helpers shared with bind_cuda_ops.c ------------------------------------------------------------------- */

Py_ssize_t cu_seq_len(PyObject *seq, const char *what) {
    if (PyList_Check(seq)) return PyList_Size(seq);
    if (PyTuple_Check(seq)) return PyTuple_Size(seq);
    PyErr_Format(PyExc_TypeError, "%s must be a list or tuple of tensors", what);
    return -1;
}

PyObject *cu_seq_item(PyObject *seq, Py_ssize_t i) {
    return PyList_Check(seq) ? PyList_GetItem(seq, i) : PyTuple_GetItem(seq, i);
}

int cu_opt_list(PyObject *obj, Py_ssize_t n, const char *what, PyObject **out) {
    *out = NULL;
    if (obj == Py_None) return 0;
    Py_ssize_t k = cu_seq_len(obj, what);
    if (k < 0) return -1;
    if (k != n) {
        PyErr_Format(PyExc_ValueError, "%s has %zd entries, expected %zd", what, k, n);
        return -1;
    }
    *out = obj;
    return 0;
}

void *cu_borrow(cu_ctx *c, PyObject *obj, const char *what, Py_ssize_t i, int want, int64_t numel, acc_tensor *t) {
    char name[96];
    if (i >= 0) snprintf(name, sizeof name, "%s[%zd]", what, i);
    else snprintf(name, sizeof name, "%s", what);
    if (acc_tensor_borrow_on(c->module, obj, t, name, want, c->dev) < 0) return NULL;
    if (c->device_id < 0) c->device_id = t->device_id;
    else if (t->device_id != c->device_id) {
        PyErr_Format(PyExc_ValueError, "%s is on device %d, the other tensors on device %d", name, t->device_id,
                     c->device_id);
        return NULL;
    }
    if (numel >= 0 && t->numel != numel) {
        PyErr_Format(PyExc_ValueError, "%s has %lld elements, expected %lld", name, (long long)t->numel,
                     (long long)numel);
        return NULL;
    }
    static char dummy[64]; /* a 0-element tensor may have a NULL pointer; no kernel touches it */
    return t->data ? t->data : dummy;
}

int cu_double(PyObject *o, double *out, const char *what) {
    *out = PyFloat_AsDouble(o);
    if (*out == -1.0 && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "%s must be a number", what);
        return -1;
    }
    return 0;
}

int cu_stream(PyObject *o, void **out) {
    if (o == Py_None) {
        *out = NULL;
        return 0;
    }
    *out = PyLong_AsVoidPtr(o);
    return (*out == NULL && PyErr_Occurred()) ? -1 : 0;
}

/* A scalar that is a number (host) or a 1-element float32 tensor on the kernels' device (read by the kernels). */
int cu_scalar(cu_ctx *c, PyObject *o, const char *what, double *host, const float **dev) {
    *dev = NULL;
    if (PyFloat_Check(o) || PyLong_Check(o)) return cu_double(o, host, what);
    acc_tensor t;
    const float *p = (const float *)cu_borrow(c, o, what, -1, ACC_F32, 1, &t);
    if (!p) return -1;
    *dev = p;
    return 0;
}

/* ---- adam_step --------------------------------------------------------------------------------------------- */

static int adam_state(cu_ctx *c, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t i, int64_t numel,
                      acc_cuda_adam_tensor *x) {
    acc_tensor t;
    if (!(x->exp_avg = cu_borrow(c, cu_seq_item(args[2], i), "exp_avgs", i, -1, numel, &t))) return -1;
    x->state_dtype = t.dtype;
    if (!(x->exp_avg_sq = cu_borrow(c, cu_seq_item(args[3], i), "exp_avg_sqs", i, (int)t.dtype, numel, &t))) return -1;
    PyObject *lists[4] = {NULL, NULL, NULL, NULL};
    for (int k = 0; k < 4; k++)
        if (nargs > 18 + k && args[18 + k] != Py_None) lists[k] = args[18 + k];
    if (x->state_dtype == ACC_U8) {
        int64_t nb = (numel + ACC_QBLOCK - 1) / ACC_QBLOCK;
        if (!lists[0] || !lists[1] || cu_seq_item(lists[0], i) == Py_None || cu_seq_item(lists[1], i) == Py_None) {
            PyErr_Format(PyExc_ValueError, "exp_avgs[%zd] holds 8-bit codes: its absmax tensors are required", i);
            return -1;
        }
        if (!(x->exp_avg_absmax = cu_borrow(c, cu_seq_item(lists[0], i), "exp_avg_absmaxes", i, ACC_F32, nb, &t)) ||
            !(x->exp_avg_sq_absmax = cu_borrow(c, cu_seq_item(lists[1], i), "exp_avg_sq_absmaxes", i, ACC_F32, nb,
                                               &t)))
            return -1;
    }
    for (int k = 2; k < 4; k++) {
        PyObject *v = lists[k] ? cu_seq_item(lists[k], i) : Py_None;
        if (v == Py_None) continue;
        unsigned long long u = PyLong_AsUnsignedLongLong(v);
        if (PyErr_Occurred()) return -1;
        if (k == 2) x->offset = u;
        else x->salt = u;
    }
    return 0;
}

/* steps: a number (the step this update makes) or a list of 0-d float32 tensors: on the CPU (read here, advanced
 * after the launch, as the CPU binding does) or on the kernels' device (device mode: read and advanced there) */
static int adam_step_of(cu_ctx *c, PyObject *steps, Py_ssize_t i, acc_cuda_adam_tensor *x, acc_tensor *cpu,
                        int device_steps) {
    if (!PyList_Check(steps) && !PyTuple_Check(steps)) return cu_double(steps, &x->step, "step");
    PyObject *obj = cu_seq_item(steps, i);
    acc_tensor t;
    if (acc_tensor_borrow(c->module, obj, &t, "steps") < 0) return -1;
    if (t.numel != 1 || (t.device_type == acc_kDLCPU ? (t.dtype != ACC_F32 && t.dtype != ACC_F64)
                                                     : (t.device_type != c->dev || t.dtype != ACC_F32))) {
        PyErr_Format(PyExc_TypeError, "steps[%zd] must be a 0-d float32/float64 CPU tensor or a 0-d float32 tensor on "
                     "the params' device", i);
        return -1;
    }
    if (t.device_type == acc_kDLCPU && (c->dev != acc_kDLCPU || !device_steps)) { /* host mode */
        *cpu = t;
        x->step = (t.dtype == ACC_F32 ? (double)*(float *)t.data : *(double *)t.data) + 1.0;
        return 0;
    }
    x->step_dev = (float *)cu_borrow(c, obj, "steps", i, ACC_F32, 1, &t); /* (emulated: CPU memory) */
    return x->step_dev ? 0 : -1;
}

/* dev: acc_kDLCUDA, or acc_kDLCPU to emulate, where a 24th argument says whether the step tensors play the device's
 * (device mode) or the host's */
static PyObject *adam_common(PyObject *module, PyObject *const *args, Py_ssize_t nargs, int dev) {
    int device_steps = 0;
    if (dev == acc_kDLCPU && nargs == 24) {
        if ((device_steps = PyObject_IsTrue(args[23])) < 0) return NULL;
        nargs = 23;
    }
    if (nargs < 18 || nargs > 23)
        return PyErr_Format(PyExc_TypeError, "adam_step takes 18 to 23 positional arguments (%zd given)", nargs);
    cu_ctx c = {module, dev, -1};
    acc_adam_config cfg;
    memset(&cfg, 0, sizeof cfg);
    const float *lr_dev = NULL, *found_inf = NULL;
    void *stream = NULL;
    double lr;
    if (cu_double(args[8], &cfg.beta1, "beta1") < 0 || cu_double(args[9], &cfg.beta2, "beta2") < 0 ||
        cu_double(args[10], &cfg.eps, "eps") < 0 || cu_double(args[11], &cfg.weight_decay, "weight_decay") < 0 ||
        cu_double(args[15], &cfg.grad_scale, "grad_scale") < 0 || cu_stream(args[16], &stream) < 0)
        return NULL;
    if ((cfg.decoupled = PyObject_IsTrue(args[12])) < 0 || (cfg.amsgrad = PyObject_IsTrue(args[13])) < 0 ||
        (cfg.maximize = PyObject_IsTrue(args[14])) < 0 || (cfg.lr_is_f32_tensor = PyObject_IsTrue(args[17])) < 0)
        return NULL;
    Py_ssize_t n = cu_seq_len(args[0], "params");
    PyObject *tmp, *maxs, *lps;
    if (n < 0 || cu_opt_list(args[4], n, "max_exp_avg_sqs", &maxs) < 0 ||
        cu_opt_list(args[6], n, "low_precision_outs", &lps) < 0)
        return NULL;
    for (int k = 1; k <= 3; k++) {
        const char *names[] = {"", "grads", "exp_avgs", "exp_avg_sqs"};
        if (cu_opt_list(args[k], n, names[k], &tmp) < 0) return NULL;
        if (!tmp) return PyErr_Format(PyExc_TypeError, "%s is required", names[k]);
    }
    for (int k = 18; k < nargs && k < 22; k++)
        if (cu_opt_list(args[k], n, "exp_avg_absmaxes / exp_avg_sq_absmaxes / offsets / salts", &tmp) < 0) return NULL;
    if ((PyList_Check(args[5]) || PyTuple_Check(args[5])) && cu_opt_list(args[5], n, "steps", &tmp) < 0) return NULL;
    if (cu_scalar(&c, args[7], "lr", &lr, &lr_dev) < 0) return NULL;
    cfg.lr = lr;
    if (nargs > 22 && args[22] != Py_None) {
        acc_tensor t;
        if (!(found_inf = (const float *)cu_borrow(&c, args[22], "found_inf", -1, ACC_F32, 1, &t))) return NULL;
    }
    acc_cuda_adam_tensor *ts = (acc_cuda_adam_tensor *)calloc(n ? (size_t)n : 1, sizeof(acc_cuda_adam_tensor));
    acc_tensor *cpu_steps = (acc_tensor *)calloc(n ? (size_t)n : 1, sizeof(acc_tensor));
    if (!ts || !cpu_steps) {
        free(ts);
        free(cpu_steps);
        return PyErr_NoMemory();
    }
    PyObject *ret = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        acc_tensor t;
        acc_cuda_adam_tensor *x = &ts[i];
        if (!(x->param = (float *)cu_borrow(&c, cu_seq_item(args[0], i), "params", i, ACC_F32, -1, &t))) goto done;
        const int64_t numel = t.numel;
        x->n = (uint64_t)numel;
        if (!(x->grad = cu_borrow(&c, cu_seq_item(args[1], i), "grads", i, -1, numel, &t))) goto done;
        x->grad_dtype = t.dtype;
        if (adam_state(&c, args, nargs, i, numel, x) < 0) goto done;
        if (cfg.amsgrad && (!maxs || !(x->max_exp_avg_sq = (float *)cu_borrow(&c, cu_seq_item(maxs, i),
                                                                               "max_exp_avg_sqs", i, ACC_F32, numel,
                                                                               &t)))) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "amsgrad needs max_exp_avg_sqs");
            goto done;
        }
        if (lps && cu_seq_item(lps, i) != Py_None) {
            if (!(x->lp_out = cu_borrow(&c, cu_seq_item(lps, i), "low_precision_outs", i, -1, numel, &t))) goto done;
            x->lp_dtype = t.dtype;
        }
        if (adam_step_of(&c, args[5], i, x, &cpu_steps[i], device_steps) < 0) goto done;
    }
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = dev == acc_kDLCPU ? acc_cuda_emulate_adam(&cfg, ts, (size_t)n, lr_dev, found_inf)
                           : acc_cuda_adam_step(&cfg, ts, (size_t)n, lr_dev, found_inf, stream);
    Py_END_ALLOW_THREADS
    if (st != ACC_OK) {
        acc_raise_status(st, "adam_step");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* host step counts advance once the update is enqueued (torch: += 1) */
        if (!cpu_steps[i].data) continue;
        if (cpu_steps[i].dtype == ACC_F32) *(float *)cpu_steps[i].data = (float)ts[i].step;
        else *(double *)cpu_steps[i].data = ts[i].step;
    }
    ret = Py_NewRef(Py_None);
done:
    free(ts);
    free(cpu_steps);
    return ret;
}

static PyObject *py_adam_step(PyObject *m, PyObject *const *a, Py_ssize_t n) { return adam_common(m, a, n, acc_kDLCUDA); }
static PyObject *py_emulate_adam(PyObject *m, PyObject *const *a, Py_ssize_t n) { return adam_common(m, a, n, acc_kDLCPU); }

/* ---- sgd_step ---------------------------------------------------------------------------------------------- */

static PyObject *sgd_common(PyObject *module, PyObject *const *args, Py_ssize_t nargs, int dev) {
    if (nargs != 13 && nargs != 14)
        return PyErr_Format(PyExc_TypeError, "sgd_step takes 13 or 14 positional arguments (%zd given)", nargs);
    cu_ctx c = {module, dev, -1};
    acc_cuda_sgd_config cfg;
    void *stream = NULL;
    const float *found_inf = NULL;
    if (cu_double(args[5], &cfg.lr, "lr") < 0 || cu_double(args[6], &cfg.momentum, "momentum") < 0 ||
        cu_double(args[7], &cfg.dampening, "dampening") < 0 ||
        cu_double(args[8], &cfg.weight_decay, "weight_decay") < 0 ||
        cu_double(args[11], &cfg.grad_scale, "grad_scale") < 0 || cu_stream(args[12], &stream) < 0 ||
        (cfg.nesterov = PyObject_IsTrue(args[9])) < 0 || (cfg.maximize = PyObject_IsTrue(args[10])) < 0)
        return NULL;
    Py_ssize_t n = cu_seq_len(args[0], "params");
    PyObject *tmp, *bufs, *inits, *lps;
    if (n < 0 || cu_opt_list(args[1], n, "grads", &tmp) < 0 || cu_opt_list(args[2], n, "momentum_buffers", &bufs) < 0 ||
        cu_opt_list(args[3], n, "init_buffers", &inits) < 0 || cu_opt_list(args[4], n, "low_precision_outs", &lps) < 0)
        return NULL;
    if (!tmp) return PyErr_Format(PyExc_TypeError, "grads is required");
    if (cfg.momentum != 0.0 && !bufs) return PyErr_Format(PyExc_ValueError, "momentum != 0 needs momentum_buffers");
    acc_tensor t;
    if (nargs == 14 && args[13] != Py_None &&
        !(found_inf = (const float *)cu_borrow(&c, args[13], "found_inf", -1, ACC_F32, 1, &t)))
        return NULL;
    acc_cuda_sgd_tensor *ts = (acc_cuda_sgd_tensor *)calloc(n ? (size_t)n : 1, sizeof(acc_cuda_sgd_tensor));
    if (!ts) return PyErr_NoMemory();
    PyObject *ret = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        acc_cuda_sgd_tensor *x = &ts[i];
        if (!(x->param = (float *)cu_borrow(&c, cu_seq_item(args[0], i), "params", i, ACC_F32, -1, &t))) goto done;
        const int64_t numel = t.numel;
        x->n = (uint64_t)numel;
        if (!(x->grad = cu_borrow(&c, cu_seq_item(args[1], i), "grads", i, -1, numel, &t))) goto done;
        x->grad_dtype = t.dtype;
        if (cfg.momentum != 0.0) {
            if (!(x->momentum_buf = (float *)cu_borrow(&c, cu_seq_item(bufs, i), "momentum_buffers", i, ACC_F32,
                                                       numel, &t)))
                goto done;
            if (inits && (x->init_buf = PyObject_IsTrue(cu_seq_item(inits, i))) < 0) goto done;
        }
        if (lps && cu_seq_item(lps, i) != Py_None) {
            if (!(x->lp_out = cu_borrow(&c, cu_seq_item(lps, i), "low_precision_outs", i, -1, numel, &t))) goto done;
            x->lp_dtype = t.dtype;
        }
    }
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = dev == acc_kDLCPU ? acc_cuda_emulate_sgd(&cfg, ts, (size_t)n, found_inf)
                           : acc_cuda_sgd_step(&cfg, ts, (size_t)n, found_inf, stream);
    Py_END_ALLOW_THREADS
    if (st != ACC_OK) acc_raise_status(st, "sgd_step");
    else ret = Py_NewRef(Py_None);
done:
    free(ts);
    return ret;
}

static PyObject *py_sgd_step(PyObject *m, PyObject *const *a, Py_ssize_t n) { return sgd_common(m, a, n, acc_kDLCUDA); }
static PyObject *py_emulate_sgd(PyObject *m, PyObject *const *a, Py_ssize_t n) { return sgd_common(m, a, n, acc_kDLCPU); }

static PyObject *py_info(PyObject *module, PyObject *unused) {
    int devices, runtime;
    acc_cuda_info(&devices, &runtime);
    return Py_BuildValue("{s:i,s:i,s:i,s:i,s:i}", "devices", devices, "runtime_version", runtime, "chunk",
                         ACC_CU_CHUNK, "threads", ACC_CU_THREADS, "qblock", ACC_QBLOCK);
}

#define FC(f) (PyCFunction)(void (*)(void))(f), METH_FASTCALL
static PyMethodDef cu_optim_methods[] = {
    {"adam_step", FC(py_adam_step),
     "adam_step($module, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, low_precision_outs, lr, beta1, "
     "beta2, eps, weight_decay, decoupled, amsgrad, maximize, grad_scale, stream, lr_is_f32_tensor, "
     "exp_avg_absmaxes=None, exp_avg_sq_absmaxes=None, offsets=None, salts=None, found_inf=None, /)\n--\n\n"
     "_C.adam_step on CUDA tensors, enqueued on `stream` (torch.cuda.current_stream().cuda_stream). steps: a number,\n"
     "0-d CPU tensors (advanced here) or 0-d float32 CUDA tensors (read and advanced on the device: graph capture);\n"
     "lr: a number or a float32 CUDA scalar; found_inf: a float32 CUDA scalar, nonzero skips the step."},
    {"sgd_step", FC(py_sgd_step),
     "sgd_step($module, params, grads, momentum_buffers, init_buffers, low_precision_outs, lr, momentum, dampening, "
     "weight_decay, nesterov, maximize, grad_scale, stream, found_inf=None, /)\n--\n\n_C.sgd_step on CUDA tensors."},
    {"emulate_adam_step", FC(py_emulate_adam), "adam_step's launch plan and thread code run on CPU tensors (tests)."},
    {"emulate_sgd_step", FC(py_emulate_sgd), "sgd_step's launch plan and thread code run on CPU tensors (tests)."},
    {"info", py_info, METH_NOARGS,
     "info($module, /)\n--\n\n{devices, runtime_version, chunk, threads, qblock}: what the CUDA runtime reports and the\n"
     "kernels' geometry."},
    {NULL, NULL, 0, NULL},
};

/* ---- module lifecycle --------------------------------------------------------------------------------------- */

static int cu_exec(PyObject *m) {
    acc_module_state *st = acc_get_state(m);
    st->str_dlpack = PyUnicode_InternFromString("__dlpack__");
    st->str_detach = PyUnicode_InternFromString("detach");
    if (!st->str_dlpack || !st->str_detach) return -1;
    if (PyModule_AddFunctions(m, cu_optim_methods) < 0 || PyModule_AddFunctions(m, acc_cuda_ops_methods) < 0) return -1;
    return PyModule_AddIntConstant(m, "CHUNK", ACC_CU_CHUNK);
}

static int cu_traverse(PyObject *m, visitproc visit, void *arg) {
    Py_VISIT(acc_get_state(m)->exchange_api_type);
    return 0;
}

static int cu_clear(PyObject *m) {
    acc_module_state *st = acc_get_state(m);
    Py_CLEAR(st->exchange_api_type);
    Py_CLEAR(st->str_dlpack);
    Py_CLEAR(st->str_detach);
    st->exchange_api = NULL;
    return 0;
}

static void cu_free(void *m) { cu_clear((PyObject *)m); }

static PyModuleDef_Slot cu_slots[] = {
    {Py_mod_exec, cu_exec},
    {0, NULL},
};

static struct PyModuleDef cu_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "accelerate_c._C_cuda",
    .m_doc = "accelerate_c's CUDA kernels: fused optimizers, casts, gradient passes, the sharded engine's copies.",
    .m_size = sizeof(acc_module_state),
    .m_slots = cu_slots,
    .m_traverse = cu_traverse,
    .m_clear = cu_clear,
    .m_free = cu_free,
};

PyMODINIT_FUNC PyInit__C_cuda(void) { return PyModuleDef_Init(&cu_module); }
