/* Prioritized replay's calls (protocol/priorities.py, sampling/samplers.py, ring.py): a whole
 * draw with its ids, an update's checks of ids and priorities, and a whole update_priorities. */
#include "native.h"

#include <math.h>
#include <pthread.h>

void ids_of_slots(const int64_t *stamp, const int64_t *cur, Py_ssize_t lanes, int64_t lc, const int64_t *slots,
                         const double *leaves, int64_t *ids, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) ids[i] = __atomic_load_n(&stamp[slots[i]], __ATOMIC_ACQUIRE);
    int64_t start0 = 0, start;
    if (lanes == 1) lane_bounds(cur, 0, lc, &start0);
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = ids[i], row = number_of_stamp(s), lane = lanes == 1 ? 0 : slots[i] / lc;
        if (lanes == 1) start = start0;
        else lane_bounds(cur, lane, lc, &start);
        int bad = !is_committed(s) || row < start || !(leaves[i] > 0);
        ids[i] = bad ? INVALID_ID : row_id(row, lane, lanes);
    }
}

/* tree_draw(sums, plan, capacity, total, u, stratified, stamp, cursors, slots, leaves, ids):
 * samplers.tree_draw after its rng.random(k) (u, k uniform floats in [0, 1); total, the tree's
 * total the caller read, > 0): the masses (stratified: (u_i + i) * (total / k), else
 * u_i * total, numpy's operations in numpy's order), find's slots, their leaves and
 * ids_of_slots. The tree and the stamps are read without a lock, as the Python path reads them. */
PyObject *py_tree_draw(PyObject *self, PyObject *args) {
    PyObject *sums_o, *plan_o, *u_o, *stamp_o, *cur_o, *slots_o, *leaves_o, *ids_o;
    Py_ssize_t capacity;
    int stratified;
    double total;
    if (!PyArg_ParseTuple(args, "OOndOpOOOOO", &sums_o, &plan_o, &capacity, &total, &u_o, &stratified, &stamp_o, &cur_o,
                          &slots_o, &leaves_o, &ids_o))
        return NULL;
    Py_buffer b[7];
    PyObject *objs[7] = {sums_o, u_o, stamp_o, cur_o, slots_o, leaves_o, ids_o};
    const char *names[7] = {"sums", "u", "stamp", "cursors", "slots", "leaves", "ids"};
    const int writable[7] = {0, 0, 0, 0, 1, 1, 1};
    int held = 0;
    PyObject *result = NULL;
    double *x = NULL;
    for (; held < 7; held++)
        if (get_buf(objs[held], &b[held], writable[held], 8, names[held]) < 0) goto done;
    {
        Levels lv;
        if (levels_read(plan_o, capacity, b[0].len / 8, &lv) < 0) goto done;
        Py_ssize_t n = b[1].len / 8, ring = b[2].len / 8;
        if (b[4].len / 8 != n || b[5].len / 8 != n || b[6].len / 8 != n) {
            PyErr_SetString(PyExc_ValueError, "tree_draw: expected one slot, leaf and id per point");
            goto done;
        }
        if (ring != capacity) {
            PyErr_SetString(PyExc_ValueError, "tree_draw: expected one stamp per slot of the tree");
            goto done;
        }
        Py_ssize_t lanes = lanes_of(&b[3], ring, "tree_draw");
        if (!lanes) goto done;
        const double *sums = (const double *)b[0].buf, *u = (const double *)b[1].buf;
        x = (double *)PyMem_Malloc((size_t)(n ? n : 1) * sizeof(double));
        if (!x) { PyErr_NoMemory(); goto done; }
        if (stratified) {
            double step = total / (double)n; /* Python's total / k */
            for (Py_ssize_t i = 0; i < n; i++) x[i] = (u[i] + (double)i) * step;
        } else {
            for (Py_ssize_t i = 0; i < n; i++) x[i] = u[i] * total;
        }
        int64_t *slots = (int64_t *)b[4].buf, *ids = (int64_t *)b[6].buf;
        double *leaves = (double *)b[5].buf;
        tree_walk(sums, &lv, capacity, x, slots, n);
        for (Py_ssize_t i = 0; i < n; i++) leaves[i] = sums[slots[i]];
        ids_of_slots((const int64_t *)b[2].buf, (const int64_t *)b[3].buf, lanes, ring / lanes, slots, leaves, ids, n);
        result = Py_None;
        Py_INCREF(result);
    }
done:
    PyMem_Free(x);
    for (int i = 0; i < held; i++) PyBuffer_Release(&b[i]);
    return result;
}

/* scan(values) -> float: the largest of values (float64) when every one is finite and >= 0
 * (0.0 for none), else -1.0 (the caller's checks say which are not). */
PyObject *py_scan(PyObject *self, PyObject *arg) {
    Py_buffer vb;
    if (get_buf(arg, &vb, 0, 8, "values") < 0) return NULL;
    const double *v = (const double *)vb.buf;
    Py_ssize_t n = vb.len / 8;
    double most = 0.0;
    int ok = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        ok &= isfinite(v[i]) && v[i] >= 0;
        if (v[i] > most) most = v[i];
    }
    PyBuffer_Release(&vb);
    return PyFloat_FromDouble(ok ? most : -1.0);
}

/* Ring.check_ids's test: every id >= 0 and its row number below its lane's cursor */
static int ids_known(const int64_t *ids, Py_ssize_t n, const int64_t *cur, Py_ssize_t lanes) {
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t id = ids[i];
        if (id < 0 || number_of_id(id, lanes) >= load_cursor(cur, lane_of_id(id, lanes))) return 0;
    }
    return 1;
}

/* known(ids, cursors) -> bool: Ring.check_ids's test, every id >= 0 and its row number
 * id // lanes below its lane's cursor (False: the caller finds which and raises). */
PyObject *py_known(PyObject *self, PyObject *args) {
    PyObject *ids_o, *cur_o;
    if (!PyArg_ParseTuple(args, "OO", &ids_o, &cur_o)) return NULL;
    Py_buffer ib, cb;
    if (get_buf(ids_o, &ib, 0, 8, "ids") < 0) return NULL;
    if (get_buf(cur_o, &cb, 0, 8, "cursors") < 0) { PyBuffer_Release(&ib); return NULL; }
    PyObject *result = NULL;
    Py_ssize_t lanes = cb.len / (LANE_WORDS * 8);
    if (lanes <= 0 || cb.len % (LANE_WORDS * 8)) {
        PyErr_Format(PyExc_ValueError, "known: expected a (lanes, %d) int64 cursor array", LANE_WORDS);
        goto done;
    }
    result = ids_known((const int64_t *)ib.buf, ib.len / 8, (const int64_t *)cb.buf, lanes) ? Py_True : Py_False;
    Py_INCREF(result);
done:
    PyBuffer_Release(&ib);
    PyBuffer_Release(&cb);
    return result;
}

/* current(ids, stamp, cursors, ok): Ring.current into ok (bool): each id's slot holds its
 * committed stamp and the row is not older than its lane's base (clear()). Ids of any value are
 * safe (as in gather). */
PyObject *py_current(PyObject *self, PyObject *args) {
    PyObject *ids_o, *stamp_o, *cur_o, *ok_o;
    if (!PyArg_ParseTuple(args, "OOOO", &ids_o, &stamp_o, &cur_o, &ok_o)) return NULL;
    Py_buffer ib, sb, cb, kb;
    if (get_buf(ids_o, &ib, 0, 8, "ids") < 0) return NULL;
    if (get_buf(stamp_o, &sb, 0, 8, "stamp") < 0) { PyBuffer_Release(&ib); return NULL; }
    if (get_buf(cur_o, &cb, 0, 8, "cursors") < 0) { PyBuffer_Release(&ib); PyBuffer_Release(&sb); return NULL; }
    if (get_buf(ok_o, &kb, 1, 1, "ok") < 0) {
        PyBuffer_Release(&ib); PyBuffer_Release(&sb); PyBuffer_Release(&cb); return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = ib.len / 8, capacity = sb.len / 8;
    Py_ssize_t lanes = lanes_of(&cb, capacity, "current");
    if (!lanes) goto done;
    if (kb.len != n) {
        PyErr_SetString(PyExc_ValueError, "current: ok needs one bool per id");
        goto done;
    }
    {
        const int64_t *ids = (const int64_t *)ib.buf, *stamp = (const int64_t *)sb.buf, *cur = (const int64_t *)cb.buf;
        char *ok = (char *)kb.buf;
        int64_t lc = capacity / lanes, slot;
        for (Py_ssize_t i = 0; i < n; i++) ok[i] = id_current(ids[i], stamp, cur, lanes, lc, &slot);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&ib);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&cb);
    PyBuffer_Release(&kb);
    return result;
}

/* update_priorities's work under the lock, running no Python code: the ids still current set
 * their slots' leaves in order (the last of a repeated slot wins) and the largest priority
 * (prio[0]) takes the largest of theirs; live: scratch for n slots and n leaves. The count set. */
static Py_ssize_t set_current(const Py_buffer *b, const Levels *lv, Py_ssize_t lanes, Py_ssize_t n, int64_t *live) {
    const int64_t *ids = (const int64_t *)b[1].buf, *stamp = (const int64_t *)b[4].buf, *cur = (const int64_t *)b[5].buf;
    const double *prios = (const double *)b[2].buf, *leaves = (const double *)b[3].buf;
    double *values = (double *)(live + (n ? n : 1)), most = 0.0;
    int64_t lc = (b[4].len / 8) / lanes;
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!id_current(ids[i], stamp, cur, lanes, lc, &live[m])) continue;
        values[m++] = leaves[i];
        if (prios[i] > most) most = prios[i];
    }
    tree_set((double *)b[6].buf, (double *)b[7].buf, lv, live, values, 0.0, m);
    double *top = (double *)b[8].buf;
    if (m && most > top[0]) top[0] = most; /* Priorities.set_rows: max(prio[0], the largest) */
    return m;
}

/* update_priorities(lock, ids, priorities, leaves, stamp, cursors, sums, mins, plan, capacity, prio)
 * -> live count, or None with nothing changed: ReplayBuffer.update_priorities in one call, for a
 * buffer without max_use, given priorities the caller checked (finite, >= 0, leaves below
 * MAX_LEAF) and their leaves (numpy's (p + eps) ** alpha: the tree then holds what the Python
 * path writes, to the bit). Before the lock: every id known (Ring.check_ids), else None (the
 * Python path raises). The lock is only tried: None when it is busy, held by this thread, owes
 * repairs, or its holder died (as push: its repairs are owed to the next locker, lock.py). Under
 * it: set_current. */
PyObject *py_update_priorities(PyObject *self, PyObject *args) {
    PyObject *o[10];
    Py_ssize_t capacity;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOnO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8], &capacity,
                          &o[9]))
        return NULL;
    PyObject *plan_o = o[8], *bufs_o[9] = {o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7], o[9]};
    static const char *names[9] = {"lock", "ids", "priorities", "leaves", "stamp", "cursors", "sums", "mins", "prio"};
    static const int writable[9] = {1, 0, 0, 0, 0, 0, 1, 1, 1}, itemsize[9] = {0, 8, 8, 8, 8, 8, 8, 8, 8};
    Py_buffer b[9];
    int held = 0;
    PyObject *result = NULL;
    int64_t *live = NULL;
    for (; held < 9; held++)
        if (get_buf(bufs_o[held], &b[held], writable[held], itemsize[held], names[held]) < 0) goto done;
    Levels lv;
    if (levels_read(plan_o, capacity, b[6].len / 8, &lv) < 0) goto done;
    Py_ssize_t n = b[1].len / 8, ring = b[4].len / 8;
    if (b[0].len < LOCK_SIZE || ((uintptr_t)b[0].buf & 7) || b[2].len / 8 != n || b[3].len / 8 != n ||
        b[7].len != b[6].len || ring != capacity || b[8].len < 8) {
        PyErr_SetString(PyExc_ValueError,
                        "update_priorities: expected a 64-byte lock, one priority and leaf per id, a stamp per "
                        "slot of the tree, mins as long as sums and a largest priority");
        goto done;
    }
    Py_ssize_t lanes = lanes_of(&b[5], ring, "update_priorities");
    if (!lanes) goto done;
    /* Ring.check_ids: an id that never named a row is the caller's bug, which Python explains */
    if (!ids_known((const int64_t *)b[1].buf, n, (const int64_t *)b[5].buf, lanes)) {
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    live = (int64_t *)PyMem_Malloc((size_t)(n ? n : 1) * (sizeof(int64_t) + sizeof(double)));
    if (!live) { PyErr_NoMemory(); goto done; }
    if (!lock_try(b[0].buf)) {
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    Py_ssize_t m = set_current(b, &lv, lanes, n, live);
    pthread_mutex_unlock((pthread_mutex_t *)b[0].buf);
    result = PyLong_FromSsize_t(m);
done:
    PyMem_Free(live);
    for (int i = 0; i < held; i++) PyBuffer_Release(&b[i]);
    return result;
}
