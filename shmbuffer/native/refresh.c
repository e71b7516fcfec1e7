/* The device copy's refresh on the CPU as one call (shmbuffer/device/rows.py is the reference and
 * states the rules): the lanes' new rows found from their cursors, copied a piece at a time by the
 * reader's stamped rule straight into the copy's columns, and the copy's slot lists kept, all
 * without the GIL. The slot lists (held, dense, where, the count) change only under the copy's
 * mutex, which its samples take while they draw and gather; the copies run outside it, into slots
 * dropped from the lists first, so a sample never waits for a copy, only for a list change. */
#include "native.h"

#include <pthread.h>
#include <string.h>

/* the words of the copy's state array (rows.py's State) */
#define ST_COUNT 0    /* usable slots: the first ST_COUNT entries of dense */
#define ST_PENDING 1  /* ids in pending */
#define ST_UPDATES 2  /* Counter.UPDATES as of the last refresh, -1: copy every row again */
#define ST_DELETES 3  /* Counter.DELETES as of the last refresh */
#define ST_INSERTED 4 /* Counter.INSERTED read as the last refresh began */
#define ST_WORDS 8

/* -- the copy's mutex: a private pthread mutex in a numpy array of the copy's ----------------- */
static int get_mutex(PyObject *o, Py_buffer *view) {
    if (get_buf(o, view, 1, 0, "mutex") < 0) return -1;
    if ((size_t)view->len < sizeof(pthread_mutex_t) || ((uintptr_t)view->buf % 8)) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "mutex: expected 64 aligned bytes");
        return -1;
    }
    return 0;
}

PyObject *py_mutex_init(PyObject *self, PyObject *arg) {
    Py_buffer m;
    if (get_mutex(arg, &m) < 0) return NULL;
    int rc = pthread_mutex_init((pthread_mutex_t *)m.buf, NULL);
    PyBuffer_Release(&m);
    if (rc) return PyErr_Format(PyExc_OSError, "pthread_mutex_init: error %d", rc);
    Py_RETURN_NONE;
}

/* the mutex taken; while it is busy the GIL is released (the refresh holds it without the GIL) */
PyObject *py_mutex_lock(PyObject *self, PyObject *arg) {
    Py_buffer m;
    if (get_mutex(arg, &m) < 0) return NULL;
    pthread_mutex_t *mutex = (pthread_mutex_t *)m.buf;
    int rc = pthread_mutex_trylock(mutex);
    if (rc) {
        Py_BEGIN_ALLOW_THREADS
        rc = pthread_mutex_lock(mutex);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&m);
    if (rc) return PyErr_Format(PyExc_OSError, "pthread_mutex_lock: error %d", rc);
    Py_RETURN_NONE;
}

PyObject *py_mutex_unlock(PyObject *self, PyObject *arg) {
    Py_buffer m;
    if (get_mutex(arg, &m) < 0) return NULL;
    int rc = pthread_mutex_unlock((pthread_mutex_t *)m.buf);
    PyBuffer_Release(&m);
    if (rc) return PyErr_Format(PyExc_OSError, "pthread_mutex_unlock: error %d", rc);
    Py_RETURN_NONE;
}

/* -- the slot lists (under the mutex): each change costs the slot it changes ------------------- */
typedef struct {
    int64_t *held, *dense, *where, *state, *pending;
    int64_t capacity;
    int bad; /* a list entry out of range: the refresh stops and raises */
} Slots;

/* slot holds nothing usable: out of held, its place in dense taken by the last entry */
static void slot_drop(Slots *s, int64_t slot) {
    __atomic_store_n(&s->held[slot], 0, __ATOMIC_RELAXED);
    int64_t p = s->where[slot], last = s->state[ST_COUNT] - 1;
    if (p < 0) return;
    if (p > last || last >= s->capacity) { s->bad = 1; return; }
    int64_t mover = s->dense[last];
    if (mover < 0 || mover >= s->capacity) { s->bad = 1; return; }
    s->dense[p] = mover;
    s->where[mover] = p;
    s->where[slot] = -1;
    s->state[ST_COUNT] = last;
}

/* slot (not usable) holds the committed row of `stamp`: usable */
static void slot_hold(Slots *s, int64_t slot, int64_t stamp) {
    int64_t count = s->state[ST_COUNT];
    if (s->where[slot] >= 0 || count >= s->capacity) { s->bad = 1; return; }
    s->held[slot] = stamp;
    s->dense[count] = slot;
    s->where[slot] = count;
    s->state[ST_COUNT] = count + 1;
}

/* -- the copies ------------------------------------------------------------------------------ */
/* rows n0 .. n0 + k - 1 in slots slot0 .. slot0 + k - 1 copied into the same slots of the outs by
 * the reader's rule (first stamps with acquire, the copies, an acquire fence, second stamps) */
static void copy_piece(const Columns *c, const int64_t *stamp, int64_t slot0, int64_t k, int64_t n0, int64_t *firsts,
                       char *ok) {
    for (int64_t i = 0; i < k; i++) firsts[i] = __atomic_load_n(&stamp[slot0 + i], __ATOMIC_ACQUIRE);
    for (Py_ssize_t g = 0; g < c->n; g++) {
        size_t w = (size_t)c->width[g];
        memcpy((char *)c->dst[g].buf + (size_t)slot0 * w, (const char *)c->src[g].buf + (size_t)slot0 * w, (size_t)k * w);
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    for (int64_t i = 0; i < k; i++)
        ok[i] = intact(firsts[i], __atomic_load_n(&stamp[slot0 + i], __ATOMIC_RELAXED), committed_stamp(n0 + i));
}

typedef struct {
    pthread_mutex_t *mutex;
    Slots s;
    const Columns *c;
    const int64_t *stamp, *counters;
    int64_t lanes, lc, piece, updates;
    int64_t *firsts, *tried; /* scratch: piece words, capacity words */
    char *ok;                /* scratch: piece bytes */
    int spoiled;             /* an update() began during the copies: none of them counts */
    int64_t taken;
} Refresh;

static int updated(const Refresh *r) {
    return __atomic_load_n(&r->counters[COUNTER_UPDATES], __ATOMIC_ACQUIRE) != r->updates;
}

/* lane's rows n .. n + k - 1 (consecutive slots): dropped, copied, the intact ones held, the
 * others pending */
static void refresh_piece(Refresh *r, int64_t lane, int64_t n, int64_t k) {
    int64_t slot0 = slot_of(lane, n, r->lc);
    pthread_mutex_lock(r->mutex);
    for (int64_t i = 0; i < k; i++) slot_drop(&r->s, slot0 + i);
    pthread_mutex_unlock(r->mutex);
    copy_piece(r->c, r->stamp, slot0, k, n, r->firsts, r->ok);
    if (updated(r)) {
        r->spoiled = 1;
        return;
    }
    pthread_mutex_lock(r->mutex);
    for (int64_t i = 0; i < k && !r->s.bad; i++) {
        if (r->ok[i]) {
            slot_hold(&r->s, slot0 + i, committed_stamp(n + i));
            r->taken++;
        } else if (r->s.state[ST_PENDING] < r->s.capacity) {
            r->s.pending[r->s.state[ST_PENDING]++] = row_id(n + i, lane, r->lanes);
        } else {
            r->s.bad = 1;
        }
    }
    pthread_mutex_unlock(r->mutex);
}

/* the pending rows of earlier refreshes: those that left their lane forgotten, those now
 * committed copied one by one (dropped first), the others kept */
static void refresh_pending(Refresh *r, const int64_t *start) {
    int64_t kept = 0, ntry = 0, lanes = r->lanes, n = r->s.state[ST_PENDING];
    for (int64_t i = 0; i < n; i++) {
        int64_t id = r->s.pending[i], lane = lane_of_id(id, lanes), num = number_of_id(id, lanes);
        if (num < start[lane]) continue;
        if (__atomic_load_n(&r->stamp[slot_of(lane, num, r->lc)], __ATOMIC_ACQUIRE) == committed_stamp(num))
            r->tried[ntry++] = id;
        else
            r->s.pending[kept++] = id;
    }
    r->s.state[ST_PENDING] = kept;
    if (!ntry) return;
    pthread_mutex_lock(r->mutex);
    for (int64_t i = 0; i < ntry; i++) slot_drop(&r->s, slot_of_id(r->tried[i], lanes, r->lc));
    pthread_mutex_unlock(r->mutex);
    for (int64_t a = 0; a < ntry && !r->spoiled; a += r->piece) {
        int64_t k = ntry - a < r->piece ? ntry - a : r->piece;
        for (int64_t i = 0; i < k; i++) {
            int64_t id = r->tried[a + i], num = number_of_id(id, lanes);
            copy_piece(r->c, r->stamp, slot_of_id(id, lanes, r->lc), 1, num, r->firsts + i, r->ok + i);
        }
        if (updated(r)) {
            r->spoiled = 1;
            return;
        }
        pthread_mutex_lock(r->mutex);
        for (int64_t i = 0; i < k && !r->s.bad; i++) {
            int64_t id = r->tried[a + i];
            if (r->ok[i]) {
                slot_hold(&r->s, slot_of_id(id, lanes, r->lc), committed_stamp_of_id(id, lanes));
                r->taken++;
            } else {
                r->s.pending[r->s.state[ST_PENDING]++] = id;
            }
        }
        pthread_mutex_unlock(r->mutex);
    }
}

/* a full refresh: the held rows that left their lanes (a clear(), or lapped) dropped, no row
 * pending (every row of the lanes is copied again) */
static void refresh_full(Refresh *r, const int64_t *start) {
    pthread_mutex_lock(r->mutex);
    for (int64_t slot = 0; slot < r->s.capacity && !r->s.bad; slot++) {
        int64_t h = r->s.held[slot];
        if (h && number_of_stamp(h) < start[slot / r->lc]) slot_drop(&r->s, slot);
    }
    r->s.state[ST_PENDING] = 0;
    pthread_mutex_unlock(r->mutex);
}

static int view_of(PyObject *o, Py_buffer *v, Py_ssize_t words, const char *what) {
    if (get_buf(o, v, 1, 8, what) < 0) return -1;
    if (v->len < words * 8) {
        PyBuffer_Release(v);
        PyErr_Format(PyExc_ValueError, "refresh: %s: expected at least %zd int64", what, words);
        return -1;
    }
    return 0;
}

/* refresh(mutex, stamp, cursors, counters, sources, outs, held, dense, where, nxt, bases, pending,
 * state, piece) -> rows newly held. sources: the buffer's (capacity, w) columns; outs: the copy's,
 * the same shapes (rows land in their own slots). held, dense, where, pending: capacity int64;
 * nxt, bases: one int64 a lane; state: ST_WORDS int64. The GIL is released for the whole refresh. */
PyObject *py_refresh(PyObject *self, PyObject *args) {
    PyObject *mutex_o, *stamp_o, *cur_o, *cnt_o, *src_o, *out_o, *held_o, *dense_o, *where_o, *nxt_o, *bases_o, *pend_o,
        *state_o;
    Py_ssize_t piece;
    if (!PyArg_ParseTuple(args, "OOOOO!O!OOOOOOOn", &mutex_o, &stamp_o, &cur_o, &cnt_o, &PyTuple_Type, &src_o, &PyTuple_Type,
                          &out_o, &held_o, &dense_o, &where_o, &nxt_o, &bases_o, &pend_o, &state_o, &piece))
        return NULL;
    Py_buffer mb, stb, cub, cnb, hb, db, wb, nb, bb, pb, sb;
    Py_buffer *views[] = {&mb, &stb, &cub, &cnb, &hb, &db, &wb, &nb, &bb, &pb, &sb};
    int held_views = 0;
    Columns c;
    c.n = 0;
    PyObject *result = NULL;
    int64_t *scratch = NULL;
    char *ok = NULL;
    if (get_mutex(mutex_o, &mb) < 0) return NULL;
    held_views = 1;
    if (get_buf(stamp_o, &stb, 0, 8, "stamp") < 0) goto done;
    held_views = 2;
    Py_ssize_t capacity = stb.len / 8;
    if (get_buf(cur_o, &cub, 0, 8, "cursors") < 0) goto done;
    held_views = 3;
    Py_ssize_t lanes = lanes_of(&cub, capacity, "refresh");
    if (!lanes) goto done;
    if (get_buf(cnt_o, &cnb, 0, 8, "counters") < 0) goto done;
    held_views = 4;
    if (cnb.len < STATS_WORDS * 8) {
        PyErr_SetString(PyExc_ValueError, "refresh: counters: expected the block's _stats");
        goto done;
    }
    PyObject *objs[] = {held_o, dense_o, where_o, nxt_o, bases_o, pend_o, state_o};
    Py_ssize_t words[] = {capacity, capacity, capacity, lanes, lanes, capacity, ST_WORDS};
    const char *names[] = {"held", "dense", "where", "nxt", "bases", "pending", "state"};
    for (int i = 0; i < 7; i++) {
        if (view_of(objs[i], views[4 + i], words[i], names[i]) < 0) goto done;
        held_views = 5 + i;
    }
    int64_t *state = (int64_t *)sb.buf;
    if (piece < 1 || state[ST_COUNT] < 0 || state[ST_COUNT] > capacity || state[ST_PENDING] < 0 ||
        state[ST_PENDING] > capacity) {
        PyErr_SetString(PyExc_ValueError, "refresh: expected piece >= 1 and the state's counts within the capacity");
        goto done;
    }
    if (columns_open(&c, src_o, out_o, capacity, capacity) < 0) goto done;
    if (piece > capacity) piece = capacity;
    scratch = (int64_t *)PyMem_Malloc((size_t)(piece + capacity + 3 * lanes) * sizeof(int64_t));
    ok = (char *)PyMem_Malloc((size_t)piece);
    if (!scratch || !ok) {
        PyErr_NoMemory();
        goto done;
    }
    Refresh r = {(pthread_mutex_t *)mb.buf,
                 {(int64_t *)hb.buf, (int64_t *)db.buf, (int64_t *)wb.buf, state, (int64_t *)pb.buf, capacity, 0},
                 &c, (const int64_t *)stb.buf, (const int64_t *)cnb.buf, lanes, capacity / lanes, piece, 0,
                 scratch, scratch + piece, ok, 0, 0};
    int64_t *cur = scratch + piece + capacity, *base = cur + lanes, *start = base + lanes;
    int64_t *nxt = (int64_t *)nb.buf, *bases = (int64_t *)bb.buf;
    Py_BEGIN_ALLOW_THREADS
    /* INSERTED first: the lag is never under-counted; UPDATES before the first stamps */
    int64_t inserted = __atomic_load_n(&r.counters[COUNTER_INSERTED], __ATOMIC_ACQUIRE);
    r.updates = __atomic_load_n(&r.counters[COUNTER_UPDATES], __ATOMIC_ACQUIRE);
    int64_t deletes = __atomic_load_n(&r.counters[COUNTER_DELETES], __ATOMIC_ACQUIRE);
    int full = r.updates != state[ST_UPDATES] || deletes != state[ST_DELETES];
    for (int64_t l = 0; l < lanes; l++) {
        cur[l] = load_cursor((const int64_t *)cub.buf, l);
        base[l] = load_base((const int64_t *)cub.buf, l);
        start[l] = first_row(cur[l], base[l], r.lc);
        full |= base[l] != bases[l];
    }
    if (full) refresh_full(&r, start);
    else refresh_pending(&r, start);
    for (int64_t l = 0; l < lanes && !r.spoiled && !r.s.bad; l++) {
        int64_t n = full || nxt[l] < start[l] ? start[l] : nxt[l];
        while (n < cur[l] && !r.spoiled && !r.s.bad) {
            int64_t at = floormod(n, r.lc), k = cur[l] - n;
            if (k > r.lc - at) k = r.lc - at;
            if (k > piece) k = piece;
            refresh_piece(&r, l, n, k);
            n += k;
        }
    }
    for (int64_t l = 0; l < lanes; l++) {
        nxt[l] = cur[l];
        bases[l] = base[l];
    }
    state[ST_UPDATES] = r.spoiled ? -1 : r.updates; /* an update spanned the copies (no ABA): all again next time */
    state[ST_DELETES] = deletes;
    state[ST_INSERTED] = inserted;
    Py_END_ALLOW_THREADS
    if (r.s.bad)
        PyErr_SetString(PyExc_ValueError, "refresh: the device copy's slot lists are inconsistent (an entry out of range)");
    else
        result = PyLong_FromLongLong(r.taken);
done:
    columns_close(&c);
    PyMem_Free(scratch);
    PyMem_Free(ok);
    for (int i = 0; i < held_views; i++) PyBuffer_Release(views[i]);
    return result;
}
