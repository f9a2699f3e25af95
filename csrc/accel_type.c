/* accel_type.c: the Accelerator base type, a heap type defined in C.
 * It holds the per-step state that every training step touches (step and accumulation counters,
 * sync_gradients, rank and world size, the precision mode) and the step-boundary logic (_do_sync),
 * so the hot per-step bookkeeping is C attribute access, not Python dict lookups.
 * accelerate_c.Accelerator (accelerate_c/accelerator.py) subclasses it; everything else (prepare,
 * checkpoints, ...) lives in Python. Not for: backend logic (strategies own that).
 *
 * Python equivalent of _do_sync, for reading:
 *     if sync_with_dataloader and end_of_dataloader: step = 0; sync_gradients = True
 *     else: step += 1; sync_gradients = step % gradient_accumulation_steps == 0
 */
#include <stddef.h>

#include "bind_util.h"
#include "structmember.h"

typedef struct {
    PyObject_HEAD
    Py_ssize_t step;                       /* micro-steps since the last sync (HF: accelerator.step) */
    Py_ssize_t gradient_accumulation_steps;
    Py_ssize_t num_processes;
    Py_ssize_t process_index;
    Py_ssize_t local_process_index;
    char sync_gradients;
    char sync_with_dataloader;
    char end_of_dataloader;
    char sync_each_batch;
} AcceleratorObject;

static int Accelerator_traverse(PyObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static void Accelerator_dealloc(PyObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(self);
    Py_DECREF(tp);
}

static PyObject *Accelerator_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    AcceleratorObject *self = (AcceleratorObject *)alloc(type, 0);
    if (!self) return NULL;
    self->gradient_accumulation_steps = 1;
    self->num_processes = 1;
    self->sync_gradients = 1;
    self->sync_with_dataloader = 1;
    return (PyObject *)self;
}

/* _do_sync(end_of_dataloader: bool) -> bool: advance the micro-step counter and decide whether this
 * micro-step synchronises gradients. Returns the new sync_gradients. */
static PyObject *Accelerator_do_sync(PyObject *op, PyObject *const *args, Py_ssize_t nargs) {
    AcceleratorObject *self = (AcceleratorObject *)op;
    if (nargs > 1) return PyErr_Format(PyExc_TypeError, "_do_sync takes at most 1 argument (%zd given)", nargs);
    if (nargs == 1) {
        int v = PyObject_IsTrue(args[0]);
        if (v < 0) return NULL;
        self->end_of_dataloader = (char)v;
    }
    if (self->gradient_accumulation_steps < 1) {
        return PyErr_Format(PyExc_ValueError, "gradient_accumulation_steps must be >= 1, got %zd",
                            self->gradient_accumulation_steps);
    }
    if (self->sync_with_dataloader && self->end_of_dataloader) {
        self->step = 0;
        self->sync_gradients = 1;
    } else {
        self->step += 1;
        self->sync_gradients = (self->step % self->gradient_accumulation_steps) == 0;
    }
    return PyBool_FromLong(self->sync_gradients);
}

static PyMemberDef Accelerator_members[] = {
    {"step", T_PYSSIZET, offsetof(AcceleratorObject, step), 0, "micro-steps since the last synchronising step"},
    {"_gradient_accumulation_steps", T_PYSSIZET, offsetof(AcceleratorObject, gradient_accumulation_steps), 0, NULL},
    {"_num_processes", T_PYSSIZET, offsetof(AcceleratorObject, num_processes), 0, NULL},
    {"_process_index", T_PYSSIZET, offsetof(AcceleratorObject, process_index), 0, NULL},
    {"_local_process_index", T_PYSSIZET, offsetof(AcceleratorObject, local_process_index), 0, NULL},
    {"_sync_gradients", T_BOOL, offsetof(AcceleratorObject, sync_gradients), 0, NULL},
    {"_sync_with_dataloader", T_BOOL, offsetof(AcceleratorObject, sync_with_dataloader), 0, NULL},
    {"_end_of_dataloader", T_BOOL, offsetof(AcceleratorObject, end_of_dataloader), 0, NULL},
    {"_sync_each_batch", T_BOOL, offsetof(AcceleratorObject, sync_each_batch), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

/* Pickling (HF's Accelerator pickles, e.g. inside a skorch net): __getstate__ returns (instance dict or None,
 * the values of Accelerator_members in table order); __setstate__ restores both. What the dict holds decides the
 * rest (process groups pickle as references to the live ones: base/process_local.py). */
#define ACC_NFIELDS ((Py_ssize_t)(sizeof(Accelerator_members) / sizeof(Accelerator_members[0]) - 1))

static PyObject *Accelerator_getstate(PyObject *op, PyObject *unused) {
    (void)unused;
    PyObject *fields = PyTuple_New(ACC_NFIELDS);
    if (!fields) return NULL;
    for (Py_ssize_t i = 0; i < ACC_NFIELDS; i++) {
        PyObject *x = PyMember_GetOne((const char *)op, &Accelerator_members[i]);
        if (!x) { Py_DECREF(fields); return NULL; }
        PyTuple_SetItem(fields, i, x);
    }
    PyObject *dict = PyObject_GetAttrString(op, "__dict__");
    if (!dict) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) { Py_DECREF(fields); return NULL; }
        PyErr_Clear();
        dict = Py_NewRef(Py_None);
    }
    PyObject *out = PyTuple_Pack(2, dict, fields);
    Py_DECREF(dict);
    Py_DECREF(fields);
    return out;
}

static PyObject *Accelerator_setstate(PyObject *op, PyObject *state) {
    if (!PyTuple_Check(state) || PyTuple_Size(state) != 2 || !PyTuple_Check(PyTuple_GetItem(state, 1))
        || PyTuple_Size(PyTuple_GetItem(state, 1)) != ACC_NFIELDS) {
        return PyErr_Format(PyExc_TypeError, "Accelerator.__setstate__: expected (dict, %zd C fields), got %R",
                            ACC_NFIELDS, state);
    }
    PyObject *dict = PyTuple_GetItem(state, 0), *fields = PyTuple_GetItem(state, 1);
    if (dict != Py_None) {
        PyObject *own = PyObject_GetAttrString(op, "__dict__");
        if (!own) return NULL;
        int rc = PyDict_Check(own) ? PyDict_Update(own, dict) : -1;
        if (rc < 0 && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "Accelerator.__setstate__: no __dict__");
        Py_DECREF(own);
        if (rc < 0) return NULL;
    }
    for (Py_ssize_t i = 0; i < ACC_NFIELDS; i++)
        if (PyMember_SetOne((char *)op, &Accelerator_members[i], PyTuple_GetItem(fields, i)) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef Accelerator_methods[] = {
    {"_do_sync", (PyCFunction)(void (*)(void))Accelerator_do_sync, METH_FASTCALL,
     "_do_sync($self, end_of_dataloader=None, /)\n--\n\nAdvance the accumulation counter; return sync_gradients."},
    {"__getstate__", Accelerator_getstate, METH_NOARGS, "(instance dict, C fields) for pickle."},
    {"__setstate__", Accelerator_setstate, METH_O, "Restore what __getstate__ returned."},
    {NULL, NULL, 0, NULL},
};


static PyType_Slot Accelerator_slots[] = {
    {Py_tp_doc, "Accelerator base type (C): per-step state and step-boundary logic."},
    {Py_tp_new, Accelerator_new},
    {Py_tp_dealloc, Accelerator_dealloc},
    {Py_tp_traverse, Accelerator_traverse},
    {Py_tp_methods, Accelerator_methods},
    {Py_tp_members, Accelerator_members},
    {0, NULL},
};

static PyType_Spec Accelerator_spec = {
    .name = "accelerate_c._C.Accelerator",
    .basicsize = sizeof(AcceleratorObject),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = Accelerator_slots,
};

PyObject *acc_accelerator_type_create(PyObject *module) {
    return PyType_FromModuleAndSpec(module, &Accelerator_spec, NULL);
}
