/* The one-call push: ReplayBuffer.push's usual case as one C call, from the call's arguments to
 * the committed rows.
 *
 * The fast checks (push_check), the lanes, the reservation under the tried lock (lock.py's robust
 * mutex; its word at LOCK_REPAIR names a repair still owed), the copies (casting float64 to
 * float32 and Python numbers where Schema.validate would, with the same bytes), the commit. No
 * Python code runs from the rows turning odd to their commit, so no signal handler can come
 * between. None, with nothing changed, wherever Python must decide or explain: anything the fast
 * checks do not take (validate raises or casts), a lane out of range or a lane too full, a missing
 * or unwanted episode, a push whose episode ids could show a vector env pushed into one lane
 * (edits.note_interleaving), this process not registered as a writer, the lock busy, a repair
 * owed, frozen, a slot odd. */
#include "native.h"

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#define SMALL_WORDS 192 /* int64 words of the stack buffers a push of a few rows uses instead of the heap */

pid_t push_pid;
static void after_fork(void) { push_pid = getpid(); }

/* at import: this process's pid, renewed in every forked child; -1 with an error */
int push_init(void) {
    push_pid = getpid();
    if (pthread_atfork(NULL, NULL, after_fork)) {
        PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
        return -1;
    }
    return 0;
}

/* -- the fields' values ------------------------------------------------------------------------ */
/* one field's value as rows, checked against the plan without touching anything */
typedef struct {
    Py_buffer view;
    int held, convert; /* convert: 0 none, 1 float64 -> float32, 2 float32 -> float64 */
    int reshaped;      /* cpprb's rule took it (a scalar or (k,) for a (1,) field): not as validate returns it */
    union { double d; float f; int64_t q; uint64_t u; char c[8]; } scalar;
} Source;

/* a Python number into a scalar field of format f (one char): 1 ok, 0 not taken here
 * (Schema.validate casts it or explains) */
static int scalar_of(PyObject *v, const char *f, Source *s) {
    if (f[0] == 0 || f[1] != 0) return 0;
    char c = f[0];
    if (PyFloat_CheckExact(v)) {
        double d = PyFloat_AS_DOUBLE(v);
        if (c == 'd') { s->scalar.d = d; return 1; }
        if (c == 'f') {
            if (isfinite(d) && fabs(d) > (double)FLT_MAX) return 0; /* would become inf: validate refuses */
            s->scalar.f = (float)d;
            return 1;
        }
        return 0;
    }
    int overflow = 0;
    long long x;
    if (PyBool_Check(v)) {
        x = v == Py_True;
    } else if (PyLong_CheckExact(v)) {
        x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow || (x == -1 && PyErr_Occurred())) { PyErr_Clear(); return 0; }
    } else {
        return 0;
    }
    switch (c) {
    case 'd': s->scalar.d = (double)x; return 1;
    case 'f': s->scalar.f = (float)x; return 1;
    case '?': if (x != 0 && x != 1) return 0; s->scalar.c[0] = (char)x; return 1;
    case 'b': if (x < INT8_MIN || x > INT8_MAX) return 0; { int8_t y = (int8_t)x; memcpy(s->scalar.c, &y, 1); } return 1;
    case 'B': if (x < 0 || x > UINT8_MAX) return 0; { uint8_t y = (uint8_t)x; memcpy(s->scalar.c, &y, 1); } return 1;
    case 'h': if (x < INT16_MIN || x > INT16_MAX) return 0; { int16_t y = (int16_t)x; memcpy(s->scalar.c, &y, 2); } return 1;
    case 'H': if (x < 0 || x > UINT16_MAX) return 0; { uint16_t y = (uint16_t)x; memcpy(s->scalar.c, &y, 2); } return 1;
    case 'i': if (x < INT32_MIN || x > INT32_MAX) return 0; { int32_t y = (int32_t)x; memcpy(s->scalar.c, &y, 4); } return 1;
    case 'I': if (x < 0 || x > UINT32_MAX) return 0; { uint32_t y = (uint32_t)x; memcpy(s->scalar.c, &y, 4); } return 1;
    case 'l': case 'q': if (sizeof(long) != 8 && c == 'l') return 0; s->scalar.q = (int64_t)x; return 1;
    case 'L': case 'Q': if (x < 0 || (sizeof(long) != 8 && c == 'L')) return 0; s->scalar.u = (uint64_t)x; return 1;
    default: return 0;
    }
}

/* field g's value: 1 with s filled (*single: one row without a leading dimension, *k rows),
 * 0 not taken here, -1 an error raised */
static int source_open(const PushPlan *p, Py_ssize_t g, PyObject *v, Source *s, int *single, Py_ssize_t *k) {
    s->held = s->convert = s->reshaped = 0;
    Py_ssize_t m = p->ndim[g];
    int cpprb = m == 1 && p->shape[g][0] == 1; /* cpprb's default shape (1,): a scalar is one row, (k,) k rows */
    if (PyBytes_Check(v)) return 0; /* numpy makes it one string, which validate refuses */
    if (!PyObject_CheckBuffer(v)) {
        if ((m != 0 && !cpprb) || !scalar_of(v, p->format[g], s)) return 0;
        *single = 1;
        *k = 1;
        return 1;
    }
    if (PyObject_GetBuffer(v, &s->view, PyBUF_RECORDS_RO) < 0) {
        PyErr_Clear();
        return 0;
    }
    s->held = 1;
    Py_buffer *b = &s->view;
    const char *f = b->format ? b->format : "B", *want = p->format[g];
    if (!same_format(f, want)) {
        if (same_format(f, "d") && strcmp(want, "f") == 0) s->convert = 1;
        else if (same_format(f, "f") && strcmp(want, "d") == 0) s->convert = 2;
        else return 0;
    }
    if (!PyBuffer_IsContiguous(b, 'C')) return 0;
    Py_ssize_t lead;
    if (cpprb && b->ndim <= 1) {
        s->reshaped = b->ndim == 0 || b->shape[0] != 1;
        *single = b->ndim == 0 || b->shape[0] == 1;
        *k = b->ndim == 0 ? 1 : b->shape[0];
    } else if (b->ndim == m || b->ndim == m + 1) {
        lead = b->ndim - m;
        for (Py_ssize_t j = 0; j < m; j++)
            if (b->shape[lead + j] != p->shape[g][j]) return 0;
        *single = lead == 0;
        *k = lead ? b->shape[0] : 1;
    } else {
        return 0;
    }
    Py_ssize_t item = s->convert == 1 ? 8 : s->convert == 2 ? 4 : 0;
    Py_ssize_t bytes = item ? b->len / item * (s->convert == 1 ? 4 : 8) : b->len;
    if (*k < 1 || bytes != *k * p->width[g]) return 0;
    if (s->convert == 1) { /* finite values too large for float32 would become inf: validate refuses them */
        const char *d = (const char *)b->buf; /* maybe unaligned: memcpy each value */
        for (Py_ssize_t i = 0, e = b->len / 8; i < e; i++) {
            double x;
            memcpy(&x, d + 8 * i, 8);
            if (isfinite(x) && fabs(x) > (double)FLT_MAX) return 0;
        }
    }
    return 1;
}

static void sources_close(Source *s, Py_ssize_t n) {
    for (Py_ssize_t g = 0; g < n; g++)
        if (s[g].held) PyBuffer_Release(&s[g].view);
}

/* the field values (vals[g] for field g, all given) as sources: k >= 1, or 0 when not taken
 * here, -1 on an error */
static Py_ssize_t sources_open(const PushPlan *p, PyObject *const *vals, Source *src, Py_ssize_t *opened, int *single) {
    *opened = 0;
    Py_ssize_t k = -1;
    *single = -1;
    for (Py_ssize_t g = 0; g < p->n; g++) {
        int row_single = 0;
        Py_ssize_t kk = 0;
        int got = source_open(p, g, vals[g], &src[g], &row_single, &kk);
        *opened = g + 1;
        if (got <= 0) return got;
        if (k < 0) {
            k = kk;
            *single = row_single;
        } else if (k != kk || *single != row_single) {
            return 0; /* ragged: validate names the fields */
        }
    }
    return k;
}

/* vals from `data`, a dict of exactly the plan's names: 1, 0 when it is not, -1 on an error */
static int values_of(const PushPlan *p, PyObject *data, PyObject **vals) {
    if (!PyDict_CheckExact(data) || PyDict_GET_SIZE(data) != p->n) return 0;
    for (Py_ssize_t g = 0; g < p->n; g++) {
        vals[g] = PyDict_GetItemWithError(data, p->names[g]);
        if (!vals[g]) return PyErr_Occurred() ? -1 : 0;
    }
    return 1;
}


/* check(plan, data) -> (k, single) or None: the push's checks of the fields without any cast, for
 * the steps in edits.py (a prioritized push, a rate-limited one) */
PyObject *py_check(PyObject *self, PyObject *args) {
    PyObject *capsule, *data;
    if (!PyArg_ParseTuple(args, "OO", &capsule, &data)) return NULL;
    PushPlan *p = plan_of(capsule);
    if (!p) return NULL;
    Source src[MAX_COLS];
    PyObject *vals[MAX_COLS];
    if (p->closed) Py_RETURN_NONE;
    int single = 0, have = values_of(p, data, vals);
    if (have <= 0) {
        if (have < 0) return NULL;
        Py_RETURN_NONE;
    }
    Py_ssize_t opened = 0, k = sources_open(p, vals, src, &opened, &single);
    int exact = 1;
    for (Py_ssize_t g = 0; g < opened && k > 0; g++) exact &= src[g].held && !src[g].convert && !src[g].reshaped;
    sources_close(src, opened);
    if (k < 0) return NULL;
    if (k == 0 || !exact) Py_RETURN_NONE;
    return Py_BuildValue("(nO)", k, single ? Py_True : Py_False);
}

/* -- lanes and episode ids --------------------------------------------------------------------- */
/* where a push's rows go: one lane for all, or one per row */
typedef struct {
    int64_t all;         /* the lane of every row (each NULL) */
    const int64_t *each; /* k lanes, or NULL */
    Py_buffer view;      /* lane='s buffer, when held */
    int held;
} Lanes;

/* an int64 vector's view of obj (a buffer of format "l" or "q", C-contiguous, 1 dimension, or 0
 * with zero_dim): 1 held, 0 not taken here (nothing held) */
static int int64_view(PyObject *obj, Py_buffer *view, int zero_dim) {
    if (PyObject_GetBuffer(obj, view, PyBUF_RECORDS_RO) < 0) {
        PyErr_Clear();
        return 0;
    }
    if (!view->format || view->itemsize != 8 || (strcmp(view->format, "l") && strcmp(view->format, "q")) ||
        view->ndim > 1 || (view->ndim == 0 && !zero_dim) || !PyBuffer_IsContiguous(view, 'C')) {
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

/* lane= of a push of k rows: as given (an int, or k int64), else the envs' rule (push.check):
 * 1 taken (ln->each NULL for envs' lanes: lanes_spread makes them), 0 left to Python */
static int lanes_read(const PushPlan *p, PyObject *lane_o, Py_ssize_t k, Lanes *ln) {
    ln->all = -1;
    ln->each = NULL;
    ln->held = 0;
    if (lane_o == Py_None) {
        if (p->envs > 1) {
            if (k % p->envs) return 0;
        } else if (p->lanes > 1) {
            return 0;
        } else {
            ln->all = 0;
        }
    } else if (PyLong_CheckExact(lane_o)) {
        int overflow = 0;
        long long l = PyLong_AsLongLongAndOverflow(lane_o, &overflow);
        if (overflow || l < 0 || l >= p->lanes) {
            PyErr_Clear();
            return 0;
        }
        ln->all = l;
    } else {
        if (!int64_view(lane_o, &ln->view, 1)) return 0;
        ln->held = 1;
        if (ln->view.ndim == 0) { /* a numpy int64 (an env's index from an array): one lane for all */
            int64_t l = *(const int64_t *)ln->view.buf;
            if (l < 0 || l >= p->lanes) return 0;
            ln->all = l;
        } else {
            if (ln->view.shape[0] != k) return 0;
            ln->each = (const int64_t *)ln->view.buf;
        }
    }
    return ln->each || k <= p->lc; /* more rows than a lane holds: check_push explains */
}

/* the lane of each row (as given, or row i in lane i % envs) into `lanes_out`, each lane's rows
 * counted in count (zeroed here): 0 when a lane is out of range or gets more rows than it holds */
static int lanes_spread(const PushPlan *p, Lanes *ln, PyObject *lane_o, Py_ssize_t k, int64_t *lanes_out, int64_t *count) {
    for (Py_ssize_t l = 0; l < p->lanes; l++) count[l] = 0;
    if (lane_o == Py_None && p->envs > 1) {
        for (Py_ssize_t i = 0; i < k; i++) lanes_out[i] = i % p->envs;
    } else if (ln->each) {
        memcpy(lanes_out, ln->each, (size_t)k * sizeof(int64_t));
    } else {
        return 1;
    }
    for (Py_ssize_t i = 0; i < k; i++)
        if (lanes_out[i] < 0 || lanes_out[i] >= p->lanes || ++count[lanes_out[i]] > p->lc) return 0; /* check_push explains */
    ln->each = lanes_out;
    return 1;
}

/* a push's episode ids: one for all rows, or one per row */
typedef struct {
    int64_t all;
    const int64_t *each; /* k ids, or NULL */
    Py_buffer view;
    int held;
} Episodes;

/* episode= of a push of k rows: 1 taken, 0 left to Python (missing or unwanted: push.check says
 * so; ids per row without lane= or envs: edits.note_interleaving decides) */
static int episodes_read(const PushPlan *p, PyObject *episode_o, PyObject *lane_o, Py_ssize_t k, Episodes *ep) {
    ep->all = 0;
    ep->each = NULL;
    ep->held = 0;
    if (p->has_episode != (episode_o != Py_None)) return 0;
    if (!p->has_episode) return 1;
    if (PyLong_CheckExact(episode_o)) {
        int overflow = 0;
        ep->all = PyLong_AsLongLongAndOverflow(episode_o, &overflow);
        if (overflow || (ep->all == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return 0;
        }
        return 1;
    }
    if (!int64_view(episode_o, &ep->view, 1)) return 0;
    ep->held = 1;
    if (ep->view.ndim == 0) {
        ep->all = *(const int64_t *)ep->view.buf;
        return 1;
    }
    if (ep->view.shape[0] != k) return 0;
    if (k > 1 && lane_o == Py_None && p->envs == 0) return 0;
    ep->each = (const int64_t *)ep->view.buf;
    return 1;
}

/* -- the copies, the reservation, the commit ---------------------------------------------------- */
/* the push's copies (Copies) from its sources: the casts into scratch first (`small`, SMALL_WORDS
 * words on the caller's stack, or *scratch, to free), so nothing can fail once rows are odd; -1
 * with an error */
static int stage_copies(const PushPlan *p, const Source *src, Py_ssize_t k, Copies *c, int64_t **scratch,
                        int64_t *small) {
    c->n = p->n;
    c->total = 0;
    size_t need = 0;
    for (Py_ssize_t g = 0; g < p->n; g++)
        if (src[g].convert || !src[g].held) need += (size_t)(k * p->width[g] + 7) / 8;
    *scratch = NULL;
    int64_t *free_at = small;
    if (need > SMALL_WORDS) {
        if (!(*scratch = (int64_t *)PyMem_Malloc(need * 8))) {
            PyErr_NoMemory();
            return -1;
        }
        free_at = *scratch;
    }
    for (Py_ssize_t g = 0; g < p->n; g++) {
        const Source *s = &src[g];
        c->to[g] = (char *)p->dst[g].buf + p->offset[g];
        c->width[g] = p->width[g];
        c->row[g] = p->row[g];
        c->total += (size_t)(k * p->width[g]);
        if (s->held && !s->convert) {
            c->from[g] = (const char *)s->view.buf;
            continue;
        }
        char *to = (char *)free_at;
        free_at += (k * p->width[g] + 7) / 8;
        c->from[g] = to;
        if (!s->held) {
            memcpy(to, s->scalar.c, (size_t)p->width[g]); /* one row: a Python number */
        } else if (s->convert == 1) { /* the source maybe unaligned: memcpy each value */
            const char *d = (const char *)s->view.buf;
            float *f = (float *)to;
            for (Py_ssize_t i = 0, e = s->view.len / 8; i < e; i++) {
                double x;
                memcpy(&x, d + 8 * i, 8);
                f[i] = (float)x;
            }
        } else {
            const char *f = (const char *)s->view.buf;
            double *d = (double *)to;
            for (Py_ssize_t i = 0, e = s->view.len / 4; i < e; i++) {
                float x;
                memcpy(&x, f + 4 * i, 4);
                d[i] = (double)x;
            }
        }
    }
    return 0;
}

/* numpy.empty(k, int64) with a writable view of it in *ib; NULL with an error */
static PyObject *ids_new(const PushPlan *p, Py_ssize_t k, Py_buffer *ib) {
    PyObject *kobj = PyLong_FromSsize_t(k);
    if (!kobj) return NULL;
    PyObject *call[2] = {kobj, p->int64};
    PyObject *ids = PyObject_Vectorcall(p->empty, call, 2, NULL);
    Py_DECREF(kobj);
    if (!ids) return NULL;
    if (get_buf(ids, ib, 1, 8, "ids") < 0) {
        Py_DECREF(ids);
        return NULL;
    }
    if (ib->len != k * 8) {
        PyBuffer_Release(ib);
        Py_DECREF(ids);
        PyErr_SetString(PyExc_ValueError, "push: empty() gave the wrong size");
        return NULL;
    }
    return ids;
}

/* the reservation (copies.c's reserve_in_lanes), under the lock tried once (0 when busy or a
 * repair is owed) and unless frozen (0), with the inserted count: 1 reserved; 0 nothing written */
static int reserve_rows(const PushPlan *p, const Lanes *ln, Py_ssize_t k, uint16_t writer, int64_t *slots, int64_t *rows,
                        int64_t *at, int64_t *count, int64_t *ids) {
    pthread_mutex_t *mutex = (pthread_mutex_t *)p->lock.buf;
    int64_t *stats = (int64_t *)p->stats.buf;
    int pushed = 0;
    if (!lock_try(mutex)) return 0;
    if (!stats[COUNTER_FROZEN] &&
        reserve_in_lanes((int64_t *)p->cur.buf, p->lanes, p->lc, (int64_t *)p->stamp.buf, (uint16_t *)p->owner.buf, ln->each,
                         ln->all, k, writer, rows, slots, ids, NULL, at, count) == 1) {
        stats[COUNTER_INSERTED] += k;
        pushed = 1;
    }
    pthread_mutex_unlock(mutex);
    return pushed;
}

/* the reserved rows' copies, episode ids and commit, without the GIL for a large push */
static void write_rows(const PushPlan *p, const Copies *c, Py_ssize_t k, const int64_t *slots, const Episodes *ep) {
    PyThreadState *ts = c->total >= NOGIL_BYTES ? PyEval_SaveThread() : NULL;
    copies_run(c, k, slots, 0);
    if (p->has_episode) {
        int64_t *e = (int64_t *)p->episode.buf;
        for (Py_ssize_t i = 0; i < k; i++) e[slots[i]] = ep->each ? ep->each[i] : ep->all;
    }
    commit_slots((int64_t *)p->stamp.buf, k, slots, 0);
    if (ts) PyEval_RestoreThread(ts);
}

/* -- the push ---------------------------------------------------------------------------------- */
/* whether this process is the writer registered in the plan's `me` entry (Ring.writer_id): not in
 * a forked child until it registers its own */
static int registered(const PushPlan *p) {
    const int64_t *me = (const int64_t *)p->me.buf, *writers = (const int64_t *)p->writers.buf;
    return me[0] == (int64_t)push_pid && me[1] >= 0 && me[1] < p->writers.len / 8 &&
           __atomic_load_n(&writers[me[1]], __ATOMIC_RELAXED) == me[0];
}

/* the push of the field values `vals` with the plan's views held: the ids, None, or NULL with an
 * error set */
static PyObject *push_held(const PushPlan *p, PyObject *const *vals, PyObject *lane_o, PyObject *episode_o) {
    if (!registered(p)) Py_RETURN_NONE;
    Source src[MAX_COLS];
    int64_t small[SMALL_WORDS], scratch_small[SMALL_WORDS]; /* a usual push allocates nothing */
    Lanes ln = {0};
    Episodes ep = {0};
    Copies c;
    Py_buffer ib;
    int single = 0, ib_held = 0;
    int64_t *slots = NULL, *scratch = NULL;
    PyObject *ids_o = NULL, *result = NULL;
    Py_ssize_t opened = 0, k = sources_open(p, vals, src, &opened, &single);
    if (k <= 0 || !lanes_read(p, lane_o, k, &ln) || !episodes_read(p, episode_o, lane_o, k, &ep)) goto done;
    size_t words = (size_t)(2 * k + 2 * p->lanes);
    slots = words <= SMALL_WORDS ? small : (int64_t *)PyMem_Malloc(words * sizeof(int64_t));
    if (!slots) { PyErr_NoMemory(); goto done; }
    int64_t *rows = slots + k, *at = rows + k, *count = at + p->lanes;
    /* the lanes go into `slots` first, then (during the reservation) the slots */
    if (!lanes_spread(p, &ln, lane_o, k, slots, count)) goto done;
    if (stage_copies(p, src, k, &c, &scratch, scratch_small) < 0) goto done;
    if (!(ids_o = ids_new(p, k, &ib))) goto done;
    ib_held = 1;
    if (reserve_rows(p, &ln, k, (uint16_t)((const int64_t *)p->me.buf)[1], slots, rows, at, count, (int64_t *)ib.buf)) {
        write_rows(p, &c, k, slots, &ep);
        result = ids_o;
        ids_o = NULL;
    }
done:
    if (!result && !PyErr_Occurred()) {
        result = Py_None;
        Py_INCREF(result);
    }
    if (ib_held) PyBuffer_Release(&ib);
    Py_XDECREF(ids_o);
    PyMem_Free(scratch);
    if (slots != small) PyMem_Free(slots);
    if (ln.held) PyBuffer_Release(&ln.view);
    if (ep.held) PyBuffer_Release(&ep.view);
    sources_close(src, opened);
    return result;
}

/* push_held, counted as a push in flight: plan_close waits for the last one to release the views */
static PyObject *push_values(PushPlan *p, PyObject *const *vals, PyObject *lane_o, PyObject *episode_o) {
    if (p->closed) Py_RETURN_NONE;
    if (p->busy_pid != push_pid) { /* the first push here, or in a forked child: none in flight */
        p->busy = 0;
        p->busy_pid = push_pid;
    }
    p->busy++; /* (the GIL is held here: only a copy without it lets plan_close run meanwhile) */
    PyObject *got = push_held(p, vals, lane_o, episode_o);
    if (--p->busy == 0 && p->closed && p->n_dst) plan_release(p); /* closed meanwhile: ours to release */
    return got;
}

/* push(plan, data, lane, episode) -> ids or None: the push of `data`, a dict of the fields */
PyObject *py_push(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "push(plan, data, lane, episode)");
        return NULL;
    }
    PushPlan *p = plan_of(args[0]);
    if (!p) return NULL;
    PyObject *vals[MAX_COLS];
    int have = values_of(p, args[1], vals);
    if (have <= 0) {
        if (have < 0) return NULL;
        Py_RETURN_NONE;
    }
    return push_values(p, vals, args[2], args[3]);
}

/* the field index of keyword `name` (p->n: none) */
static Py_ssize_t field_index(const PushPlan *p, PyObject *name) {
    Py_ssize_t g = 0;
    while (g < p->n && p->names[g] != name) g++;
    if (g < p->n) return g;
    for (g = 0; g < p->n; g++) { /* not interned alike: compare the text */
        int eq = PyUnicode_Compare(p->names[g], name);
        if (eq == -1 && PyErr_Occurred()) return -1;
        if (eq == 0) break;
    }
    return g;
}

/* push_from_args(plan, args, nargs, kwnames): ReplayBuffer.push's usual calls, push(**fields) or
 * push(data_dict) with lane= and episode= or without, straight from the call's arguments to
 * push_values with no dict made: the ids, or None (a new reference) where the Python method must
 * run (any other call, and every push push_values leaves to Python), or NULL with an error. */
PyObject *push_from_args(PushPlan *p, PyObject *const *args, Py_ssize_t given, PyObject *kwnames) {
    static PyObject *s_lane, *s_episode;
    if (!s_lane && (!(s_lane = PyUnicode_InternFromString("lane")) || !(s_episode = PyUnicode_InternFromString("episode"))))
        return NULL;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    PyObject *const *kwvals = args + given;
    PyObject *vals[MAX_COLS], *lane_o = Py_None, *episode_o = Py_None;
    int usual = given <= 1 && !p->closed;
    Py_ssize_t found = 0;
    for (Py_ssize_t g = 0; g < p->n; g++) vals[g] = NULL;
    for (Py_ssize_t i = 0; i < nkw && usual; i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i);
        if (name == s_lane) { lane_o = kwvals[i]; continue; }
        if (name == s_episode) { episode_o = kwvals[i]; continue; }
        Py_ssize_t g = field_index(p, name);
        if (g < 0) return NULL;
        /* an unknown field, priority=, a name built at runtime, a field given twice... */
        if (g == p->n || given || vals[g]) { usual = 0; break; }
        vals[g] = kwvals[i];
        found++;
    }
    if (usual && given) {
        int have = values_of(p, args[0], vals);
        if (have < 0) return NULL;
        usual = have;
    } else if (usual) {
        usual = found == p->n;
    }
    if (usual) return push_values(p, vals, lane_o, episode_o);
    Py_RETURN_NONE;
}
