/* The reader's copies (protocol/reader.py, frames.py): rows gathered by id, and frame stacks read
 * from a lane, each row between two loads of its stamp (the commit protocol, rows.py). */
#include "native.h"

#include <string.h>

/* -- gather ------------------------------------------------------------------------------------ */
void columns_close(Columns *c) {
    for (Py_ssize_t i = 0; i < c->n; i++) {
        PyBuffer_Release(&c->src[i]);
        PyBuffer_Release(&c->dst[i]);
    }
    c->n = 0;
}

int columns_open(Columns *c, PyObject *src_o, PyObject *out_o, Py_ssize_t capacity, Py_ssize_t n) {
    Py_ssize_t ncols = PyTuple_GET_SIZE(src_o);
    c->n = 0;
    c->total = 0;
    if (ncols != PyTuple_GET_SIZE(out_o) || ncols > MAX_COLS) {
        PyErr_SetString(PyExc_ValueError, "gather: expected as many outs as sources (at most 64)");
        return -1;
    }
    for (Py_ssize_t g = 0; g < ncols; g++) {
        if (get_buf(PyTuple_GET_ITEM(src_o, g), &c->src[g], 0, 0, "gather source") < 0) goto fail;
        if (get_buf(PyTuple_GET_ITEM(out_o, g), &c->dst[g], 1, 0, "gather out") < 0) {
            PyBuffer_Release(&c->src[g]);
            goto fail;
        }
        c->n = g + 1;
        c->width[g] = c->src[g].len / capacity;
        if (c->src[g].len % capacity || c->dst[g].len != c->width[g] * n) {
            PyErr_Format(PyExc_ValueError, "gather: column %zd: expected a source of (capacity, w) bytes and an out of (n, w)", g);
            goto fail;
        }
        c->total += (size_t)c->width[g] * (size_t)n;
    }
    return 0;
fail:
    columns_close(c);
    return -1;
}

/* row slots[i] of `from` into row i of `to`, rows of w bytes */
static void copy_column(char *to, const char *from, size_t w, const int64_t *slots, Py_ssize_t n) {
    if (w == 8) {
        for (Py_ssize_t i = 0; i < n; i++) memcpy(to + i * 8, from + slots[i] * 8, 8);
    } else if (w <= GATHER_PAGE) {
        for (Py_ssize_t i = 0; i < n; i++) memcpy(to + (size_t)i * w, from + (size_t)slots[i] * w, w);
    } else {
        for (Py_ssize_t i = 0; i < n; i++) {
            if (i + GATHER_AHEAD < n) prefetch_pages(from + (size_t)slots[i + GATHER_AHEAD] * w, w);
            memcpy(to + (size_t)i * w, from + (size_t)slots[i] * w, w);
        }
    }
}

/* the copies of a gather, rows [lo, hi) of every column: one chunk of a pool job */
typedef struct {
    const Columns *c;
    const int64_t *slots;
} RowsJob;

static void rows_chunk(void *arg, Py_ssize_t lo, Py_ssize_t hi, int who) {
    const RowsJob *j = (const RowsJob *)arg;
    (void)who;
    for (Py_ssize_t g = 0; g < j->c->n; g++) {
        size_t w = (size_t)j->c->width[g];
        copy_column((char *)j->c->dst[g].buf + (size_t)lo * w, (const char *)j->c->src[g].buf, w, j->slots + lo, hi - lo);
    }
}

/* the first lines of row s of each column asked for (the columns in the caller's local arrays,
 * which stay in registers): a gather's rows are random, so their misses overlap */
static inline void prefetch_row(const char *const *from, const size_t *width, Py_ssize_t ncols, int64_t s) {
    for (Py_ssize_t g = 0; g < ncols; g++) {
        const char *row = from[g] + (size_t)s * width[g];
        __builtin_prefetch(row);
        if (width[g] > 64) __builtin_prefetch(row + 64);
        if (width[g] > 128) __builtin_prefetch(row + 128);
    }
}

/* the columns' sources and widths in local arrays */
static Py_ssize_t columns_local(const Columns *c, const char **from, size_t *width) {
    for (Py_ssize_t g = 0; g < c->n; g++) {
        from[g] = (const char *)c->src[g].buf;
        width[g] = (size_t)c->width[g];
    }
    return c->n;
}

void copy_slots(const Columns *c, const int64_t *slots, Py_ssize_t n) {
    const char *from[MAX_COLS];
    size_t width[MAX_COLS];
    Py_ssize_t ncols = columns_local(c, from, width);
    for (Py_ssize_t i = 0; i < n; i++) prefetch_row(from, width, ncols, slots[i]);
    RowsJob job = {c, slots};
    pool_run(rows_chunk, &job, n, c->total);
}

int64_t gather_rows(const Columns *c, const int64_t *ids, Py_ssize_t n, Py_ssize_t lanes, const int64_t *stamp,
                           int64_t lc, int64_t *slots, int64_t *first, char *ok) {
    /* the columns in local arrays: the stores below cannot change them, so they stay in registers */
    const char *from[MAX_COLS];
    size_t width[MAX_COLS];
    Py_ssize_t ncols = columns_local(c, from, width);
    int64_t lowest = INT64_MAX;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t id = ids[i], s = slot_of_id(id, lanes, lc);
        if (id < lowest) lowest = id;
        slots[i] = s;
        first[i] = stamp_first(stamp, s);
        prefetch_row(from, width, ncols, s);
    }
    /* every first stamp is loaded: the copies, on the pool's threads when they are big (pool.c),
     * all done and visible to this thread when pool_run returns */
    RowsJob job = {c, slots};
    pool_run(rows_chunk, &job, n, c->total);
    stamps_fence();
    for (Py_ssize_t i = 0; i < n; i++) ok[i] = stamp_intact(stamp, slots[i], first[i], committed_stamp_of_id(ids[i], lanes));
    return lowest;
}

/* gather(ids, lanes, stamp, sources, outs, ok) -> smallest id: gather_rows, each source a
 * (capacity, row bytes) column (C-contiguous) and its out (len(ids), row bytes). ids of any value
 * are safe (an id that names no row, like ring.INVALID, reads as not intact). The smallest id
 * (INT64_MAX for none) is for the caller's check against the lanes' last clear(). */
PyObject *py_gather(PyObject *self, PyObject *args) {
    PyObject *ids_o, *stamp_o, *src_o, *out_o, *ok_o;
    Py_ssize_t lanes;
    if (!PyArg_ParseTuple(args, "OnOO!O!O", &ids_o, &lanes, &stamp_o, &PyTuple_Type, &src_o, &PyTuple_Type, &out_o, &ok_o))
        return NULL;
    Py_buffer ib, stb, kb;
    Columns c;
    c.n = 0;
    PyObject *result = NULL;
    int64_t *slots = NULL;
    if (get_buf(ids_o, &ib, 0, 8, "ids") < 0) return NULL;
    if (get_buf(stamp_o, &stb, 0, 8, "stamp") < 0) { PyBuffer_Release(&ib); return NULL; }
    if (get_buf(ok_o, &kb, 1, 1, "ok") < 0) { PyBuffer_Release(&ib); PyBuffer_Release(&stb); return NULL; }
    Py_ssize_t n = ib.len / 8, capacity = stb.len / 8;
    if (lanes <= 0 || capacity <= 0 || capacity % lanes) {
        PyErr_SetString(PyExc_ValueError, "gather: lanes must divide a positive capacity");
        goto done;
    }
    if (kb.len != n) {
        PyErr_SetString(PyExc_ValueError, "gather: ok needs one bool per id");
        goto done;
    }
    if (columns_open(&c, src_o, out_o, capacity, n) < 0) goto done;
    slots = (int64_t *)PyMem_Malloc((size_t)(n ? n : 1) * 2 * sizeof(int64_t));
    if (!slots) { PyErr_NoMemory(); goto done; }
    PyThreadState *ts = c.total >= NOGIL_BYTES ? PyEval_SaveThread() : NULL;
    int64_t lowest = gather_rows(&c, (const int64_t *)ib.buf, n, lanes, (const int64_t *)stb.buf, capacity / lanes, slots,
                                 slots + (n ? n : 1), (char *)kb.buf);
    if (ts) PyEval_RestoreThread(ts);
    result = PyLong_FromLongLong(lowest);
done:
    columns_close(&c);
    PyMem_Free(slots);
    PyBuffer_Release(&ib);
    PyBuffer_Release(&stb);
    PyBuffer_Release(&kb);
    return result;
}

/* -- runs: a lane's consecutive rows (device.py's refresh) ------------------------------------ */
Py_ssize_t gather_run_rows(const Columns *c, Py_ssize_t first, Py_ssize_t n, int64_t n0, const int64_t *stamp,
                           Py_ssize_t to, int64_t *firsts, char *ok) {
    for (Py_ssize_t i = 0; i < n; i++) firsts[i] = stamp_first(stamp, first + i);
    for (Py_ssize_t g = 0; g < c->n; g++) {
        size_t w = (size_t)c->width[g];
        memcpy((char *)c->dst[g].buf + (size_t)to * w, (const char *)c->src[g].buf + (size_t)first * w, (size_t)n * w);
    }
    stamps_fence();
    Py_ssize_t good = 0;
    for (Py_ssize_t i = 0; i < n; i++) good += ok[i] = stamp_intact(stamp, first + i, firsts[i], committed_stamp(n0 + i));
    return good;
}

/* gather_run(first, n0, stamp, sources, outs, ok) -> intact rows: gather_run_rows, each source a
 * (capacity, row bytes) column (C-contiguous), its out (len(ok), row bytes); the slots must lie
 * inside the columns (a run never wraps: the caller splits it at its lane's end). */
PyObject *py_gather_run(PyObject *self, PyObject *args) {
    PyObject *stamp_o, *src_o, *out_o, *ok_o;
    Py_ssize_t first;
    long long n0;
    if (!PyArg_ParseTuple(args, "nLOO!O!O", &first, &n0, &stamp_o, &PyTuple_Type, &src_o, &PyTuple_Type, &out_o, &ok_o))
        return NULL;
    Py_buffer stb, kb;
    Columns c;
    c.n = 0;
    PyObject *result = NULL;
    int64_t *firsts = NULL;
    if (get_buf(stamp_o, &stb, 0, 8, "stamp") < 0) return NULL;
    if (get_buf(ok_o, &kb, 1, 1, "ok") < 0) { PyBuffer_Release(&stb); return NULL; }
    Py_ssize_t n = kb.len, capacity = stb.len / 8;
    if (first < 0 || capacity <= 0 || first > capacity - n || n0 < 0) {
        PyErr_SetString(PyExc_ValueError, "gather_run: expected rows n0 >= 0 in slots [first, first + len(ok)) of the columns");
        goto done;
    }
    if (columns_open(&c, src_o, out_o, capacity, n) < 0) goto done;
    firsts = (int64_t *)PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    if (!firsts) { PyErr_NoMemory(); goto done; }
    PyThreadState *ts = c.total >= NOGIL_BYTES ? PyEval_SaveThread() : NULL;
    Py_ssize_t good = gather_run_rows(&c, first, n, (int64_t)n0, (const int64_t *)stb.buf, 0, firsts, (char *)kb.buf);
    if (ts) PyEval_RestoreThread(ts);
    result = PyLong_FromSsize_t(good);
done:
    columns_close(&c);
    PyMem_Free(firsts);
    PyBuffer_Release(&stb);
    PyBuffer_Release(&kb);
    return result;
}

/* -- frame stacks (frames.py) ------------------------------------------------------------------ */
#define MAX_STACKS 8

/* a stacks call's inputs, checked: the window (m, W), the frames' column, the outs */
typedef struct {
    const int64_t *win;   /* (m, W) ids */
    const char *ok;       /* (m, W): the window row is intact */
    const uint8_t *kind;  /* (m, W): its _kind bits */
    Py_ssize_t m, width;  /* m transitions, W window columns */
    const int64_t *stamp; /* the ring's stamps */
    Py_ssize_t lanes;
    int64_t lc;
    const char *from; /* the frames' (capacity, w bytes) column */
    Py_ssize_t w, k, nst;
    Py_ssize_t last[MAX_STACKS]; /* each stack's newest-frame column */
    char *to[MAX_STACKS];        /* each stack's out, (m, k, w bytes) */
} Stacks;

/* the frames copied, for the second stamp loads: slot, first stamp, id; transition i's are the
 * count[i] entries from i * per (per = k * stacks, the most one transition copies) */
typedef struct {
    int64_t *slots, *firsts, *rowids, *count;
    Py_ssize_t per;
} Copied;

/* -- frames.py's read rules, the one place C has them ------------------------------------------ */
int frames_center(const uint8_t *kind, Py_ssize_t c, int ahead) {
    return !(kind[c] & (KIND_END | KIND_LEAD)) && !(ahead && (kind[c + 1] & KIND_START));
}

int frames_stack(const uint8_t *kind, Py_ssize_t last, Py_ssize_t k, int64_t *cols) {
    Py_ssize_t first = last;
    int started = 0;
    for (Py_ssize_t j = 0; j < k; j++) { /* j frames back from the newest */
        Py_ssize_t col = last - j, p = k - 1 - j;
        if (!started && j && (kind[col] & KIND_END)) return 0;
        cols[p] = started ? ((kind[first] & KIND_ZERO) ? -1 : first) : col;
        if (!started && (kind[col] & KIND_START)) {
            started = 1;
            first = col;
        }
    }
    return 1;
}

/* stack t of transition i: each chronological position's slot (-1: zeros) and id into psl and
 * pid (frames_stack); 0 when the transition is not valid (frames_stack says so, or a real frame
 * other than the newest is from a row not intact) */
static int stack_plan(const Stacks *s, Py_ssize_t i, Py_ssize_t t, int64_t *psl, int64_t *pid) {
    const int64_t *wi = s->win + i * s->width;
    const char *oki = s->ok + i * s->width;
    if (!frames_stack(s->kind + i * s->width, s->last[t], s->k, psl)) return 0;
    for (Py_ssize_t p = 0; p < s->k; p++) {
        int64_t col = psl[p];
        if (col < 0) continue;
        if (col != s->last[t] && !oki[col]) return 0;
        pid[p] = wi[col];
        psl[p] = slot_of_id(wi[col], s->lanes, s->lc);
    }
    return 1;
}

/* the copies of stack t of transition i by its plan, oldest first, each frame's first stamp
 * (acquire) loaded before it is copied: frames of consecutive slots (a stack within its lane) are
 * one copy, read forward as a whole row is (faster than frame by frame, newest first) */
static void stack_copy(const Stacks *s, Py_ssize_t i, Py_ssize_t t, const int64_t *psl, const int64_t *pid, const Copied *cp) {
    size_t w = (size_t)s->w;
    Py_ssize_t at = i * cp->per + cp->count[i];
    char *to = s->to[t] + (size_t)i * (size_t)s->k * w;
    for (Py_ssize_t p = 0; p < s->k;) {
        if (psl[p] < 0) {
            memset(to + (size_t)p * w, 0, w);
            p++;
            continue;
        }
        Py_ssize_t q = p + 1;
        while (q < s->k && psl[q] == psl[q - 1] + 1) q++;
        for (Py_ssize_t r = p; r < q; r++, at++) {
            cp->firsts[at] = stamp_first(s->stamp, psl[r]);
            cp->slots[at] = psl[r];
            cp->rowids[at] = pid[r];
        }
        memcpy(to + (size_t)p * w, s->from + (size_t)psl[p] * w, (size_t)(q - p) * w);
        p = q;
    }
    cp->count[i] = at - i * cp->per;
}

/* a stacks job: transitions [lo, hi), their plans and copies (first stamps, acquire, loaded
 * before each copy); one chunk of a pool job. plan: scratch of 2k per thread (who). */
typedef struct {
    const Stacks *s;
    char *valid;
    const Copied *cp;
    int64_t *plan;
} StacksJob;

static void stacks_chunk(void *arg, Py_ssize_t lo, Py_ssize_t hi, int who) {
    const StacksJob *j = (const StacksJob *)arg;
    const Stacks *s = j->s;
    int64_t *psl = j->plan + (size_t)who * 2 * (size_t)s->k, *pid = psl + s->k;
    for (Py_ssize_t i = lo; i < hi; i++) {
        j->cp->count[i] = 0;
        for (Py_ssize_t t = 0; t < s->nst && j->valid[i]; t++) {
            if (!stack_plan(s, i, t, psl, pid)) j->valid[i] = 0;
            else stack_copy(s, i, t, psl, pid, j->cp);
        }
    }
}

/* every stack of every valid transition: plans and copies (on the pool's threads when they are
 * big, pool.c: all done and visible here when pool_run returns), an acquire fence, the second
 * stamps; a frame not intact makes its transition not valid. plan: scratch of 2k * POOL_MAX. No
 * Python calls. */
static void stacks_run(const Stacks *s, char *valid, const Copied *cp, int64_t *plan) {
    StacksJob job = {s, valid, cp, plan};
    pool_run(stacks_chunk, &job, s->m, (size_t)s->m * (size_t)s->k * (size_t)s->nst * (size_t)s->w);
    stamps_fence();
    for (Py_ssize_t i = 0; i < s->m; i++) {
        const int64_t *sl = cp->slots + i * cp->per, *fi = cp->firsts + i * cp->per, *ri = cp->rowids + i * cp->per;
        for (Py_ssize_t c = 0; c < cp->count[i]; c++)
            if (!stamp_intact(s->stamp, sl[c], fi[c], committed_stamp_of_id(ri[c], s->lanes))) valid[i] = 0;
    }
}

/* the lasts (newest-frame columns, in [k - 1, W)) and the outs ((m, k, w) bytes each) of a stacks
 * call into s; dst: the outs' views, *got of them held; -1 with an error */
static int stacks_outs(Stacks *s, PyObject *lasts_o, PyObject *outs_o, Py_buffer *dst, Py_ssize_t *got) {
    for (Py_ssize_t t = 0; t < s->nst; t++) {
        s->last[t] = PyLong_AsSsize_t(PyTuple_GET_ITEM(lasts_o, t));
        if (s->last[t] == -1 && PyErr_Occurred()) return -1;
        if (s->last[t] < s->k - 1 || s->last[t] >= s->width) {
            PyErr_Format(PyExc_ValueError, "stacks: last %zd: expected a window column in [k - 1, W)", s->last[t]);
            return -1;
        }
    }
    for (; *got < s->nst; (*got)++) {
        Py_ssize_t g = *got;
        if (get_buf(PyTuple_GET_ITEM(outs_o, g), &dst[g], 1, 0, "stacks out") < 0) return -1;
        if (dst[g].len != s->m * s->k * s->w) {
            PyErr_Format(PyExc_ValueError, "stacks: out %zd: expected (m, k, w) bytes", g);
            PyBuffer_Release(&dst[g]);
            return -1;
        }
        s->to[g] = (char *)dst[g].buf;
    }
    return 0;
}

/* stacks(win, ok, kind, lanes, stamp, column, k, lasts, outs, valid): frames.stack_plan and the
 * frames' gather in one pass, per transition still valid: for each newest-frame column `last` (one
 * per out), the k frames back from it (chronological in the out, (m, k, frame bytes)): real up to
 * and including the first row that starts an episode, older ones padding (that row's frame, or
 * zeros where it is marked ZERO). A real frame other than the newest must come from an intact
 * window row (ok) that is not an end row, else the transition is not valid. Every frame copied has
 * the stamp check (first stamps acquire, copies, acquire fence, second stamps); a failed one makes
 * its transition not valid. win/ok/kind are (m, W); ids of any value are safe. */
PyObject *py_stacks(PyObject *self, PyObject *args) {
    PyObject *win_o, *ok_o, *kind_o, *stamp_o, *col_o, *lasts_o, *outs_o, *valid_o;
    Stacks s;
    if (!PyArg_ParseTuple(args, "OOOnOOnO!O!O", &win_o, &ok_o, &kind_o, &s.lanes, &stamp_o, &col_o, &s.k,
                          &PyTuple_Type, &lasts_o, &PyTuple_Type, &outs_o, &valid_o))
        return NULL;
    s.nst = PyTuple_GET_SIZE(lasts_o);
    if (s.nst != PyTuple_GET_SIZE(outs_o) || s.nst < 1 || s.nst > MAX_STACKS) {
        PyErr_SetString(PyExc_ValueError, "stacks: expected 1 to 8 lasts and as many outs");
        return NULL;
    }
    Py_buffer b[6], dst[MAX_STACKS]; /* win, ok, kind, stamp, column, valid */
    PyObject *objs[6] = {win_o, ok_o, kind_o, stamp_o, col_o, valid_o};
    static const char *names[6] = {"win", "ok", "kind", "stamp", "column", "valid"};
    static const int writable[6] = {0, 0, 0, 0, 0, 1}, itemsize[6] = {8, 1, 1, 8, 0, 1};
    Py_ssize_t nbuf = 0, got = 0;
    PyObject *result = NULL;
    Copied cp = {NULL, NULL, NULL, NULL, 0};
    int64_t *plan;
    for (; nbuf < 6; nbuf++)
        if (get_buf(objs[nbuf], &b[nbuf], writable[nbuf], itemsize[nbuf], names[nbuf]) < 0) goto done;
    s.m = b[5].len;
    Py_ssize_t capacity = b[3].len / 8;
    if (s.lanes <= 0 || capacity <= 0 || capacity % s.lanes || b[4].len % capacity || s.k < 1) {
        PyErr_SetString(PyExc_ValueError, "stacks: lanes must divide a positive capacity, the column be (capacity, w), k >= 1");
        goto done;
    }
    s.w = b[4].len / capacity;
    s.width = s.m ? b[0].len / 8 / s.m : 0;
    if (b[0].len != s.m * s.width * 8 || b[1].len != s.m * s.width || b[2].len != s.m * s.width || (s.m && s.width < 1)) {
        PyErr_SetString(PyExc_ValueError, "stacks: win, ok and kind must be (m, W) with m = len(valid)");
        goto done;
    }
    if (stacks_outs(&s, lasts_o, outs_o, dst, &got) < 0) goto done;
    s.win = (const int64_t *)b[0].buf;
    s.ok = (const char *)b[1].buf;
    s.kind = (const uint8_t *)b[2].buf;
    s.stamp = (const int64_t *)b[3].buf;
    s.from = (const char *)b[4].buf;
    s.lc = capacity / s.lanes;
    cp.per = s.k * s.nst;
    size_t m1 = (size_t)(s.m ? s.m : 1), most = m1 * (size_t)cp.per;
    cp.slots = (int64_t *)PyMem_Malloc((most * 3 + m1 + 2 * (size_t)s.k * POOL_MAX) * sizeof(int64_t));
    if (!cp.slots) { PyErr_NoMemory(); goto done; }
    cp.firsts = cp.slots + most;
    cp.rowids = cp.firsts + most;
    cp.count = cp.rowids + most;
    plan = cp.count + m1;
    PyThreadState *ts = (size_t)s.m * (size_t)s.k * (size_t)s.nst * (size_t)s.w >= NOGIL_BYTES ? PyEval_SaveThread() : NULL;
    stacks_run(&s, (char *)b[5].buf, &cp, plan);
    if (ts) PyEval_RestoreThread(ts);
    result = Py_None;
    Py_INCREF(result);
done:
    for (Py_ssize_t g = 0; g < got; g++) PyBuffer_Release(&dst[g]);
    for (Py_ssize_t i = 0; i < nbuf; i++) PyBuffer_Release(&b[i]);
    PyMem_Free(cp.slots);
    return result;
}
