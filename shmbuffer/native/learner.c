/* A device copy on the CPU, on the learner's thread (shmbuffer/device/rows.py and replay.py are
 * the reference): the copy's mutexes as Python's NativeLock takes them, the lag question
 * (behind) and the uniform sample (device_sample: the draw under the slot lists' mutex, the copy
 * outside it, checked by the count of drops that refresh.c's drops keep). */
#include "native.h"

#include <string.h>

/* -- the copy's mutexes, for device/rows.py's NativeLock ------------------------------------- */
PyObject *py_mutex_init(PyObject *self, PyObject *arg) {
    Py_buffer m;
    if (get_mutex(arg, &m) < 0) return NULL;
    int rc = pthread_mutex_init((pthread_mutex_t *)m.buf, NULL);
    if (!rc) rc = pthread_mutex_init(refresh_mutex(m.buf), NULL);
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

/* -- the copy's questions and samples on the learner's thread --------------------------------- */
/* views of n arrays of int64 words (views[i] of objs[i], writable[i]): 0, or -1 with an error
 * set and none held */
static int words_open(PyObject *const *objs, Py_buffer *const *views, const int *writable, const char *const *names,
                      int n) {
    for (int i = 0; i < n; i++) {
        if (get_buf(objs[i], views[i], writable[i], 8, names[i]) < 0) {
            while (i--) PyBuffer_Release(views[i]);
            return -1;
        }
    }
    return 0;
}

/* behind(cursors, counters, state, bases, rows_bound, ns_bound, idle) -> bool: copy_behind, the
 * bounds already the share the caller asks about (< 0: none) */
PyObject *py_behind(PyObject *self, PyObject *args) {
    PyObject *cur_o, *cnt_o, *st_o, *bases_o;
    long long rows_bound, ns_bound;
    int idle;
    if (!PyArg_ParseTuple(args, "OOOOLLp", &cur_o, &cnt_o, &st_o, &bases_o, &rows_bound, &ns_bound, &idle)) return NULL;
    Py_buffer cub, cnb, sb, bb;
    Py_buffer *held[] = {&cub, &cnb, &sb, &bb};
    PyObject *objs[] = {cur_o, cnt_o, st_o, bases_o};
    static const char *const names[] = {"cursors", "counters", "state", "bases"};
    static const int writable[] = {0, 0, 0, 0};
    int n = 4, behind = -1;
    if (words_open(objs, held, writable, names, n) < 0) return NULL;
    Py_ssize_t lanes = bb.len / 8;
    if (cub.len != lanes * LANE_WORDS * 8 || cnb.len < STATS_WORDS * 8 || sb.len < ST_WORDS * 8) {
        PyErr_SetString(PyExc_ValueError, "behind: expected the ring's cursors, the block's counters, the copy's state and bases");
        goto done;
    }
    behind = copy_behind((const int64_t *)cub.buf, lanes, (const int64_t *)cnb.buf, (const int64_t *)sb.buf,
                         (const int64_t *)bb.buf, rows_bound, ns_bound, idle);
done:
    for (int i = 0; i < n; i++) PyBuffer_Release(held[i]);
    return behind < 0 ? NULL : PyBool_FromLong(behind);
}

/* m rows drawn uniformly over the first `count` usable slots of dense (the place is the slot when
 * every slot is usable): slots[j] and the ids of their rows, each step asking for the next one's
 * lines first so the misses overlap; under the slot lists' mutex. Returns 1 when the lists are
 * inconsistent (a bug). */
static int draw_usable(uint64_t *rng, const int64_t *held, const int64_t *dense, int64_t count, int64_t capacity,
                       Py_ssize_t lanes, Py_ssize_t m, int64_t *slots, int64_t *ids) {
    int64_t lc = capacity / (int64_t)lanes;
    for (Py_ssize_t j = 0; j < m; j++) {
        slots[j] = next_below(rng, count);
        if (count < capacity) __builtin_prefetch(&dense[slots[j]]);
    }
    for (Py_ssize_t j = 0; j < m && count < capacity; j++) {
        slots[j] = dense[slots[j]];
        if (slots[j] < 0 || slots[j] >= capacity) return 1;
    }
    for (Py_ssize_t j = 0; j < m; j++) __builtin_prefetch(&held[slots[j]]);
    for (Py_ssize_t j = 0; j < m; j++) {
        int64_t sl = slots[j];
        if (!is_committed(held[sl])) return 1;
        ids[j] = row_id(number_of_stamp(held[sl]), sl / lc, lanes);
    }
    return 0;
}

/* the slot lists' mutex taken by a sample; while it is busy the GIL is let go if held (a Python
 * thread may hold the mutex and wait for the GIL: device/rows.py's NativeLock) */
static void sample_lock(pthread_mutex_t *mutex, int gil) {
    if (!pthread_mutex_trylock(mutex)) return;
    if (!gil) {
        pthread_mutex_lock(mutex);
        return;
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(mutex);
    Py_END_ALLOW_THREADS
}

/* of the m rows copied from slots[j], those a refresh may have copied into meanwhile (a change
 * that dropped slots came after the draw, whose count of them was `drops`, and dropped this
 * one) into torn (their places in the outs: at[j]); returns how many. The acquire fence keeps the
 * copies' loads ahead of the counts' (refresh.c's drops_done has the release fence). */
static Py_ssize_t copied_into(const int64_t *state, const int64_t *dropped, int64_t drops, const int64_t *slots,
                              const int64_t *at, Py_ssize_t m, int64_t *torn) {
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(&state[ST_DROPS], __ATOMIC_RELAXED) == drops) return 0;
    Py_ssize_t k = 0;
    for (Py_ssize_t j = 0; j < m; j++)
        if (__atomic_load_n(&dropped[slots[j]], __ATOMIC_RELAXED) > drops) torn[k++] = at ? at[j] : j;
    return k;
}

#define SAMPLE_ROUNDS 8 /* draws again of rows a refresh copied into as they were copied, then one under the mutex */

/* device_sample(mutex, held, dropped, dense, state, rng, sources, outs, ids, lanes) -> rows drawn:
 * len(ids) slots drawn uniformly over the copy's usable ones (the first state[ST_COUNT] of dense)
 * by the generator `rng` (4 uint64, xoshiro256**), their rows copied from the copy's columns
 * (sources, (capacity, w) each) into the outs ((len(ids), w)), their ids (from held) into ids; 0
 * when no slot is usable. The draw holds the slot lists' mutex (waited for without the GIL); the
 * copy runs outside it, as a refresh's do: a refresh drops a slot before it copies into it, and
 * each change that drops counts itself (state[ST_DROPS]) and stores the count in its slots'
 * `dropped`. A row was whole if no change that dropped came after the draw, or none dropped its
 * slot (copied_into); the others are drawn again, after SAMPLE_ROUNDS rounds under the mutex. */
PyObject *py_device_sample(PyObject *self, PyObject *args) {
    PyObject *m_o, *held_o, *dropped_o, *dense_o, *st_o, *rng_o, *src_o, *out_o, *ids_o;
    Py_ssize_t lanes;
    if (!PyArg_ParseTuple(args, "OOOOOOO!O!On", &m_o, &held_o, &dropped_o, &dense_o, &st_o, &rng_o, &PyTuple_Type,
                          &src_o, &PyTuple_Type, &out_o, &ids_o, &lanes))
        return NULL;
    Py_buffer mb, hb, dpb, db, sb, rb, ib;
    Py_buffer *views[] = {&mb, &hb, &dpb, &db, &sb, &rb, &ib};
    PyObject *objs[] = {held_o, dropped_o, dense_o, st_o, rng_o, ids_o};
    static const char *const names[] = {"held", "dropped", "dense", "state", "rng", "ids"};
    static const int writable[] = {0, 0, 0, 1, 1, 1};
    Columns c;
    c.n = 0;
    int nv = 0, bad = 0;
    int64_t *scratch = NULL;
    PyObject *result = NULL;
    if (get_mutex(m_o, &mb) < 0) return NULL;
    if (words_open(objs, views + 1, writable, names, 6) < 0) {
        PyBuffer_Release(&mb);
        return NULL;
    }
    nv = 7;
    Py_ssize_t capacity = hb.len / 8, n = ib.len / 8;
    if (capacity < 1 || lanes < 1 || capacity % lanes || dpb.len != hb.len || db.len != hb.len ||
        sb.len < ST_WORDS * 8 || rb.len != 32 || n < 1) {
        PyErr_SetString(PyExc_ValueError, "device_sample: expected held, dropped and dense of the capacity (lanes "
                                          "dividing it), the state, 4 uint64 of rng and at least one id");
        goto done;
    }
    if (columns_open(&c, src_o, out_o, capacity, n) < 0) goto done;
    /* scratch: the slots; the rows drawn again: their places in the outs, slots, ids */
    scratch = (int64_t *)PyMem_Malloc((size_t)n * 4 * sizeof(int64_t));
    if (!scratch) { PyErr_NoMemory(); goto done; }
    int64_t *slots = scratch, *at = slots + n, *rslots = at + n, *rids = rslots + n;
    pthread_mutex_t *mutex = (pthread_mutex_t *)mb.buf;
    const int64_t *held = (const int64_t *)hb.buf, *dropped = (const int64_t *)dpb.buf, *dense = (const int64_t *)db.buf;
    int64_t *state = (int64_t *)sb.buf, *ids = (int64_t *)ib.buf, count = 0, drops = 0;
    uint64_t *rng = (uint64_t *)rb.buf;
    if (!(rng[0] | rng[1] | rng[2] | rng[3])) rng[0] = 1; /* the one state xoshiro cannot leave */
    sample_lock(mutex, 1);
    count = state[ST_COUNT];
    drops = state[ST_DROPS];
    bad = count < 0 || count > capacity;
    if (count > 0 && !bad) bad = draw_usable(rng, held, dense, count, capacity, lanes, n, slots, ids);
    pthread_mutex_unlock(mutex);
    if (count > 0 && !bad) {
        PyThreadState *ts = c.total >= NOGIL_BYTES ? PyEval_SaveThread() : NULL;
        copy_slots(&c, slots, n);
        Py_ssize_t m = copied_into(state, dropped, drops, slots, NULL, n, at);
        for (int round = 0; m > 0 && count > 0 && !bad; round++) {
            int last = round == SAMPLE_ROUNDS;
            sample_lock(mutex, ts == NULL);
            state[ST_REDRAWN] += m;
            count = state[ST_COUNT];
            drops = state[ST_DROPS];
            bad = count < 0 || count > capacity;
            if (count > 0 && !bad) bad = draw_usable(rng, held, dense, count, capacity, lanes, m, rslots, rids);
            if (!last) pthread_mutex_unlock(mutex);
            for (Py_ssize_t j = 0; j < m && count > 0 && !bad; j++) {
                for (Py_ssize_t g = 0; g < c.n; g++) {
                    size_t w = (size_t)c.width[g];
                    memcpy((char *)c.dst[g].buf + (size_t)at[j] * w, (const char *)c.src[g].buf + (size_t)rslots[j] * w, w);
                }
                ids[at[j]] = rids[j];
            }
            if (last) {
                pthread_mutex_unlock(mutex);
                break;
            }
            m = count > 0 && !bad ? copied_into(state, dropped, drops, rslots, at, m, at) : 0;
        }
        if (ts) PyEval_RestoreThread(ts);
    }
    if (bad)
        PyErr_SetString(PyExc_ValueError, "device_sample: the device copy's slot lists are inconsistent (a bug: please report it)");
    else
        result = PyLong_FromSsize_t(count > 0 ? n : 0);
done:
    columns_close(&c);
    PyMem_Free(scratch);
    for (int i = 0; i < nv; i++) PyBuffer_Release(views[i]);
    return result;
}
