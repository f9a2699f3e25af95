/* bind_shm.c: Python bindings of the shm subsystem (METH_FASTCALL wrappers: parse, borrow tensors through
 * DLPack, release the GIL, call the compute code, turn its acc_status into an exception).
 * Not for: compute code (that lives in ops/, optim/ or shm/ and never includes Python.h), or the collective
 * protocol above one host (the Python package accelerate_c/comm).
 *
 * A group is an opaque capsule ("accelerate_c.shm_group") over a small box holding the C group; close
 * empties the box, so a closed handle raises instead of touching unmapped memory. The caller
 * (accelerate_c/comm/shm.py) must not run two calls on one group at the same time. */
#include "bind_util.h"
#include "shm/shm.h"
#include "tensor.h"

#define CAPSULE_NAME "accelerate_c.shm_group"

typedef struct {
    acc_shm_group *g;
} group_box;

static void box_destructor(PyObject *cap) {
    group_box *b = (group_box *)PyCapsule_GetPointer(cap, CAPSULE_NAME);
    if (!b) {
        PyErr_Clear();
        return;
    }
    acc_shm_group_close(b->g);
    PyMem_Free(b);
}

static acc_shm_group *get_group(PyObject *cap, const char *what) {
    group_box *b = (group_box *)PyCapsule_GetPointer(cap, CAPSULE_NAME);
    if (!b) return NULL;
    if (!b->g) PyErr_Format(PyExc_RuntimeError, "%s: the shm group is closed", what);
    return b->g;
}

struct acc_shm_group *acc_shm_group_of(PyObject *cap, const char *what) { return get_group(cap, what); }

static int nargs_ok(Py_ssize_t nargs, Py_ssize_t want, const char *name) {
    if (nargs == want) return 1;
    PyErr_Format(PyExc_TypeError, "%s takes exactly %zd arguments (%zd given)", name, want, nargs);
    return 0;
}

/* shm_group_open(name, create, rank, nranks, small_bytes, chunk_bytes, timeout_s) -> handle */
static PyObject *py_group_open(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 7, "shm_group_open")) return NULL;
    const char *name = PyUnicode_AsUTF8AndSize(args[0], NULL);
    if (!name) return NULL;
    int create = PyObject_IsTrue(args[1]);
    long rank = PyLong_AsLong(args[2]), nranks = PyLong_AsLong(args[3]);
    long long small = PyLong_AsLongLong(args[4]), chunk = PyLong_AsLongLong(args[5]);
    double timeout = PyFloat_AsDouble(args[6]);
    if (create < 0 || PyErr_Occurred()) return NULL;
    if (small < 0 || chunk < 0) return PyErr_Format(PyExc_ValueError, "shm_group_open: negative buffer size");
    acc_shm_group *g = NULL;
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = acc_shm_group_open(name, create, (int)rank, (int)nranks, (size_t)small, (size_t)chunk, timeout, &g);
    Py_END_ALLOW_THREADS
    if (st) return acc_raise_status(st, "shm_group_open");
    group_box *b = PyMem_Malloc(sizeof *b);
    if (!b) {
        acc_shm_group_close(g);
        return PyErr_NoMemory();
    }
    b->g = g;
    PyObject *cap = PyCapsule_New(b, CAPSULE_NAME, box_destructor);
    if (!cap) {
        acc_shm_group_close(g);
        PyMem_Free(b);
    }
    return cap;
}

static PyObject *py_group_wait_attached(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 1, "shm_group_wait_attached")) return NULL;
    acc_shm_group *g = get_group(args[0], "shm_group_wait_attached");
    if (!g) return NULL;
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = acc_shm_group_wait_attached(g);
    Py_END_ALLOW_THREADS
    if (st) return acc_raise_status(st, "shm_group_wait_attached");
    Py_RETURN_NONE;
}

static PyObject *py_group_close(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 1, "shm_group_close")) return NULL;
    group_box *b = (group_box *)PyCapsule_GetPointer(args[0], CAPSULE_NAME);
    if (!b) return NULL;
    acc_shm_group_close(b->g);
    b->g = NULL;
    Py_RETURN_NONE;
}

static PyObject *py_set_timeout(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 2, "shm_set_timeout")) return NULL;
    acc_shm_group *g = get_group(args[0], "shm_set_timeout");
    double t = PyFloat_AsDouble(args[1]);
    if (!g || PyErr_Occurred()) return NULL;
    acc_shm_group_set_timeout(g, t);
    Py_RETURN_NONE;
}

static PyObject *py_group_spin_us(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 1, "shm_group_spin_us")) return NULL;
    acc_shm_group *g = get_group(args[0], "shm_group_spin_us");
    if (!g) return NULL;
    long spin, inner;
    acc_shm_group_spin_us(g, &spin, &inner);
    return Py_BuildValue("(ll)", spin, inner);
}

static int parse_op(PyObject *o, acc_redop *op) {
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < ACC_RED_SUM || v > ACC_RED_SUM_DIV) {
        PyErr_Format(PyExc_ValueError, "unknown reduction op %ld (0 sum, 1 avg, 2 max, 3 min, 4 sum_div)", v);
        return -1;
    }
    *op = (acc_redop)v;
    return 0;
}

/* shm_all_reduce(handle, tensor, op) : in place */
static PyObject *py_all_reduce(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 3, "shm_all_reduce")) return NULL;
    acc_shm_group *g = get_group(args[0], "shm_all_reduce");
    acc_tensor t;
    acc_redop op;
    if (!g || acc_tensor_borrow_cpu(m, args[1], &t, "shm_all_reduce", -1) < 0 || parse_op(args[2], &op) < 0)
        return NULL;
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = acc_shm_async_drain(g);
    if (st == ACC_OK) st = acc_shm_all_reduce(g, t.data, (size_t)t.numel, t.dtype, op);
    Py_END_ALLOW_THREADS
    if (st) return acc_raise_status(st, "shm_all_reduce");
    Py_RETURN_NONE;
}

/* shm_all_reduce_out(handle, input, output, op): output = reduction of every rank's input; input is only
 * read. output must have input's dtype and element count and either be input or not overlap it. */
static PyObject *py_all_reduce_out(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 4, "shm_all_reduce_out")) return NULL;
    acc_shm_group *g = get_group(args[0], "shm_all_reduce_out");
    acc_tensor in, out;
    acc_redop op;
    if (!g || acc_tensor_borrow_cpu(m, args[1], &in, "shm_all_reduce_out input", -1) < 0 ||
        acc_tensor_borrow_cpu(m, args[2], &out, "shm_all_reduce_out output", (int)in.dtype) < 0 ||
        parse_op(args[3], &op) < 0)
        return NULL;
    if (in.numel != out.numel)
        return PyErr_Format(PyExc_ValueError, "shm_all_reduce_out: input has %lld elements, output %lld",
                            (long long)in.numel, (long long)out.numel);
    size_t nb = (size_t)in.numel * acc_dtype_size(in.dtype);
    const char *a = (const char *)in.data, *b = (const char *)out.data;
    if (nb && a != b && a < b + nb && b < a + nb)
        return PyErr_Format(PyExc_ValueError, "shm_all_reduce_out: output overlaps input without being it");
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = acc_shm_async_drain(g);
    if (st == ACC_OK) st = acc_shm_all_reduce_out(g, in.data, out.data, (size_t)in.numel, in.dtype, op);
    Py_END_ALLOW_THREADS
    if (st) return acc_raise_status(st, "shm_all_reduce_out");
    Py_RETURN_NONE;
}

/* shm_all_reduce_start(handle, tensor, op) -> ticket: queue an in-place all-reduce on the group's worker
 * thread. The caller keeps `tensor` alive and untouched until shm_wait(handle, ticket) returned. */
static PyObject *py_all_reduce_start(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 3, "shm_all_reduce_start")) return NULL;
    acc_shm_group *g = get_group(args[0], "shm_all_reduce_start");
    acc_tensor t;
    acc_redop op;
    if (!g || acc_tensor_borrow_cpu(m, args[1], &t, "shm_all_reduce_start", -1) < 0 || parse_op(args[2], &op) < 0)
        return NULL;
    uint64_t ticket = 0;
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = acc_shm_async_submit(g, t.data, (size_t)t.numel, t.dtype, op, &ticket);
    Py_END_ALLOW_THREADS
    if (st) return acc_raise_status(st, "shm_all_reduce_start");
    return PyLong_FromUnsignedLongLong(ticket);
}

/* shm_reduce_scatter_start(handle, input, output, op) -> ticket / shm_all_gather_start(handle, input, output)
 * -> ticket: queue the collective on the group's worker thread (same checks as the blocking ops). The caller
 * keeps both tensors alive and untouched until shm_wait(handle, ticket) returned. */
static PyObject *py_reduce_scatter_start(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 4, "shm_reduce_scatter_start")) return NULL;
    acc_shm_group *g = get_group(args[0], "shm_reduce_scatter_start");
    acc_tensor in, out;
    acc_redop op;
    if (!g || acc_tensor_borrow_cpu(m, args[1], &in, "shm_reduce_scatter_start input", -1) < 0 ||
        acc_tensor_borrow_cpu(m, args[2], &out, "shm_reduce_scatter_start output", (int)in.dtype) < 0 ||
        parse_op(args[3], &op) < 0)
        return NULL;
    if (in.numel != out.numel * acc_shm_group_size(g))
        return PyErr_Format(PyExc_ValueError, "shm_reduce_scatter_start: input has %lld elements, expected %d x %lld",
                            (long long)in.numel, acc_shm_group_size(g), (long long)out.numel);
    uint64_t ticket = 0;
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = acc_shm_async_submit_op(g, ACC_ASYNC_REDUCE_SCATTER, in.data, out.data, (size_t)out.numel, in.dtype, op,
                                 &ticket);
    Py_END_ALLOW_THREADS
    if (st) return acc_raise_status(st, "shm_reduce_scatter_start");
    return PyLong_FromUnsignedLongLong(ticket);
}

static PyObject *py_all_gather_start(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 3, "shm_all_gather_start")) return NULL;
    acc_shm_group *g = get_group(args[0], "shm_all_gather_start");
    acc_tensor in, out;
    if (!g || acc_tensor_borrow_cpu(m, args[1], &in, "shm_all_gather_start input", -1) < 0 ||
        acc_tensor_borrow_cpu(m, args[2], &out, "shm_all_gather_start output", -1) < 0)
        return NULL;
    size_t nb = (size_t)in.numel * acc_dtype_size(in.dtype);
    if ((size_t)out.numel * acc_dtype_size(out.dtype) != nb * (size_t)acc_shm_group_size(g))
        return PyErr_Format(PyExc_ValueError, "shm_all_gather_start: output must hold %d x %zu bytes",
                            acc_shm_group_size(g), nb);
    uint64_t ticket = 0;
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = acc_shm_async_submit_op(g, ACC_ASYNC_ALL_GATHER, in.data, out.data, nb, ACC_U8, ACC_RED_SUM, &ticket);
    Py_END_ALLOW_THREADS
    if (st) return acc_raise_status(st, "shm_all_gather_start");
    return PyLong_FromUnsignedLongLong(ticket);
}

static int parse_ticket(PyObject *o, uint64_t *t) {
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *t = v;
    return 0;
}

/* shm_wait(handle, ticket): block (without the GIL) until the ticket finished; raise its error. */
static PyObject *py_wait(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 2, "shm_wait")) return NULL;
    acc_shm_group *g = get_group(args[0], "shm_wait");
    uint64_t ticket;
    if (!g || parse_ticket(args[1], &ticket) < 0) return NULL;
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = acc_shm_async_wait(g, ticket);
    Py_END_ALLOW_THREADS
    if (st) return acc_raise_status(st, "shm async collective");
    Py_RETURN_NONE;
}

static PyObject *py_done(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 2, "shm_done")) return NULL;
    acc_shm_group *g = get_group(args[0], "shm_done");
    uint64_t ticket;
    if (!g || parse_ticket(args[1], &ticket) < 0) return NULL;
    return PyBool_FromLong(acc_shm_async_done(g, ticket));
}

/* shm_reduce_scatter(handle, input, output, op): input has nranks * output.numel() elements */
static PyObject *py_reduce_scatter(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 4, "shm_reduce_scatter")) return NULL;
    acc_shm_group *g = get_group(args[0], "shm_reduce_scatter");
    acc_tensor in, out;
    acc_redop op;
    if (!g || acc_tensor_borrow_cpu(m, args[1], &in, "shm_reduce_scatter input", -1) < 0 ||
        acc_tensor_borrow_cpu(m, args[2], &out, "shm_reduce_scatter output", (int)in.dtype) < 0 ||
        parse_op(args[3], &op) < 0)
        return NULL;
    if (in.numel != out.numel * acc_shm_group_size(g))
        return PyErr_Format(PyExc_ValueError, "shm_reduce_scatter: input has %lld elements, expected %d x %lld",
                            (long long)in.numel, acc_shm_group_size(g), (long long)out.numel);
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = acc_shm_async_drain(g);
    if (st == ACC_OK) st = acc_shm_reduce_scatter(g, in.data, out.data, (size_t)out.numel, in.dtype, op);
    Py_END_ALLOW_THREADS
    if (st) return acc_raise_status(st, "shm_reduce_scatter");
    Py_RETURN_NONE;
}

/* shm_all_gather(handle, input, output): output holds nranks * input bytes, rank order */
static PyObject *py_all_gather(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 3, "shm_all_gather")) return NULL;
    acc_shm_group *g = get_group(args[0], "shm_all_gather");
    acc_tensor in, out;
    if (!g || acc_tensor_borrow_cpu(m, args[1], &in, "shm_all_gather input", -1) < 0 ||
        acc_tensor_borrow_cpu(m, args[2], &out, "shm_all_gather output", -1) < 0)
        return NULL;
    size_t nb = (size_t)in.numel * acc_dtype_size(in.dtype);
    if ((size_t)out.numel * acc_dtype_size(out.dtype) != nb * (size_t)acc_shm_group_size(g))
        return PyErr_Format(PyExc_ValueError, "shm_all_gather: output must hold %d x %zu bytes",
                            acc_shm_group_size(g), nb);
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = acc_shm_async_drain(g);
    if (st == ACC_OK) st = acc_shm_all_gather(g, in.data, out.data, nb);
    Py_END_ALLOW_THREADS
    if (st) return acc_raise_status(st, "shm_all_gather");
    Py_RETURN_NONE;
}

/* shm_broadcast(handle, tensor, root) */
static PyObject *py_broadcast(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 3, "shm_broadcast")) return NULL;
    acc_shm_group *g = get_group(args[0], "shm_broadcast");
    acc_tensor t;
    long root = PyLong_AsLong(args[2]);
    if (!g || (root == -1 && PyErr_Occurred()) || acc_tensor_borrow_cpu(m, args[1], &t, "shm_broadcast", -1) < 0)
        return NULL;
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = acc_shm_async_drain(g);
    if (st == ACC_OK) st = acc_shm_broadcast(g, t.data, (size_t)t.numel * acc_dtype_size(t.dtype), (int)root);
    Py_END_ALLOW_THREADS
    if (st) return acc_raise_status(st, "shm_broadcast");
    Py_RETURN_NONE;
}

/* shm_scatter(handle, input, output, root): root's input (nranks * output bytes) -> every rank's output,
 * block q to rank q; input is only read on root and may be None elsewhere */
static PyObject *py_scatter(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 4, "shm_scatter")) return NULL;
    acc_shm_group *g = get_group(args[0], "shm_scatter");
    acc_tensor in, out;
    long root = PyLong_AsLong(args[3]);
    if (!g || (root == -1 && PyErr_Occurred()) || acc_tensor_borrow_cpu(m, args[2], &out, "shm_scatter output", -1) < 0)
        return NULL;
    size_t nb = (size_t)out.numel * acc_dtype_size(out.dtype);
    int me = acc_shm_group_rank(g), n = acc_shm_group_size(g);
    const void *src = NULL;
    if (args[1] != Py_None) {
        if (acc_tensor_borrow_cpu(m, args[1], &in, "shm_scatter input", -1) < 0) return NULL;
        src = in.data;
        if ((size_t)in.numel * acc_dtype_size(in.dtype) != nb * (size_t)n)
            return PyErr_Format(PyExc_ValueError, "shm_scatter: rank %d's input must hold %d x %zu bytes (the "
                                "output's size), not %zu", me, n, nb, (size_t)in.numel * acc_dtype_size(in.dtype));
    } else if (me == root) {
        return PyErr_Format(PyExc_ValueError, "shm_scatter: rank %d is the root and passed no input", me);
    }
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = acc_shm_async_drain(g);
    if (st == ACC_OK) st = acc_shm_scatter(g, src, out.data, nb, (int)root);
    Py_END_ALLOW_THREADS
    if (st) return acc_raise_status(st, "shm_scatter");
    Py_RETURN_NONE;
}

static PyObject *py_barrier(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 1, "shm_barrier")) return NULL;
    acc_shm_group *g = get_group(args[0], "shm_barrier");
    if (!g) return NULL;
    acc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = acc_shm_async_drain(g);
    if (st == ACC_OK) st = acc_shm_barrier(g);
    Py_END_ALLOW_THREADS
    if (st) return acc_raise_status(st, "shm_barrier");
    Py_RETURN_NONE;
}

/* shm_region_fd(name, create, total_bytes) -> fd (caller mmaps and closes it) */
static PyObject *py_region_fd(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 3, "shm_region_fd")) return NULL;
    const char *name = PyUnicode_AsUTF8AndSize(args[0], NULL);
    int create = PyObject_IsTrue(args[1]);
    long long total = PyLong_AsLongLong(args[2]);
    if (!name || create < 0 || PyErr_Occurred()) return NULL;
    int fd = -1;
    acc_status st = acc_shm_region_fd(name, create, (size_t)total, &fd);
    if (st) return acc_raise_status(st, "shm_region_fd");
    return PyLong_FromLong(fd);
}

static PyObject *py_unlink(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 1, "shm_unlink")) return NULL;
    const char *name = PyUnicode_AsUTF8AndSize(args[0], NULL);
    if (!name) return NULL;
    acc_status st = acc_shm_unlink(name);
    if (st) return acc_raise_status(st, "shm_unlink");
    Py_RETURN_NONE;
}

/* shm_region_register(handle, whole_region_uint8_tensor, part_bytes) / shm_region_unregister(handle, t) */
static PyObject *py_region_register(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 3, "shm_region_register")) return NULL;
    acc_shm_group *g = get_group(args[0], "shm_region_register");
    acc_tensor t;
    long long part = PyLong_AsLongLong(args[2]);
    if (!g || PyErr_Occurred() || acc_tensor_borrow_cpu(m, args[1], &t, "shm_region_register", ACC_U8) < 0) return NULL;
    if (part <= 0 || (long long)t.numel != part * acc_shm_group_size(g))
        return PyErr_Format(PyExc_ValueError, "shm_region_register: region of %lld bytes is not %d parts of %lld",
                            (long long)t.numel, acc_shm_group_size(g), part);
    acc_status st = acc_shm_region_register(g, t.data, (size_t)part);
    if (st) return acc_raise_status(st, "shm_region_register");
    Py_RETURN_NONE;
}

static PyObject *py_region_unregister(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 2, "shm_region_unregister")) return NULL;
    acc_shm_group *g = get_group(args[0], "shm_region_unregister");
    if (!g) return NULL;
    if (PyLong_Check(args[1])) { /* the region's address (its tensors may be gone already) */
        void *base = PyLong_AsVoidPtr(args[1]);
        if (!base && PyErr_Occurred()) return NULL;
        acc_shm_region_unregister(g, base);
        Py_RETURN_NONE;
    }
    acc_tensor t;
    if (acc_tensor_borrow_cpu(m, args[1], &t, "shm_region_unregister", ACC_U8) < 0) return NULL;
    acc_shm_region_unregister(g, t.data);
    Py_RETURN_NONE;
}

#define FC(f) (PyCFunction)(void (*)(void))(f), METH_FASTCALL

PyMethodDef acc_shm_methods[] = {
    {"shm_group_open", FC(py_group_open),
     "shm_group_open($module, name, create, rank, nranks, small_bytes, chunk_bytes, timeout_s, /)\n--\n\n"
     "Create (rank 0, O_EXCL, 0600) or attach the control segment of a local group; returns a handle."},
    {"shm_group_wait_attached", FC(py_group_wait_attached),
     "shm_group_wait_attached($module, handle, /)\n--\n\nWait until every rank attached (unlinks on timeout)."},
    {"shm_group_close", FC(py_group_close), "shm_group_close($module, handle, /)\n--\n\nUnmap the segment."},
    {"shm_set_timeout", FC(py_set_timeout),
     "shm_set_timeout($module, handle, seconds, /)\n--\n\nSet the per-wait timeout."},
    {"shm_group_spin_us", FC(py_group_spin_us),
     "shm_group_spin_us($module, handle, /)\n--\n\n"
     "(spin_us, inner_spin_us): the spin budgets the group waits with (set_options' values when it was opened)."},
    {"shm_all_reduce", FC(py_all_reduce),
     "shm_all_reduce($module, handle, tensor, op, /)\n--\n\n"
     "In-place all-reduce (op: 0 sum, 1 avg, 2 max, 3 min, 4 sum_div = sum rounded to the dtype, then / N)."},
    {"shm_all_reduce_out", FC(py_all_reduce_out),
     "shm_all_reduce_out($module, handle, input, output, op, /)\n--\n\n"
     "output = all-reduce of every rank's input (input untouched; output is input or disjoint from it)."},
    {"shm_all_reduce_start", FC(py_all_reduce_start),
     "shm_all_reduce_start($module, handle, tensor, op, /)\n--\n\n"
     "Queue an in-place all-reduce on the group's C worker thread; returns a ticket for shm_wait/shm_done."},
    {"shm_reduce_scatter_start", FC(py_reduce_scatter_start),
     "shm_reduce_scatter_start($module, handle, input, output, op, /)\n--\n\n"
     "Queue a reduce-scatter on the group's C worker thread; returns a ticket for shm_wait/shm_done."},
    {"shm_all_gather_start", FC(py_all_gather_start),
     "shm_all_gather_start($module, handle, input, output, /)\n--\n\n"
     "Queue a raw-byte all-gather on the group's C worker thread; returns a ticket for shm_wait/shm_done."},
    {"shm_wait", FC(py_wait),
     "shm_wait($module, handle, ticket, /)\n--\n\nWait (GIL released) until the ticket finished; raises its error."},
    {"shm_done", FC(py_done), "shm_done($module, handle, ticket, /)\n--\n\nTrue once the ticket finished."},
    {"shm_reduce_scatter", FC(py_reduce_scatter),
     "shm_reduce_scatter($module, handle, input, output, op, /)\n--\n\n"
     "output = reduction of every rank's input[rank*n:(rank+1)*n], n = output.numel()."},
    {"shm_all_gather", FC(py_all_gather),
     "shm_all_gather($module, handle, input, output, /)\n--\n\nRaw-byte all-gather in rank order."},
    {"shm_broadcast", FC(py_broadcast),
     "shm_broadcast($module, handle, tensor, root, /)\n--\n\nRaw-byte broadcast from root, in place."},
    {"shm_scatter", FC(py_scatter),
     "shm_scatter($module, handle, input, output, root, /)\n--\n\n"
     "Raw-byte scatter: root's input block q (output's size) -> rank q's output; input None off the root."},
    {"shm_barrier", FC(py_barrier), "shm_barrier($module, handle, /)\n--\n\nBarrier over the local group."},
    {"shm_region_fd", FC(py_region_fd),
     "shm_region_fd($module, name, create, total_bytes, /)\n--\n\nOpen (or create, 0600) a region; returns an fd."},
    {"shm_unlink", FC(py_unlink), "shm_unlink($module, name, /)\n--\n\nshm_unlink, ignoring a missing name."},
    {"shm_region_register", FC(py_region_register),
     "shm_region_register($module, handle, region, part_bytes, /)\n--\n\n"
     "Register a mapped region (uint8 tensor over all parts) so collectives on tensors inside it are zero-copy."},
    {"shm_region_unregister", FC(py_region_unregister),
     "shm_region_unregister($module, handle, region, /)\n--\n\nForget a registered region (its uint8 tensor or its "
     "address)."},
    {NULL, NULL, 0, NULL},
};
