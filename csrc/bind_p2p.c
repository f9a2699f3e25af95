/* bind_p2p.c: Python bindings of the shm point-to-point channels (csrc/shm/p2p.h): METH_FASTCALL wrappers that
 * parse, borrow tensors through DLPack, release the GIL, call the compute code and turn its acc_status into an
 * exception. Not for: the ring protocol (shm/shm_p2p.c) or which rings exist (accelerate_c/comm/p2p.py).
 *
 * A channel set is an opaque capsule ("accelerate_c.p2p") over a box holding the C object; close empties the box,
 * so a closed handle raises. The Python owner keeps the group and the region alive while the handle is open. */
#include "bind_util.h"
#include "shm/p2p.h"
#include "tensor.h"

#define CAPSULE_NAME "accelerate_c.p2p"

typedef struct {
    acc_p2p *p;
} p2p_box;

static void box_destructor(PyObject *cap) {
    p2p_box *b = (p2p_box *)PyCapsule_GetPointer(cap, CAPSULE_NAME);
    if (!b) {
        PyErr_Clear();
        return;
    }
    acc_p2p_close(b->p);
    PyMem_Free(b);
}

static acc_p2p *get_p2p(PyObject *cap, const char *what) {
    p2p_box *b = (p2p_box *)PyCapsule_GetPointer(cap, CAPSULE_NAME);
    if (!b) return NULL;
    if (!b->p) PyErr_Format(PyExc_RuntimeError, "%s: the p2p channels are closed", what);
    return b->p;
}

static int nargs_ok(Py_ssize_t nargs, Py_ssize_t want, const char *name) {
    if (nargs == want) return 1;
    PyErr_Format(PyExc_TypeError, "%s takes exactly %zd arguments (%zd given)", name, want, nargs);
    return 0;
}

/* p2p_ring_bytes(nslots, slot_bytes) -> bytes one ring takes in its receiver's part */
static PyObject *py_ring_bytes(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 2, "p2p_ring_bytes")) return NULL;
    long long n = PyLong_AsLongLong(args[0]), sb = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (n < 1 || sb < 64 || sb % 64) return PyErr_Format(PyExc_ValueError, "p2p_ring_bytes: %lld slots of %lld bytes", n, sb);
    return PyLong_FromSize_t(acc_p2p_ring_bytes((uint32_t)n, (size_t)sb));
}

/* p2p_open(group_handle, region_uint8, part_bytes, rings, nslots, slot_bytes) -> handle;
 * rings: a sequence of (src, dst, offset) */
static PyObject *py_open(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 6, "p2p_open")) return NULL;
    struct acc_shm_group *g = acc_shm_group_of(args[0], "p2p_open");
    acc_tensor region;
    if (!g || acc_tensor_borrow_cpu(m, args[1], &region, "p2p_open region", ACC_U8) < 0) return NULL;
    long long part = PyLong_AsLongLong(args[2]), n = PyLong_AsLongLong(args[4]), sb = PyLong_AsLongLong(args[5]);
    if (PyErr_Occurred()) return NULL;
    if (part <= 0 || region.numel != part * acc_shm_group_size(g))
        return PyErr_Format(PyExc_ValueError, "p2p_open: region of %lld bytes is not %d parts of %lld",
                            (long long)region.numel, acc_shm_group_size(g), part);
    if (n < 1 || n > 1 << 20 || sb < 64) return PyErr_Format(PyExc_ValueError, "p2p_open: %lld slots of %lld bytes", n, sb);
    PyObject *seq = args[3];
    Py_ssize_t nr = PySequence_Size(seq);
    if (nr < 0) return NULL;
    int32_t *src = PyMem_Malloc(sizeof(int32_t) * (size_t)(nr + 1)), *dst = PyMem_Malloc(sizeof(int32_t) * (size_t)(nr + 1));
    uint64_t *off = PyMem_Malloc(sizeof(uint64_t) * (size_t)(nr + 1));
    PyObject *cap = NULL;
    if (!src || !dst || !off) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < nr; i++) {
        long a, b;
        unsigned long long o;
        PyObject *item = PySequence_GetItem(seq, i);
        int ok = item && PyArg_ParseTuple(item, "llK", &a, &b, &o);
        Py_XDECREF(item);
        if (!ok) goto done;
        src[i] = (int32_t)a, dst[i] = (int32_t)b, off[i] = o;
    }
    acc_p2p *p = NULL;
    acc_status st = acc_p2p_open(g, region.data, (size_t)part, (int)nr, src, dst, off, (uint32_t)n, (size_t)sb, &p);
    if (st) {
        acc_raise_status(st, "p2p_open");
        goto done;
    }
    p2p_box *box = PyMem_Malloc(sizeof *box);
    if (!box) {
        acc_p2p_close(p);
        PyErr_NoMemory();
        goto done;
    }
    box->p = p;
    cap = PyCapsule_New(box, CAPSULE_NAME, box_destructor);
    if (!cap) {
        acc_p2p_close(p);
        PyMem_Free(box);
    }
done:
    PyMem_Free(src);
    PyMem_Free(dst);
    PyMem_Free(off);
    return cap;
}

/* p2p_post(handle, ring, send, tensor, tag) -> ticket; the caller keeps `tensor` alive until the ticket finished */
static PyObject *py_post(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 5, "p2p_post")) return NULL;
    acc_p2p *p = get_p2p(args[0], "p2p_post");
    long ring = PyLong_AsLong(args[1]);
    int send = PyObject_IsTrue(args[2]);
    unsigned long long tag = PyLong_AsUnsignedLongLong(args[4]);
    acc_tensor t;
    if (!p || send < 0 || PyErr_Occurred() || acc_tensor_borrow_cpu(m, args[3], &t, "p2p_post", -1) < 0) return NULL;
    uint64_t ticket = 0;
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = acc_p2p_post(p, (int)ring, send, t.data, (size_t)t.numel * acc_dtype_size(t.dtype), tag, &ticket);
    Py_END_ALLOW_THREADS
    if (st) return acc_raise_status(st, "p2p_post");
    return PyLong_FromUnsignedLongLong(ticket);
}

static PyObject *py_wait(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 2, "p2p_wait")) return NULL;
    acc_p2p *p = get_p2p(args[0], "p2p_wait");
    unsigned long long ticket = PyLong_AsUnsignedLongLong(args[1]);
    if (!p || PyErr_Occurred()) return NULL;
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = acc_p2p_wait(p, ticket);
    Py_END_ALLOW_THREADS
    if (st) return acc_raise_status(st, "p2p_wait");
    Py_RETURN_NONE;
}

static PyObject *py_done(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 2, "p2p_done")) return NULL;
    acc_p2p *p = get_p2p(args[0], "p2p_done");
    unsigned long long ticket = PyLong_AsUnsignedLongLong(args[1]);
    if (!p || PyErr_Occurred()) return NULL;
    return PyBool_FromLong(acc_p2p_done(p, ticket));
}

static PyObject *py_abort(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 2, "p2p_abort")) return NULL;
    acc_p2p *p = get_p2p(args[0], "p2p_abort");
    const char *msg = PyUnicode_AsUTF8AndSize(args[1], NULL);
    if (!p || !msg) return NULL;
    acc_p2p_abort(p, msg);
    Py_RETURN_NONE;
}

static PyObject *py_close(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 1, "p2p_close")) return NULL;
    p2p_box *b = (p2p_box *)PyCapsule_GetPointer(args[0], CAPSULE_NAME);
    if (!b) return NULL;
    acc_p2p *p = b->p;
    b->p = NULL;
    Py_BEGIN_ALLOW_THREADS
    acc_p2p_close(p);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

#define FC(f) (PyCFunction)(void (*)(void))(f), METH_FASTCALL

PyMethodDef acc_p2p_methods[] = {
    {"p2p_ring_bytes", FC(py_ring_bytes),
     "p2p_ring_bytes($module, nslots, slot_bytes, /)\n--\n\nBytes one ring takes in its receiver's part."},
    {"p2p_open", FC(py_open),
     "p2p_open($module, group, region, part_bytes, rings, nslots, slot_bytes, /)\n--\n\n"
     "Open this rank's view of point-to-point rings ((src, dst, offset) each) in a zeroed shm region of the group."},
    {"p2p_post", FC(py_post),
     "p2p_post($module, handle, ring, send, tensor, tag, /)\n--\n\n"
     "Queue a send or a receive of a contiguous CPU tensor's bytes on a ring; returns a ticket."},
    {"p2p_wait", FC(py_wait),
     "p2p_wait($module, handle, ticket, /)\n--\n\nWait (GIL released) until the ticket finished; raises its error."},
    {"p2p_done", FC(py_done), "p2p_done($module, handle, ticket, /)\n--\n\nTrue once the ticket finished."},
    {"p2p_abort", FC(py_abort),
     "p2p_abort($module, handle, message, /)\n--\n\nAbort the group: every rank's waits fail naming this message."},
    {"p2p_close", FC(py_close),
     "p2p_close($module, handle, /)\n--\n\nStop the progress thread (pending requests fail) and free the channels."},
    {NULL, NULL, 0, NULL},
};
