/* The push plan: what a push writes, made once per buffer (the Copier in Python) and held in a
 * capsule, with the views of the buffer's columns that the one-call push (push.c) writes through. */
#include "native.h"

#include <string.h>

void plan_release(PushPlan *p) {
    Py_buffer *views[8] = {&p->lock, &p->cur, &p->stats, &p->stamp, &p->owner, &p->writers, &p->me, &p->episode};
    for (int i = 0; i < p->held && i < 8; i++) PyBuffer_Release(views[i]);
    p->held = 0;
    for (Py_ssize_t g = 0; g < p->n_dst; g++) PyBuffer_Release(&p->dst[g]);
    p->n_dst = 0;
    p->closed = 1;
}

static void plan_free(PushPlan *p) {
    if (p->held || p->n_dst) plan_release(p);
    for (Py_ssize_t g = 0; g < p->n; g++) {
        Py_XDECREF(p->names[g]);
        PyMem_Free(p->format[g]);
    }
    Py_XDECREF(p->empty);
    Py_XDECREF(p->int64);
    PyMem_Free(p);
}

static void plan_capsule_free(PyObject *capsule) { plan_free((PushPlan *)PyCapsule_GetPointer(capsule, PLAN_CAPSULE)); }

/* the plan in a capsule made by plan() (NULL with an error otherwise) */
PushPlan *plan_of(PyObject *capsule) { return (PushPlan *)PyCapsule_GetPointer(capsule, PLAN_CAPSULE); }

/* the ring's views from `ring`, a tuple (lock, cursors, stats, stamp, owner, writers, me), and the
 * episode column (None: the buffer keeps no episodes), checked against the layout; -1 with an
 * error (the views taken stay counted in p->held) */
static int plan_ring(PushPlan *p, PyObject *ring, PyObject *episode_o, Py_ssize_t envs) {
    if (!PyTuple_Check(ring) || PyTuple_GET_SIZE(ring) != 7) {
        PyErr_SetString(PyExc_TypeError, "plan: ring must be (lock, cursors, stats, stamp, owner, writers, me)");
        return -1;
    }
    struct { PyObject *o; Py_buffer *v; Py_ssize_t item; const char *what; } views[8] = {
        {PyTuple_GET_ITEM(ring, 0), &p->lock, 0, "lock"},       {PyTuple_GET_ITEM(ring, 1), &p->cur, 8, "cursors"},
        {PyTuple_GET_ITEM(ring, 2), &p->stats, 8, "stats"},     {PyTuple_GET_ITEM(ring, 3), &p->stamp, 8, "stamp"},
        {PyTuple_GET_ITEM(ring, 4), &p->owner, 2, "owner"},     {PyTuple_GET_ITEM(ring, 5), &p->writers, 8, "writers"},
        {PyTuple_GET_ITEM(ring, 6), &p->me, 8, "me"},           {episode_o, &p->episode, 8, "episode"}};
    p->has_episode = episode_o != Py_None;
    for (int i = 0; i < (p->has_episode ? 8 : 7); i++) {
        if (get_buf(views[i].o, views[i].v, 1, views[i].item, views[i].what) < 0) return -1;
        p->held = i + 1;
    }
    p->capacity = p->stamp.len / 8;
    p->lanes = lanes_of(&p->cur, p->capacity, "plan");
    if (!p->lanes) return -1;
    p->lc = p->capacity / p->lanes;
    if (p->lock.len < LOCK_SIZE || ((uintptr_t)p->lock.buf & 7) || p->owner.len / 2 != p->capacity || p->me.len != 16 ||
        p->writers.len != WRITERS * 8 || (p->has_episode && p->episode.len / 8 != p->capacity) ||
        p->stats.len != STATS_WORDS * 8 || envs < 0 || (envs && p->lanes != envs)) {
        PyErr_SetString(PyExc_ValueError, "plan: lock, owners, writers, me, episodes, counters or envs do not fit the ring");
        return -1;
    }
    p->envs = envs;
    return 0;
}

/* field g from `field`, a tuple (name, format, shape, width, target, offset): its name (str),
 * buffer format (bytes), shape (a tuple of at most MAX_DIMS ints), width (bytes of one row),
 * target column ((capacity, row bytes), writable) and byte offset in the target's rows; -1 with
 * an error */
static int plan_field(PushPlan *p, Py_ssize_t g, PyObject *field) {
    if (!PyTuple_Check(field) || PyTuple_GET_SIZE(field) != 6) {
        PyErr_SetString(PyExc_TypeError, "plan: each field must be (name, format, shape, width, target, offset)");
        return -1;
    }
    PyObject *name = PyTuple_GET_ITEM(field, 0), *fmt = PyTuple_GET_ITEM(field, 1), *shape = PyTuple_GET_ITEM(field, 2);
    if (!PyUnicode_Check(name) || !PyBytes_Check(fmt) || !PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) > MAX_DIMS) {
        PyErr_SetString(PyExc_TypeError, "plan: names are str, formats bytes, shapes tuples of at most 16 ints");
        return -1;
    }
    if (get_buf(PyTuple_GET_ITEM(field, 4), &p->dst[g], 1, 0, "plan target") < 0) return -1;
    p->n = p->n_dst = g + 1;
    Py_INCREF(name);
    p->names[g] = name;
    Py_ssize_t flen = PyBytes_GET_SIZE(fmt);
    p->format[g] = (char *)PyMem_Malloc((size_t)flen + 1);
    if (!p->format[g]) { PyErr_NoMemory(); return -1; }
    memcpy(p->format[g], PyBytes_AS_STRING(fmt), (size_t)flen + 1);
    p->ndim[g] = PyTuple_GET_SIZE(shape);
    for (Py_ssize_t j = 0; j < p->ndim[g]; j++) {
        p->shape[g][j] = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, j));
        if (p->shape[g][j] < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "plan: a negative dimension");
            return -1;
        }
    }
    p->width[g] = PyLong_AsSsize_t(PyTuple_GET_ITEM(field, 3));
    p->offset[g] = PyLong_AsSsize_t(PyTuple_GET_ITEM(field, 5));
    if (PyErr_Occurred()) return -1;
    p->row[g] = p->dst[g].len / p->capacity;
    if (p->dst[g].len % p->capacity || p->offset[g] < 0 || p->width[g] < 0 || p->offset[g] + p->width[g] > p->row[g]) {
        PyErr_Format(PyExc_ValueError, "plan: field %zd: expected a target of (capacity, row) bytes with offset + width <= row", g);
        return -1;
    }
    return 0;
}

/* numpy.empty and numpy.dtype("int64"), for the ids' array of each push */
static int plan_numpy(PushPlan *p) {
    PyObject *np = PyImport_ImportModule("numpy");
    if (!np) return -1;
    p->empty = PyObject_GetAttrString(np, "empty");
    PyObject *dtype = p->empty ? PyObject_GetAttrString(np, "dtype") : NULL;
    Py_DECREF(np);
    if (!dtype) return -1;
    p->int64 = PyObject_CallFunction(dtype, "s", "int64");
    Py_DECREF(dtype);
    return p->int64 ? 0 : -1;
}

/* plan(ring, fields, episode=None, envs=0) -> capsule: what a push writes, once per buffer: the
 * ring's columns (ring: (lock, cursors, stats, stamp, owner, writers, me), `me` the int64
 * [pid, entry] of this process's writer entry, kept by Ring.writer_id), each field's (name,
 * format, shape, width, target, offset), the episode column (None without episodes) and envs (0:
 * none). Its views stay held until the capsule goes or plan_close releases them. */
PyObject *py_plan(PyObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ring", "fields", "episode", "envs", NULL};
    PyObject *ring, *fields, *episode_o = Py_None;
    Py_ssize_t envs = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!|On:plan", kwlist, &ring, &PyTuple_Type, &fields, &episode_o, &envs))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(fields);
    if (n < 1 || n > MAX_COLS) {
        PyErr_SetString(PyExc_ValueError, "plan: expected 1 to 64 fields, each (name, format, shape, width, target, offset)");
        return NULL;
    }
    PushPlan *p = (PushPlan *)PyMem_Calloc(1, sizeof(PushPlan));
    if (!p) return PyErr_NoMemory();
    if (plan_ring(p, ring, episode_o, envs) < 0) goto fail;
    for (Py_ssize_t g = 0; g < n; g++)
        if (plan_field(p, g, PyTuple_GET_ITEM(fields, g)) < 0) goto fail;
    if (plan_numpy(p) < 0) goto fail;
    PyObject *capsule = PyCapsule_New(p, PLAN_CAPSULE, plan_capsule_free);
    if (!capsule) goto fail;
    return capsule;
fail:
    plan_free(p);
    return NULL;
}

/* plan_close(plan): from now on every push through the plan is left to Python (which says the
 * buffer is closed), and its views of the buffer are released (ReplayBuffer.close), so that a push
 * callable still held somewhere does not keep the mapping: at once, or by the last push in flight
 * in another thread of this process (one inherited by a forked child is not in flight there). */
PyObject *py_plan_close(PyObject *self, PyObject *capsule) {
    PushPlan *p = plan_of(capsule);
    if (!p) return NULL;
    p->closed = 1;
    if (!p->busy || p->busy_pid != push_pid) plan_release(p);
    Py_RETURN_NONE;
}
