/* The device copy's refresh on the CPU as one call (shmbuffer/device/rows.py is the reference and
 * states the rules): the lanes' new rows found from their cursors, copied a piece at a time by the
 * reader's stamped rule straight into the copy's columns, and the copy's slot lists kept, all
 * without the GIL. The slot lists (held, dense, where, the count) change only under the copy's
 * mutex, which a sample takes while it draws; the copies run outside it, into slots dropped from
 * the lists first, so a sample never waits for a copy, only for a list change. Each change that
 * drops counts itself (ST_DROPS) and stamps its slots with the count (dropped), by which the
 * uniform sample, whose copy runs outside the mutex too, knows whether a row it copied was being
 * copied into meanwhile (learner.c's device_sample). */
#include "native.h"

#include <string.h>
#include <time.h>

/* -- the copy's mutexes: private pthread mutexes in a numpy array of the copy's ---------------- */
int get_mutex(PyObject *o, Py_buffer *view) {
    if (get_buf(o, view, 1, 0, "mutex") < 0) return -1;
    if (view->len < 2 * MUTEX_BYTES || sizeof(pthread_mutex_t) > MUTEX_BYTES || ((uintptr_t)view->buf % 8)) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "mutex: expected 128 aligned bytes");
        return -1;
    }
    return 0;
}

pthread_mutex_t *refresh_mutex(void *mutexes) { return (pthread_mutex_t *)((char *)mutexes + MUTEX_BYTES); }

/* -- the slot lists (under the mutex): each change costs the slot it changes ------------------- */
typedef struct {
    int64_t *held, *dropped, *dense, *where, *state, *pending; /* dropped: ST_DROPS at each slot's last drop */
    int64_t capacity;
    int bad; /* a list entry out of range: the refresh stops and raises */
} Slots;

/* slot holds nothing usable: out of held, its place in dense taken by the last entry */
static void slot_drop(Slots *s, int64_t slot) {
    __atomic_store_n(&s->held[slot], 0, __ATOMIC_RELAXED);
    __atomic_store_n(&s->dropped[slot], s->state[ST_DROPS], __ATOMIC_RELAXED); /* what device_sample checks */
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
typedef struct {
    pthread_mutex_t *mutex;
    Slots s;
    const Columns *c;
    const int64_t *stamp, *counters, *log; /* log: the block's _edits, log_len entries */
    int64_t lanes, lc, piece, log_len, edits; /* edits: Counter.EDITS as the refresh began */
    int64_t *firsts, *tried, *logged; /* scratch: piece words, capacity words, log_len words */
    char *ok, *mark;                  /* scratch: piece bytes, capacity bytes (all 0 between uses) */
    int spoiled;                      /* more edits during the copies than the log holds: none counts */
    int64_t taken;
} Refresh;


/* the slot lists' mutex taken; the time it was busy (a sample drew) counted in ST_WAITED */
static void lists_lock(Refresh *r) {
    if (pthread_mutex_trylock(r->mutex) == 0) return;
    int64_t t = now_ns();
    pthread_mutex_lock(r->mutex);
    r->s.state[ST_WAITED] += now_ns() - t;
}

/* the mutex taken for drops: one more change that drops (ST_DROPS, which each drop stores) */
static void drops_begin(Refresh *r) {
    lists_lock(r);
    __atomic_store_n(&r->s.state[ST_DROPS], r->s.state[ST_DROPS] + 1, __ATOMIC_RELAXED);
}

/* the mutex let go after drops, before any copy into the slots dropped: the release fence keeps
 * ST_DROPS and the slots' `dropped` ahead of the copies' stores (a sample that read a byte copied
 * sees them: learner.c's device_sample) */
static void drops_done(Refresh *r) {
    pthread_mutex_unlock(r->mutex);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

static int64_t edits_now(const Refresh *r) { return __atomic_load_n(&r->counters[COUNTER_EDITS], __ATOMIC_ACQUIRE); }

/* the log's entries from..to (at most log_len) into r->logged; -1 when one is out of range or
 * they were overwritten as they were read (more than log_len logged since `from`) */
static int64_t read_log(Refresh *r, int64_t from, int64_t to) {
    if (to - from > r->log_len) return -1;
    for (int64_t j = from; j < to; j++) {
        int64_t s = __atomic_load_n(&r->log[floormod(j, r->log_len)], __ATOMIC_RELAXED);
        if (s < 0 || s >= r->s.capacity) return -1;
        r->logged[j - from] = s;
    }
    /* the entries' loads before the counts' (an acquire fence: the relaxed loads above stay
     * above); a writer stores EDITS_BEGUN before its entries, EDITS after them, so an entry
     * overwritten as it was read shows in EDITS_BEGUN */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    int64_t begun = __atomic_load_n(&r->counters[COUNTER_EDITS_BEGUN], __ATOMIC_RELAXED), now = edits_now(r);
    return (begun > now ? begun : now) - from > r->log_len ? -1 : to - from;
}

/* after the copies of k rows (into slot0 + i, or the slots of ids[i]): ok[i] cleared where an
 * edit logged since the refresh began names the row's slot (the row is read again once the edit
 * is done: an update puts back the stamp it found); -1 when more were logged than the log holds */
static int unless_edited(Refresh *r, int64_t slot0, const int64_t *ids, int64_t k) {
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the copies' second stamps (relaxed loads) before the count */
    int64_t now = edits_now(r);
    if (now == r->edits) return 0;
    int64_t m = read_log(r, r->edits, now);
    if (m < 0) return -1;
    for (int64_t j = 0; j < m; j++) r->mark[r->logged[j]] = 1;
    for (int64_t i = 0; i < k; i++)
        if (r->mark[ids ? slot_of_id(ids[i], r->lanes, r->lc) : slot0 + i]) r->ok[i] = 0;
    for (int64_t j = 0; j < m; j++) r->mark[r->logged[j]] = 0;
    return 0;
}

/* lane's rows n .. n + k - 1 (consecutive slots): dropped, copied, the intact ones held, the
 * others pending */
static void refresh_piece(Refresh *r, int64_t lane, int64_t n, int64_t k) {
    int64_t slot0 = slot_of(lane, n, r->lc);
    drops_begin(r);
    for (int64_t i = 0; i < k; i++) slot_drop(&r->s, slot0 + i);
    drops_done(r);
    gather_run_rows(r->c, slot0, k, n, r->stamp, slot0, r->firsts, r->ok); /* into the same slots */
    if (unless_edited(r, slot0, NULL, k) < 0) {
        r->spoiled = 1;
        return;
    }
    lists_lock(r);
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

/* the pending rows that left their lane forgotten: lapped, or above its cursor (a push undone
 * under them: the refresh that copies the lane from there copies them) */
static void pending_forget(Refresh *r, const int64_t *start, const int64_t *cur) {
    int64_t kept = 0, lanes = r->lanes, n = r->s.state[ST_PENDING];
    for (int64_t i = 0; i < n; i++) {
        int64_t id = r->s.pending[i], num = number_of_id(id, lanes), lane = lane_of_id(id, lanes);
        if (num >= start[lane] && num < cur[lane]) r->s.pending[kept++] = id;
    }
    r->s.state[ST_PENDING] = kept;
}

/* the rows changed in place since the last refresh (the log's entries from `seen`): their slots
 * dropped, and the row each holds now (committed or being written, within its lane's rows, and
 * older than nxt, from where this refresh copies the lane anyway: never pending twice) pending
 * unless it is; -1 when the entries were overwritten as they were read (a full refresh) */
static int refresh_edits(Refresh *r, int64_t seen, const int64_t *cur, const int64_t *start, const int64_t *nxt) {
    int64_t m = read_log(r, seen, r->edits), *pending = r->s.pending, lanes = r->lanes;
    if (m < 0) return -1;
    pending_forget(r, start, cur);
    drops_begin(r);
    for (int64_t j = 0; j < m; j++) slot_drop(&r->s, r->logged[j]);
    drops_done(r);
    int64_t np = r->s.state[ST_PENDING];
    for (int64_t p = 0; p < np; p++) r->mark[slot_of_id(pending[p], lanes, r->lc)] = 1;
    for (int64_t j = 0; j < m; j++) {
        int64_t s = r->logged[j], lane = s / r->lc, st = __atomic_load_n(&r->stamp[s], __ATOMIC_ACQUIRE);
        int64_t num = number_of_stamp(st), id = row_id(num, lane, lanes), known = 0;
        if (!st || num < start[lane] || num >= cur[lane] || num >= nxt[lane]) continue;
        for (int64_t p = 0; r->mark[s] && p < r->s.state[ST_PENDING] && !known; p++) known = pending[p] == id;
        if (known) continue;
        if (r->s.state[ST_PENDING] >= r->s.capacity) break; /* cannot be (ids of distinct slots): a full refresh */
        pending[r->s.state[ST_PENDING]++] = id;
        r->mark[s] = 1;
    }
    for (int64_t p = 0; p < r->s.state[ST_PENDING]; p++) r->mark[slot_of_id(pending[p], lanes, r->lc)] = 0;
    for (int64_t j = 0; j < m; j++) r->mark[r->logged[j]] = 0; /* the marks all 0 again, whatever happened */
    return r->s.state[ST_PENDING] >= r->s.capacity ? -1 : 0;
}

/* the pending rows of earlier refreshes: those that left their lane forgotten, those now
 * committed copied one by one (dropped first), the others kept */
static void refresh_pending(Refresh *r, const int64_t *start, const int64_t *cur) {
    int64_t kept = 0, ntry = 0, lanes = r->lanes, n;
    pending_forget(r, start, cur);
    n = r->s.state[ST_PENDING];
    for (int64_t i = 0; i < n; i++) {
        int64_t id = r->s.pending[i], lane = lane_of_id(id, lanes), num = number_of_id(id, lanes);
        if (__atomic_load_n(&r->stamp[slot_of(lane, num, r->lc)], __ATOMIC_ACQUIRE) == committed_stamp(num))
            r->tried[ntry++] = id;
        else
            r->s.pending[kept++] = id;
    }
    r->s.state[ST_PENDING] = kept;
    if (!ntry) return;
    drops_begin(r);
    for (int64_t i = 0; i < ntry; i++) slot_drop(&r->s, slot_of_id(r->tried[i], lanes, r->lc));
    drops_done(r);
    for (int64_t a = 0; a < ntry && !r->spoiled; a += r->piece) {
        int64_t k = ntry - a < r->piece ? ntry - a : r->piece;
        for (int64_t i = 0; i < k; i++) {
            int64_t id = r->tried[a + i], num = number_of_id(id, lanes);
            int64_t slot = slot_of_id(id, lanes, r->lc);
            gather_run_rows(r->c, slot, 1, num, r->stamp, slot, r->firsts + i, r->ok + i);
        }
        if (unless_edited(r, 0, r->tried + a, k) < 0) {
            r->spoiled = 1;
            return;
        }
        lists_lock(r);
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
    int64_t m = 0; /* the scan reads held without the mutex: only a refresh (this one) writes it */
    for (int64_t slot = 0; slot < r->s.capacity; slot++) {
        int64_t h = r->s.held[slot];
        if (h && number_of_stamp(h) < start[slot / r->lc]) r->tried[m++] = slot;
    }
    drops_begin(r);
    for (int64_t i = 0; i < m && !r->s.bad; i++) slot_drop(&r->s, r->tried[i]);
    r->s.state[ST_PENDING] = 0;
    drops_done(r);
}

/* -- the views of one copy's arrays, held while a refresh or the refresher uses them ---------- */
typedef struct {
    Py_buffer mb, stb, cub, cnb, lgb, hb, dpb, db, wb, nb, bb, pb, sb;
    int held; /* views held, in the order above */
    Columns c;
    Py_ssize_t capacity, lanes, piece, log_len;
    int publish; /* write Counter.DEVICE_ROWS/DEVICE_AT (the counters are writable) */
    int64_t *scratch;
    char *ok; /* piece bytes, then capacity bytes of marks (zeroed) */
} Views;

static void views_close(Views *v) {
    Py_buffer *all[] = {&v->mb, &v->stb, &v->cub, &v->cnb, &v->lgb, &v->hb, &v->dpb, &v->db, &v->wb, &v->nb, &v->bb, &v->pb,
                         &v->sb};
    columns_close(&v->c);
    for (int i = 0; i < v->held; i++) PyBuffer_Release(all[i]);
    v->held = 0;
    PyMem_Free(v->scratch);
    PyMem_Free(v->ok);
    v->scratch = NULL;
    v->ok = NULL;
}

/* the views of (mutex, stamp, cursors, counters, log, sources, outs, held, dropped, dense, where, nxt,
 * bases, pending, state), checked: -1 with an error set, none held */
static int views_open(Views *v, PyObject *const *o, Py_ssize_t piece, int publish) {
    Py_buffer *all[] = {&v->mb, &v->stb, &v->cub, &v->cnb, &v->lgb, &v->hb, &v->dpb, &v->db, &v->wb, &v->nb, &v->bb, &v->pb,
                         &v->sb};
    memset(v, 0, sizeof(*v));
    if (!PyTuple_Check(o[5]) || !PyTuple_Check(o[6])) {
        PyErr_SetString(PyExc_TypeError, "refresh: sources and outs must be tuples");
        return -1;
    }
    if (get_mutex(o[0], &v->mb) < 0) return -1;
    v->held = 1;
    if (get_buf(o[1], &v->stb, 0, 8, "stamp") < 0) goto fail;
    v->held = 2;
    v->capacity = v->stb.len / 8;
    if (get_buf(o[2], &v->cub, 0, 8, "cursors") < 0) goto fail;
    v->held = 3;
    v->lanes = lanes_of(&v->cub, v->capacity, "refresh");
    if (!v->lanes) goto fail;
    if (get_buf(o[3], &v->cnb, publish, 8, "counters") < 0) goto fail;
    v->held = 4;
    if (v->cnb.len < STATS_WORDS * 8) {
        PyErr_SetString(PyExc_ValueError, "refresh: counters: expected the block's _stats");
        goto fail;
    }
    if (get_buf(o[4], &v->lgb, 0, 8, "log") < 0) goto fail;
    v->held = 5;
    v->log_len = v->lgb.len / 8;
    if (v->log_len < 1) {
        PyErr_SetString(PyExc_ValueError, "refresh: log: expected the block's _edits");
        goto fail;
    }
    Py_ssize_t words[] = {v->capacity, v->capacity, v->capacity, v->capacity, v->lanes, v->lanes, v->capacity, ST_WORDS};
    const char *names[] = {"held", "dropped", "dense", "where", "nxt", "bases", "pending", "state"};
    for (int i = 0; i < 8; i++) {
        if (get_buf(o[7 + i], all[5 + i], 1, 8, names[i]) < 0) goto fail;
        v->held = 6 + i;
        if (all[5 + i]->len < words[i] * 8) {
            PyErr_Format(PyExc_ValueError, "refresh: %s: expected at least %zd int64", names[i], words[i]);
            goto fail;
        }
    }
    int64_t *state = (int64_t *)v->sb.buf;
    if (piece < 1 || state[ST_COUNT] < 0 || state[ST_COUNT] > v->capacity || state[ST_PENDING] < 0 ||
        state[ST_PENDING] > v->capacity) {
        PyErr_SetString(PyExc_ValueError, "refresh: expected piece >= 1 and the state's counts within the capacity");
        goto fail;
    }
    if (columns_open(&v->c, o[5], o[6], v->capacity, v->capacity) < 0) goto fail;
    v->piece = piece > v->capacity ? v->capacity : piece;
    v->publish = publish;
    v->scratch = (int64_t *)PyMem_Malloc((size_t)(v->piece + v->capacity + v->log_len + 3 * v->lanes) * sizeof(int64_t));
    v->ok = (char *)PyMem_Calloc((size_t)(v->piece + v->capacity), 1);
    if (!v->scratch || !v->ok) {
        PyErr_NoMemory();
        goto fail;
    }
    return 0;
fail:
    views_close(v);
    return -1;
}

static int64_t clock_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int64_t now_ns(void) { return clock_ns(CLOCK_MONOTONIC); }

/* one refresh (rows.py's steps); the caller holds the refresh mutex, not the GIL. Returns the
 * rows taken in, -1 when the slot lists were found inconsistent. */
static int64_t refresh_run(Views *v) {
    int64_t *state = (int64_t *)v->sb.buf, lanes = v->lanes;
    Refresh r = {(pthread_mutex_t *)v->mb.buf,
                 {(int64_t *)v->hb.buf, (int64_t *)v->dpb.buf, (int64_t *)v->db.buf, (int64_t *)v->wb.buf, state, (int64_t *)v->pb.buf, v->capacity, 0},
                 &v->c, (const int64_t *)v->stb.buf, (const int64_t *)v->cnb.buf, (const int64_t *)v->lgb.buf, lanes,
                 v->capacity / lanes, v->piece, v->log_len, 0,
                 v->scratch, v->scratch + v->piece, v->scratch + v->piece + v->capacity, v->ok, v->ok + v->piece, 0, 0};
    int64_t *cur = v->scratch + v->piece + v->capacity + v->log_len, *base = cur + lanes, *start = base + lanes;
    int64_t *nxt = (int64_t *)v->nb.buf, *bases = (int64_t *)v->bb.buf;
    int64_t at = now_ns(), cpu = clock_ns(CLOCK_THREAD_CPUTIME_ID);
    /* INSERTED first: the lag is never under-counted; EDITS before the stamps: an edit logged
     * later is seen after the copies (unless_edited) */
    int64_t inserted = __atomic_load_n(&r.counters[COUNTER_INSERTED], __ATOMIC_ACQUIRE);
    int64_t updates = __atomic_load_n(&r.counters[COUNTER_UPDATES], __ATOMIC_ACQUIRE);
    int64_t deletes = __atomic_load_n(&r.counters[COUNTER_DELETES], __ATOMIC_ACQUIRE);
    int64_t seen = state[ST_EDITS];
    r.edits = edits_now(&r);
    int full = seen < 0 || r.edits - seen > r.log_len;
    for (int64_t l = 0; l < lanes; l++) {
        cur[l] = load_cursor((const int64_t *)v->cub.buf, l);
        base[l] = load_base((const int64_t *)v->cub.buf, l);
        start[l] = first_row(cur[l], base[l], r.lc);
        full |= base[l] != bases[l];
    }
    if (!full && r.edits != seen) full = refresh_edits(&r, seen, cur, start, nxt) < 0;
    if (full) refresh_full(&r, start);
    else refresh_pending(&r, start, cur);
    for (int64_t l = 0; l < lanes && !r.spoiled && !r.s.bad; l++) {
        int64_t n = full || nxt[l] < start[l] ? start[l] : nxt[l];
        while (n < cur[l] && !r.spoiled && !r.s.bad) {
            int64_t k = cur[l] - n, room = r.lc - floormod(n, r.lc);
            if (k > room) k = room;
            if (k > r.piece) k = r.piece;
            refresh_piece(&r, l, n, k);
            n += k;
        }
    }
    for (int64_t l = 0; l < lanes; l++) {
        nxt[l] = cur[l];
        bases[l] = base[l];
    }
    state[ST_EDITS] = r.spoiled ? -1 : r.edits; /* the edits logged during the copies: next time */
    state[ST_UPDATES] = updates;
    state[ST_DELETES] = deletes;
    state[ST_INSERTED] = inserted;
    state[ST_AT] = at;
    state[ST_DONE] += 1;
    state[ST_SPENT] += now_ns() - at;
    state[ST_TAKEN] += r.taken;
    state[ST_CPU] += clock_ns(CLOCK_THREAD_CPUTIME_ID) - cpu;
    if (v->publish) { /* where top reads the lag */
        int64_t *counters = (int64_t *)v->cnb.buf;
        __atomic_store_n(&counters[COUNTER_DEVICE_ROWS], inserted, __ATOMIC_RELAXED);
        __atomic_store_n(&counters[COUNTER_DEVICE_AT], at, __ATOMIC_RELAXED);
    }
    return r.s.bad ? -1 : r.taken;
}

/* refresh(mutex, stamp, cursors, counters, log, sources, outs, held, dropped, dense, where, nxt, bases,
 * pending, state, piece, publish, seen) -> rows taken in, or -1 without a refresh when seen >= 0 and another
 * refresh was done since the caller read state[ST_DONE] == seen (it waited for that one). sources:
 * the buffer's (capacity, w) columns; outs: the copy's, the same shapes (rows land in their own
 * slots). held, dropped, dense, where, pending: capacity int64; nxt, bases: one int64 a lane; state:
 * ST_WORDS int64. The GIL is released for the whole call. */
PyObject *py_refresh(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 18) {
        PyErr_SetString(PyExc_TypeError, "refresh: expected 18 arguments");
        return NULL;
    }
    Py_ssize_t piece = PyLong_AsSsize_t(args[15]);
    int publish = PyObject_IsTrue(args[16]);
    long long seen = PyLong_AsLongLong(args[17]);
    if (PyErr_Occurred() || publish < 0) return NULL;
    Views v;
    if (views_open(&v, args, piece, publish) < 0) return NULL;
    int64_t taken = -1, *state = (int64_t *)v.sb.buf;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(refresh_mutex(v.mb.buf));
    if (seen < 0 || state[ST_DONE] == seen) taken = refresh_run(&v);
    else taken = -2;
    pthread_mutex_unlock(refresh_mutex(v.mb.buf));
    Py_END_ALLOW_THREADS
    views_close(&v);
    if (taken == -1)
        return PyErr_Format(PyExc_ValueError, "refresh: the device copy's slot lists are inconsistent (an entry out of range)");
    return PyLong_FromLongLong(taken == -2 ? -1 : taken);
}

/* -- the background refresher: a thread that never takes the GIL ------------------------------ */
#define REFRESHER_CAPSULE "shmbuffer.refresher"

typedef struct {
    Views v;
    pthread_t thread;
    pthread_mutex_t wake_mutex;
    pthread_cond_t wake;
    int started, stop;
    int64_t pace_ns, rows_bound, ns_bound; /* bounds already halved (REFRESH_AT); -1: none */
} Refresher;

int copy_behind(const int64_t *cur, Py_ssize_t lanes, const int64_t *counters, const int64_t *state,
                       const int64_t *bases, int64_t rows_bound, int64_t ns_bound, int idle) {
    for (Py_ssize_t l = 0; l < lanes; l++)
        if (load_base(cur, l) != bases[l]) return 1;
    int64_t rows = __atomic_load_n(&counters[COUNTER_INSERTED], __ATOMIC_ACQUIRE) - state[ST_INSERTED];
    int edited = __atomic_load_n(&counters[COUNTER_UPDATES], __ATOMIC_ACQUIRE) != state[ST_UPDATES] ||
                 __atomic_load_n(&counters[COUNTER_DELETES], __ATOMIC_ACQUIRE) != state[ST_DELETES];
    if (rows_bound >= 0 && (rows > rows_bound || edited)) return 1;
    int changed = rows > 0 || edited;
    if (changed && ns_bound >= 0 && now_ns() - state[ST_AT] > ns_bound) return 1;
    return changed && idle && rows_bound < 0 && ns_bound < 0;
}

static int refresher_behind(const Refresher *t) {
    const Views *v = &t->v;
    return copy_behind((const int64_t *)v->cub.buf, v->lanes, (const int64_t *)v->cnb.buf, (const int64_t *)v->sb.buf,
                       (const int64_t *)v->bb.buf, t->rows_bound, t->ns_bound, 1);
}

static void *refresher_loop(void *arg) {
    Refresher *t = (Refresher *)arg;
    int64_t *state = (int64_t *)t->v.sb.buf;
    pthread_mutex_lock(&t->wake_mutex);
    while (!t->stop) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += t->pace_ns;
        until.tv_sec += until.tv_nsec / 1000000000;
        until.tv_nsec %= 1000000000;
        pthread_cond_timedwait(&t->wake, &t->wake_mutex, &until);
        if (t->stop) break;
        pthread_mutex_unlock(&t->wake_mutex);
        int failed = 0;
        if (refresher_behind(t)) {
            pthread_mutex_lock(refresh_mutex(t->v.mb.buf));
            if (refresher_behind(t)) failed = refresh_run(&t->v) < 0;
            pthread_mutex_unlock(refresh_mutex(t->v.mb.buf));
        }
        pthread_mutex_lock(&t->wake_mutex);
        if (failed) {
            state[ST_ERROR] = 1;
            break;
        }
    }
    pthread_mutex_unlock(&t->wake_mutex);
    return NULL;
}

/* the thread stopped and joined (the GIL released meanwhile if held), the views released */
static void refresher_end(Refresher *t, int gil) {
    if (t->started) {
        pthread_mutex_lock(&t->wake_mutex);
        t->stop = 1;
        pthread_cond_signal(&t->wake);
        pthread_mutex_unlock(&t->wake_mutex);
        if (gil) {
            Py_BEGIN_ALLOW_THREADS
            pthread_join(t->thread, NULL);
            Py_END_ALLOW_THREADS
        } else {
            pthread_join(t->thread, NULL);
        }
        t->started = 0;
        pthread_cond_destroy(&t->wake);
        pthread_mutex_destroy(&t->wake_mutex);
    }
    views_close(&t->v);
}

static void refresher_free(PyObject *capsule) {
    Refresher *t = (Refresher *)PyCapsule_GetPointer(capsule, REFRESHER_CAPSULE);
    if (!t) {
        PyErr_Clear();
        return;
    }
    refresher_end(t, 1);
    PyMem_Free(t);
}

/* refresher_start(mutex, stamp, cursors, counters, log, sources, outs, held, dropped, dense, where, nxt,
 * bases, pending, state, piece, publish, pace_s, rows_bound, seconds_bound) -> a capsule: a thread that
 * looks at the lag every pace_s and refreshes (refresh_run) once it passes a bound (already the
 * share the caller wants; < 0: none), without the GIL ever. refresher_stop(capsule) ends it. */
PyObject *py_refresher_start(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 20) {
        PyErr_SetString(PyExc_TypeError, "refresher_start: expected 20 arguments");
        return NULL;
    }
    Py_ssize_t piece = PyLong_AsSsize_t(args[15]);
    int publish = PyObject_IsTrue(args[16]);
    double pace = PyFloat_AsDouble(args[17]), rows = PyFloat_AsDouble(args[18]), secs = PyFloat_AsDouble(args[19]);
    if (PyErr_Occurred() || publish < 0) return NULL;
    if (!(pace > 0 && pace < 1)) {
        PyErr_SetString(PyExc_ValueError, "refresher_start: expected 0 < pace_s < 1");
        return NULL;
    }
    Refresher *t = (Refresher *)PyMem_Calloc(1, sizeof(Refresher));
    if (!t) return PyErr_NoMemory();
    if (views_open(&t->v, args, piece, publish) < 0) {
        PyMem_Free(t);
        return NULL;
    }
    t->pace_ns = (int64_t)(pace * 1e9);
    t->rows_bound = rows < 0 ? -1 : (int64_t)rows;
    t->ns_bound = secs < 0 ? -1 : (int64_t)(secs * 1e9);
    PyObject *capsule = PyCapsule_New(t, REFRESHER_CAPSULE, refresher_free);
    if (!capsule) {
        views_close(&t->v);
        PyMem_Free(t);
        return NULL;
    }
    pthread_mutex_init(&t->wake_mutex, NULL);
    pthread_cond_init(&t->wake, NULL);
    int rc = pthread_create(&t->thread, NULL, refresher_loop, t);
    if (rc) {
        pthread_cond_destroy(&t->wake);
        pthread_mutex_destroy(&t->wake_mutex);
        Py_DECREF(capsule);
        return PyErr_Format(PyExc_OSError, "refresher_start: pthread_create: error %d", rc);
    }
    t->started = 1;
    return capsule;
}

PyObject *py_refresher_stop(PyObject *self, PyObject *capsule) {
    Refresher *t = (Refresher *)PyCapsule_GetPointer(capsule, REFRESHER_CAPSULE);
    if (!t) return NULL;
    refresher_end(t, 1);
    Py_RETURN_NONE;
}

/* whether the thread runs (it ends by itself on an error: state[ST_ERROR]) */
PyObject *py_refresher_running(PyObject *self, PyObject *capsule) {
    Refresher *t = (Refresher *)PyCapsule_GetPointer(capsule, REFRESHER_CAPSULE);
    if (!t) return NULL;
    return PyBool_FromLong(t->started && !((int64_t *)t->v.sb.buf)[ST_ERROR]);
}
