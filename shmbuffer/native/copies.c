/* A push's steps that Python drives (protocol/ring.py, edits.py): the copies of its rows and the
 * commit (put), the reservation of its slots (reserve, reserve_lanes) and a check of its lanes. */
#include "native.h"

#include <string.h>

/* slots from `where`: an int (the first of k consecutive slots) or a buffer of k int64 slots;
 * all checked to lie in [0, capacity) */
static int read_slots(PyObject *where, Py_ssize_t k, Py_ssize_t capacity, Py_buffer *kb, int *have, int64_t *first) {
    *have = 0;
    if (PyLong_Check(where)) {
        long long s = PyLong_AsLongLong(where);
        if (s == -1 && PyErr_Occurred()) return -1;
        if (k < 0 || s < 0 || s + k > capacity) {
            PyErr_Format(PyExc_IndexError, "slots %lld..%lld are outside the ring's %zd slots", s, s + k, capacity);
            return -1;
        }
        *first = s;
        return 0;
    }
    if (get_buf(where, kb, 0, 8, "slots") < 0) return -1;
    *have = 1;
    if (kb->len / 8 != k) {
        PyErr_SetString(PyExc_ValueError, "slots: expected k slots");
        PyBuffer_Release(kb);
        *have = 0;
        return -1;
    }
    const int64_t *slots = (const int64_t *)kb->buf;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (slots[i] < 0 || slots[i] >= capacity) {
            PyErr_Format(PyExc_IndexError, "slot %lld is outside the ring's %zd slots", (long long)slots[i], capacity);
            PyBuffer_Release(kb);
            *have = 0;
            return -1;
        }
    }
    return 0;
}

#define SLOT(i) (slots ? slots[i] : first + (int64_t)(i))

/* A push's copies (Copies, native.h) from Python's arrays: copies_open checks everything before
 * anything is copied: 1 ready, 0 a source needs a cast or a contiguous copy (formats: a tuple of
 * buffer format strings, or None; the caller casts), -1 an error raised. */
static void copies_close(Copies *c) {
    for (Py_ssize_t i = 0; i < c->n; i++) {
        PyBuffer_Release(&c->src[i]);
        PyBuffer_Release(&c->dst[i]);
    }
    c->n = 0;
}

static int copies_open(Copies *c, PyObject *dst_o, PyObject *off_o, PyObject *fmt_o, PyObject *src_o, Py_ssize_t k,
                       Py_ssize_t capacity) {
    c->n = 0;
    c->total = 0;
    Py_ssize_t ncols = PyTuple_GET_SIZE(src_o);
    if (ncols != PyTuple_GET_SIZE(dst_o) || ncols != PyTuple_GET_SIZE(off_o) || ncols > MAX_COLS ||
        (fmt_o != Py_None && (!PyTuple_Check(fmt_o) || PyTuple_GET_SIZE(fmt_o) != ncols))) {
        PyErr_SetString(PyExc_ValueError, "put: expected as many targets, offsets (and formats) as sources (at most 64)");
        return -1;
    }
    for (Py_ssize_t g = 0; g < ncols; g++) {
        Py_ssize_t offset = PyLong_AsSsize_t(PyTuple_GET_ITEM(off_o, g));
        if (offset == -1 && PyErr_Occurred()) { copies_close(c); return -1; }
        if (get_buf(PyTuple_GET_ITEM(dst_o, g), &c->dst[g], 1, 0, "put target") < 0) { copies_close(c); return -1; }
        PyObject *s = PyTuple_GET_ITEM(src_o, g);
        if (PyObject_GetBuffer(s, &c->src[g], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            PyErr_Clear();
            PyBuffer_Release(&c->dst[g]);
            copies_close(c);
            return 0; /* not a contiguous buffer: the caller makes one */
        }
        if (fmt_o != Py_None) {
            PyObject *want = PyTuple_GET_ITEM(fmt_o, g);
            const char *f = c->src[g].format ? c->src[g].format : "B";
            if (!PyBytes_Check(want) || !same_format(f, PyBytes_AS_STRING(want))) {
                PyBuffer_Release(&c->src[g]);
                PyBuffer_Release(&c->dst[g]);
                copies_close(c);
                return 0;
            }
        }
        c->n = g + 1;
        c->row[g] = c->dst[g].len / capacity;
        c->width[g] = k ? c->src[g].len / k : 0;
        if (c->dst[g].len % capacity || (k && c->src[g].len % k) || (!k && c->src[g].len) || offset < 0 ||
            offset + c->width[g] > c->row[g]) {
            PyErr_Format(PyExc_ValueError, "put: column %zd: expected a target of (capacity, row) bytes and a source "
                         "of (k, w) with offset + w <= row", g);
            copies_close(c);
            return -1;
        }
        c->to[g] = (char *)c->dst[g].buf + offset;
        c->from[g] = (const char *)c->src[g].buf;
        c->total += (size_t)c->width[g] * (size_t)k;
    }
    return 1;
}

void copies_run(const Copies *c, Py_ssize_t k, const int64_t *slots, int64_t first) {
    for (Py_ssize_t g = 0; g < c->n; g++) {
        char *to = c->to[g];
        const char *from = c->from[g];
        size_t w = (size_t)c->width[g], r = (size_t)c->row[g];
        if (w == r) { /* whole rows: consecutive slots are one copy */
            Py_ssize_t i = 0;
            while (i < k) {
                Py_ssize_t j = i + 1;
                while (j < k && SLOT(j) == SLOT(j - 1) + 1) j++;
                memcpy(to + (size_t)SLOT(i) * r, from + (size_t)i * w, (size_t)(j - i) * w);
                i = j;
            }
        } else if (w == 4) {
            for (Py_ssize_t i = 0; i < k; i++) memcpy(to + (size_t)SLOT(i) * r, from + (size_t)i * 4, 4);
        } else if (w == 8) {
            for (Py_ssize_t i = 0; i < k; i++) memcpy(to + (size_t)SLOT(i) * r, from + (size_t)i * 8, 8);
        } else {
            for (Py_ssize_t i = 0; i < k; i++) memcpy(to + (size_t)SLOT(i) * r, from + (size_t)i * w, w);
        }
    }
}

void commit_slots(int64_t *stamp, Py_ssize_t k, const int64_t *slots, int64_t first) {
    for (Py_ssize_t i = 0; i < k; i++) {
        int64_t st = __atomic_load_n(&stamp[SLOT(i)], __ATOMIC_RELAXED);
        __atomic_store_n(&stamp[SLOT(i)], commit_stamp(st), __ATOMIC_RELEASE);
    }
}

/* put(where, k, stamp, targets, offsets, formats, sources, commit) -> bool: the copies (Copies)
 * into the k slots of `where` (the first of consecutive slots, or k int64 slots); then, with
 * commit, commit_slots. False (nothing copied) when a source needs a cast; bad sizes raise. */
PyObject *py_put(PyObject *self, PyObject *args) {
    PyObject *where_o, *stamp_o, *dst_o, *off_o, *fmt_o, *src_o;
    Py_ssize_t k;
    int commit;
    if (!PyArg_ParseTuple(args, "OnOO!O!OO!p", &where_o, &k, &stamp_o, &PyTuple_Type, &dst_o, &PyTuple_Type, &off_o,
                          &fmt_o, &PyTuple_Type, &src_o, &commit))
        return NULL;
    Py_buffer kb, stb;
    Copies c;
    int have = 0;
    int64_t first = 0;
    if (get_buf(stamp_o, &stb, 1, 8, "stamp") < 0) return NULL;
    Py_ssize_t capacity = stb.len / 8;
    if (read_slots(where_o, k, capacity, &kb, &have, &first) < 0) { PyBuffer_Release(&stb); return NULL; }
    const int64_t *slots = have ? (const int64_t *)kb.buf : NULL;
    PyObject *result = NULL;
    int ready = copies_open(&c, dst_o, off_o, fmt_o, src_o, k, capacity);
    if (ready == 1) {
        PyThreadState *ts = c.total >= NOGIL_BYTES ? PyEval_SaveThread() : NULL;
        copies_run(&c, k, slots, first);
        if (commit) commit_slots((int64_t *)stb.buf, k, slots, first);
        if (ts) PyEval_RestoreThread(ts);
        copies_close(&c);
    }
    if (ready >= 0) {
        result = ready ? Py_True : Py_False;
        Py_INCREF(result);
    }
    if (have) PyBuffer_Release(&kb);
    PyBuffer_Release(&stb);
    return result;
}


/* -- the reservation --------------------------------------------------------------------------- */
/* Under the ring's lock, rows n[i] into slots[i]: 0 (nothing written) when one of the slots is
 * odd (being written: the caller's lapping rules decide); else each slot's stamp into `was` (if not
 * NULL: what Ring.undo puts back), each slot's owner, then its stamp writing_stamp(n) (release: ring.py's
 * order, the owner before the stamp) and 1. slots NULL: `first` and the k - 1 after it; n NULL:
 * rows n0, n0 + 1, ... */
static int reserve_slots(int64_t *stamp, uint16_t *owner, const int64_t *slots, int64_t first, Py_ssize_t k,
                         const int64_t *n, int64_t n0, uint16_t writer, int64_t *was) {
    int64_t odd = 0;
    for (Py_ssize_t i = 0; i < k; i++) odd |= __atomic_load_n(&stamp[SLOT(i)], __ATOMIC_RELAXED);
    if (is_writing(odd)) return 0;
    if (was)
        for (Py_ssize_t i = 0; i < k; i++) was[i] = stamp[SLOT(i)];
    for (Py_ssize_t i = 0; i < k; i++) __atomic_store_n(&owner[SLOT(i)], writer, __ATOMIC_RELAXED);
    for (Py_ssize_t i = 0; i < k; i++)
        __atomic_store_n(&stamp[SLOT(i)], writing_stamp(n ? n[i] : n0 + (int64_t)i), __ATOMIC_RELEASE);
    return 1;
}

/* reserve(stamp, owner, first, k, n0, writer, old) -> bool: under the ring's lock, the k consecutive
 * slots from `first` for rows n0.. : False (nothing written) if one of them is odd (being
 * written: the caller's lapping rules decide); else each slot's stamp into `old` (k int64: what
 * Ring.undo puts back), each slot's owner, then its writing stamp. */
PyObject *py_reserve(PyObject *self, PyObject *args) {
    PyObject *stamp_o, *owner_o, *old_o;
    Py_ssize_t k;
    long long first, n0, writer;
    if (!PyArg_ParseTuple(args, "OOLnLLO", &stamp_o, &owner_o, &first, &k, &n0, &writer, &old_o)) return NULL;
    Py_buffer stb, ob, oldb;
    if (get_buf(stamp_o, &stb, 1, 8, "stamp") < 0) return NULL;
    if (get_buf(owner_o, &ob, 1, 2, "owner") < 0) { PyBuffer_Release(&stb); return NULL; }
    if (get_buf(old_o, &oldb, 1, 8, "old") < 0) { PyBuffer_Release(&stb); PyBuffer_Release(&ob); return NULL; }
    PyObject *result = NULL;
    Py_ssize_t capacity = stb.len / 8;
    if (ob.len / 2 != capacity || k < 0 || first < 0 || first + k > capacity || n0 < 0 || n0 > (INT64_MAX / 2 - k - 1) ||
        writer < 0 || writer > UINT16_MAX || oldb.len / 8 != k) {
        PyErr_SetString(PyExc_ValueError, "reserve: slots, rows or writer out of range");
        goto done;
    }
    int got = reserve_slots((int64_t *)stb.buf, (uint16_t *)ob.buf, NULL, first, k, NULL, n0, (uint16_t)writer,
                            (int64_t *)oldb.buf);
    result = got ? Py_True : Py_False;
    Py_INCREF(result);
done:
    PyBuffer_Release(&stb);
    PyBuffer_Release(&ob);
    PyBuffer_Release(&oldb);
    return result;
}

/* The reservation in lanes, the only one (the one-call push's, push.c, and reserve_lanes's):
 * under the ring's lock, which the caller holds, each of the k rows takes the next row number of
 * its lane (each[i], or `all` for every row when each is NULL) from the lane's next_row (its
 * cursor and base, load_cursor/load_base): its number into rows, its slot into slots, its id into
 * ids (if not NULL). -1 when a lane's next row is out of range (nothing written), 0 when one of the
 * slots is odd (being written: nothing written, the caller's lapping rules decide); else
 * reserve_slots (each slot's stamp into `was` if not NULL, owners, writing stamps with release),
 * then every lane's cursor to its next row + its rows (release: ring.py's order, stamps odd
 * before the cursor moves), and 1. at, count: scratch of one per lane. `each` may be `slots`
 * itself: each row's lane is read before its slot is written. */
int reserve_in_lanes(int64_t *cur, Py_ssize_t lanes, int64_t lc, int64_t *stamp, uint16_t *owner, const int64_t *each,
                     int64_t all, Py_ssize_t k, uint16_t writer, int64_t *rows, int64_t *slots, int64_t *ids, int64_t *was,
                     int64_t *at, int64_t *count) {
    for (Py_ssize_t l = 0; l < lanes; l++) {
        at[l] = next_row(load_cursor(cur, l), load_base(cur, l));
        if (at[l] < 0 || at[l] > INT64_MAX / 4) return -1;
        count[l] = 0;
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        int64_t l = each ? each[i] : all, row = at[l] + count[l]++;
        rows[i] = row;
        slots[i] = slot_of(l, row, lc);
        if (ids) ids[i] = row_id(row, l, lanes);
    }
    if (!reserve_slots(stamp, owner, slots, 0, k, rows, 0, writer, was)) return 0;
    for (Py_ssize_t l = 0; l < lanes; l++)
        if (count[l]) __atomic_store_n(&cur[LANE_WORDS * l + LANE_CURSOR], at[l] + count[l], __ATOMIC_RELEASE);
    return 1;
}

/* reserve_lanes(cursors, stamp, owner, lane, writer, n, slots, old) -> bool: under the ring's lock,
 * one row in each lane of `lane` (k int64 lane numbers): reserve_in_lanes, False when a slot was
 * odd (nothing written). cursors is the (lanes, LANE_WORDS) int64 _lanes column. */
PyObject *py_reserve_lanes(PyObject *self, PyObject *args) {
    PyObject *objs[7];
    long long writer;
    if (!PyArg_ParseTuple(args, "OOOOLOOO", &objs[0], &objs[1], &objs[2], &objs[3], &writer, &objs[4], &objs[5], &objs[6]))
        return NULL;
    Py_buffer b[7]; /* cursors, stamp, owner, lane, n, slots, old */
    static const char *names[7] = {"cursors", "stamp", "owner", "lane", "n", "slots", "old"};
    static const int writable[7] = {1, 1, 1, 0, 1, 1, 1}, itemsize[7] = {8, 8, 2, 8, 8, 8, 8};
    int held = 0;
    PyObject *result = NULL;
    for (; held < 7; held++)
        if (get_buf(objs[held], &b[held], writable[held], itemsize[held], names[held]) < 0) goto done;
    Py_ssize_t lanes = b[0].len / (LANE_WORDS * 8), capacity = b[1].len / 8, k = b[3].len / 8;
    if (lanes <= 0 || b[0].len % (LANE_WORDS * 8) || capacity % lanes || b[2].len / 2 != capacity || b[4].len / 8 != k ||
        b[5].len / 8 != k || b[6].len / 8 != k || writer < 0 || writer > UINT16_MAX) {
        PyErr_SetString(PyExc_ValueError, "reserve_lanes: arrays of inconsistent sizes, or a writer out of range");
        goto done;
    }
    const int64_t *lane = (const int64_t *)b[3].buf;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (lane[i] < 0 || lane[i] >= lanes) {
            PyErr_Format(PyExc_ValueError, "reserve_lanes: lane %lld is outside [0, %zd)", (long long)lane[i], lanes);
            goto done;
        }
    }
    int64_t *scratch = (int64_t *)PyMem_Malloc((size_t)lanes * 2 * sizeof(int64_t));
    if (!scratch) { PyErr_NoMemory(); goto done; }
    int got = reserve_in_lanes((int64_t *)b[0].buf, lanes, capacity / lanes, (int64_t *)b[1].buf, (uint16_t *)b[2].buf, lane,
                               0, k, (uint16_t)writer, (int64_t *)b[4].buf, (int64_t *)b[5].buf, NULL, (int64_t *)b[6].buf,
                               scratch, scratch + lanes);
    PyMem_Free(scratch);
    if (got < 0) {
        PyErr_SetString(PyExc_ValueError, "reserve_lanes: a cursor out of range");
        goto done;
    }
    result = got ? Py_True : Py_False;
    Py_INCREF(result);
done:
    for (int i = 0; i < held; i++) PyBuffer_Release(&b[i]);
    return result;
}

/* lanes_worst(lane, lanes) -> the most rows any lane gets, or -1 when a lane is outside [0, lanes) */
PyObject *py_lanes_worst(PyObject *self, PyObject *args) {
    PyObject *lane_o;
    Py_ssize_t lanes;
    if (!PyArg_ParseTuple(args, "On", &lane_o, &lanes)) return NULL;
    if (lanes <= 0) {
        PyErr_SetString(PyExc_ValueError, "lanes_worst: lanes must be positive");
        return NULL;
    }
    Py_buffer lb;
    if (get_buf(lane_o, &lb, 0, 8, "lane") < 0) return NULL;
    Py_ssize_t k = lb.len / 8, worst = 0;
    const int64_t *lane = (const int64_t *)lb.buf;
    Py_ssize_t *count = (Py_ssize_t *)PyMem_Calloc((size_t)lanes, sizeof(Py_ssize_t));
    if (!count) { PyBuffer_Release(&lb); return PyErr_NoMemory(); }
    for (Py_ssize_t i = 0; i < k; i++) {
        if (lane[i] < 0 || lane[i] >= lanes) { worst = -1; break; }
        if (++count[lane[i]] > worst) worst = count[lane[i]];
    }
    PyMem_Free(count);
    PyBuffer_Release(&lb);
    return PyLong_FromSsize_t(worst);
}
