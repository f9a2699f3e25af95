/* bucket_type.c: BucketCounter, the C readiness counter behind the bucketed gradient all-reduce
 * (strategies/ddp_bucketed.py). Each parameter belongs to one bucket; as autograd produces a gradient,
 * the parameter's hook calls mark(i); when a bucket's last parameter arrives, mark returns the bucket
 * index so Python launches that bucket's all-reduce. Buckets must be launched in index order on every
 * rank (collectives are matched by issue order), so mark returns the list of buckets that became
 * launchable in order: bucket b is launchable when it and every bucket before it are complete.
 * A parameter marked twice in one pass (reentrant backward) counts once. reset() starts a new pass.
 * Not for: the collectives themselves. */
#include <stdlib.h>
#include <string.h>

#include "bind_util.h"

typedef struct {
    PyObject_HEAD
    Py_ssize_t nparams, nbuckets;
    int32_t *param_bucket; /* bucket of each parameter */
    int32_t *bucket_size;  /* parameters per bucket */
    int32_t *pending;      /* parameters still missing per bucket, this pass */
    uint8_t *marked;       /* parameter already marked this pass */
    Py_ssize_t next_launch; /* first bucket not yet handed out for launch */
} BucketCounterObject;

static void bc_free_arrays(BucketCounterObject *self) {
    free(self->param_bucket); free(self->bucket_size); free(self->pending); free(self->marked);
    self->param_bucket = self->bucket_size = self->pending = NULL;
    self->marked = NULL;
}

static void bc_reset_impl(BucketCounterObject *self) {
    memcpy(self->pending, self->bucket_size, sizeof(int32_t) * (size_t)self->nbuckets);
    memset(self->marked, 0, (size_t)self->nparams);
    self->next_launch = 0;
}

/* BucketCounter(param_bucket: sequence[int], nbuckets: int) */
static int bc_init(PyObject *op, PyObject *args, PyObject *kwds) {
    BucketCounterObject *self = (BucketCounterObject *)op;
    PyObject *seq;
    Py_ssize_t nb;
    if (!PyArg_ParseTuple(args, "On", &seq, &nb)) return -1;
    PyObject *fast = PySequence_Tuple(seq);
    if (!fast) return -1;
    Py_ssize_t n = PyTuple_Size(fast);
    if (nb < 1 || n < 1) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "BucketCounter: need at least one parameter and one bucket (got %zd, %zd)", n, nb);
        return -1;
    }
    bc_free_arrays(self);
    self->param_bucket = malloc(sizeof(int32_t) * (size_t)n);
    self->bucket_size = calloc((size_t)nb, sizeof(int32_t));
    self->pending = malloc(sizeof(int32_t) * (size_t)nb);
    self->marked = malloc((size_t)n);
    if (!self->param_bucket || !self->bucket_size || !self->pending || !self->marked) {
        Py_DECREF(fast);
        bc_free_arrays(self);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long b = PyLong_AsLong(PyTuple_GetItem(fast, i));
        if (b == -1 && PyErr_Occurred()) { Py_DECREF(fast); return -1; }
        if (b < 0 || b >= nb) {
            Py_DECREF(fast);
            PyErr_Format(PyExc_ValueError, "BucketCounter: parameter %zd is in bucket %ld, outside [0, %zd)", i, b, nb);
            return -1;
        }
        self->param_bucket[i] = (int32_t)b;
        self->bucket_size[b]++;
    }
    Py_DECREF(fast);
    for (Py_ssize_t b = 0; b < nb; b++)
        if (self->bucket_size[b] == 0) {
            PyErr_Format(PyExc_ValueError, "BucketCounter: bucket %zd has no parameters", b);
            return -1;
        }
    self->nparams = n;
    self->nbuckets = nb;
    bc_reset_impl(self);
    return 0;
}

/* Returns (first, end): buckets [first, end) became launchable, in order. */
static PyObject *bc_advance(BucketCounterObject *self) {
    Py_ssize_t first = self->next_launch;
    while (self->next_launch < self->nbuckets && self->pending[self->next_launch] == 0) self->next_launch++;
    return Py_BuildValue("(nn)", first, self->next_launch);
}

static PyObject *bc_mark(PyObject *op, PyObject *const *args, Py_ssize_t nargs) {
    BucketCounterObject *self = (BucketCounterObject *)op;
    if (nargs != 1) return PyErr_Format(PyExc_TypeError, "mark takes exactly 1 argument");
    Py_ssize_t i = PyLong_AsSsize_t(args[0]);
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (i < 0 || i >= self->nparams) return PyErr_Format(PyExc_IndexError, "mark: parameter %zd out of range", i);
    if (!self->marked[i]) {
        self->marked[i] = 1;
        self->pending[self->param_bucket[i]]--;
    }
    return bc_advance(self);
}

/* mark_all_remaining() -> (first, end): marks every parameter not yet seen (unused this pass). */
static PyObject *bc_mark_all(PyObject *op, PyObject *unused) {
    BucketCounterObject *self = (BucketCounterObject *)op;
    for (Py_ssize_t i = 0; i < self->nparams; i++)
        if (!self->marked[i]) {
            self->marked[i] = 1;
            self->pending[self->param_bucket[i]]--;
        }
    return bc_advance(self);
}

static PyObject *bc_unmarked(PyObject *op, PyObject *unused) {
    BucketCounterObject *self = (BucketCounterObject *)op;
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < self->nparams; i++)
        if (!self->marked[i]) {
            PyObject *v = PyLong_FromSsize_t(i);
            if (!v || PyList_Append(out, v) < 0) { Py_XDECREF(v); Py_DECREF(out); return NULL; }
            Py_DECREF(v);
        }
    return out;
}

static PyObject *bc_reset(PyObject *op, PyObject *unused) {
    bc_reset_impl((BucketCounterObject *)op);
    Py_RETURN_NONE;
}

static PyObject *bc_get_next(PyObject *op, void *closure) {
    return PyLong_FromSsize_t(((BucketCounterObject *)op)->next_launch);
}

static void bc_dealloc(PyObject *op) {
    PyTypeObject *tp = Py_TYPE(op);
    bc_free_arrays((BucketCounterObject *)op);
    freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    f(op);
    Py_DECREF(tp);
}

static PyMethodDef bc_methods[] = {
    {"mark", (PyCFunction)(void (*)(void))bc_mark, METH_FASTCALL,
     "mark($self, i, /)\n--\n\nParameter i has its gradient; returns (first, end) buckets now launchable."},
    {"mark_all_remaining", bc_mark_all, METH_NOARGS,
     "mark_all_remaining($self, /)\n--\n\nMark every unseen parameter; returns (first, end)."},
    {"unmarked", bc_unmarked, METH_NOARGS, "unmarked($self, /)\n--\n\nIndices of parameters not marked this pass."},
    {"reset", bc_reset, METH_NOARGS, "reset($self, /)\n--\n\nStart a new backward pass."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef bc_getset[] = {
    {"next_launch", bc_get_next, NULL, "first bucket not yet launched in this pass", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot bc_slots[] = {
    {Py_tp_doc, "BucketCounter(param_bucket, nbuckets): per-bucket gradient readiness counters."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, bc_init},
    {Py_tp_dealloc, bc_dealloc},
    {Py_tp_methods, bc_methods},
    {Py_tp_getset, bc_getset},
    {0, NULL},
};

static PyType_Spec bc_spec = {
    .name = "accelerate_c._C.BucketCounter",
    .basicsize = sizeof(BucketCounterObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = bc_slots,
};

PyObject *acc_bucket_counter_type_create(PyObject *module) {
    return PyType_FromModuleAndSpec(module, &bc_spec, NULL);
}
