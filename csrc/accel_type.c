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
    Py_ssize_t optimizer_steps;            /* completed (synchronised) optimizer steps */
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

static PyMethodDef Accelerator_methods[] = {
    {"_do_sync", (PyCFunction)(void (*)(void))Accelerator_do_sync, METH_FASTCALL,
     "_do_sync($self, end_of_dataloader=None, /)\n--\n\nAdvance the accumulation counter; return sync_gradients."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Accelerator_members[] = {
    {"step", T_PYSSIZET, offsetof(AcceleratorObject, step), 0, "micro-steps since the last synchronising step"},
    {"_gradient_accumulation_steps", T_PYSSIZET, offsetof(AcceleratorObject, gradient_accumulation_steps), 0, NULL},
    {"_num_processes", T_PYSSIZET, offsetof(AcceleratorObject, num_processes), 0, NULL},
    {"_process_index", T_PYSSIZET, offsetof(AcceleratorObject, process_index), 0, NULL},
    {"_local_process_index", T_PYSSIZET, offsetof(AcceleratorObject, local_process_index), 0, NULL},
    {"_optimizer_steps", T_PYSSIZET, offsetof(AcceleratorObject, optimizer_steps), 0, NULL},
    {"_sync_gradients", T_BOOL, offsetof(AcceleratorObject, sync_gradients), 0, NULL},
    {"_sync_with_dataloader", T_BOOL, offsetof(AcceleratorObject, sync_with_dataloader), 0, NULL},
    {"_end_of_dataloader", T_BOOL, offsetof(AcceleratorObject, end_of_dataloader), 0, NULL},
    {"_sync_each_batch", T_BOOL, offsetof(AcceleratorObject, sync_each_batch), 0, NULL},
    {NULL, 0, 0, 0, NULL},
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
