/* shmbuffer's native hot path: the sum/min tree, the stamped gather and the push copy.
 *
 * Plain C and the CPython C API (buffer protocol only: no numpy headers, so the build needs
 * nothing but a compiler and setuptools). Every entry point checks what it is given (buffer
 * sizes, contiguity, slots in range) and raises rather than reading or writing out of bounds;
 * the Python callers (sumtree.py, reader.py, buffer.py via native.py) are the reference
 * implementation and the fallback, and tests/test_native.py checks both agree.
 *
 * Memory ordering (ring.py's commit protocol, a seqlock per row): a reader loads each slot's
 * stamp with acquire semantics before it copies the row, issues an acquire fence after the
 * copies, then loads the stamps again; a writer's commit stores the even stamp with release
 * semantics after its copies. These are the C11/GCC __atomic builtins, so the protocol no longer
 * relies on x86's ordering or on numpy calls being separate.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define FANOUT 16
#define MAX_LEVELS 32
/* copies of at least this many bytes in all run without the GIL; -DNOGIL_BYTES=... overrides it
 * for a measurement. Measured 2026-11-26 (2-core VM, load average 6.6 from other work: noisy),
 * sample(n) of 16 KiB rows, a build that always releases against one that never does:
 *   one thread, min of 7 blocks (us):  16 KiB 15.2 / 15.1, 64 KiB 20.9 / 19.4, 256 KiB 35.4 / 35.5,
 *                                      1 MiB 91.8 / 97.0, 4 MiB 349 / 542
 *   a background sampler while the main thread runs Python, 3 runs (main work/s, batches/s),
 *   releasing vs not: equal within the run-to-run spread at every size (e.g. 1 MiB: main
 *   4.7-7.9k vs 4.7-7.2k, batches 598-1132 vs 841-992)
 * The release costs nothing measurable at 16 KiB and above and buys nothing measurable below
 * 1 MiB here; the threshold stays where it was (256 KiB) until a quieter machine says otherwise. */
#ifndef NOGIL_BYTES
#define NOGIL_BYTES (256 * 1024)
#endif

/* -- buffers ----------------------------------------------------------------------------------- */
/* whether buffer format f is `want` (a native format of one item, as numpy gives an aligned array
 * of the column's dtype): numpy gives an unaligned native array (a field of a packed record) the
 * same item with standard size and native order, "=f" for "f" ("=q" for "l"); the copies are
 * memcpy, which does not care about alignment */
static int same_format(const char *f, const char *want) {
    if (strcmp(f, want) == 0) return 1;
    const union { uint16_t u; char c[2]; } probe = {1};
    char order = probe.c[0] ? '<' : '>';
    if ((f[0] != '=' && f[0] != order) || !f[1] || f[2] || !want[0] || want[1]) return 0;
    char a = f[1], b = want[0];
    if (a == b) return strchr("?bBhHiIqQfd", a) != NULL; /* standard and native sizes agree */
    return (a == 'q' && b == 'l' && sizeof(long) == 8) || (a == 'Q' && b == 'L' && sizeof(long) == 8) ||
           (a == 'i' && b == 'l' && sizeof(long) == 4) || (a == 'I' && b == 'L' && sizeof(long) == 4);
}

static int get_buf(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: expected a C-contiguous%s buffer", what, writable ? " writable" : "");
        return -1;
    }
    if (itemsize > 0 && (view->itemsize != itemsize || view->len % itemsize)) {
        PyErr_Format(PyExc_TypeError, "%s: expected items of %zd bytes, got %zd", what, itemsize, view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* -- the tree ---------------------------------------------------------------------------------- */
typedef struct {
    Py_ssize_t n;                 /* levels, leaves first; the last is the top */
    Py_ssize_t len[MAX_LEVELS];   /* nodes per level */
    Py_ssize_t at[MAX_LEVELS];    /* offset of each level in the arrays */
    Py_ssize_t cum;               /* offset of the prefix sum of the top level */
    Py_ssize_t size;              /* the arrays' length */
} Plan;

/* sumtree._plan as a tuple of level lengths; checked for consistency with the arrays' size */
static int read_plan(PyObject *plan, Py_ssize_t capacity, Py_ssize_t size, Plan *p) {
    if (!PyTuple_Check(plan) || PyTuple_GET_SIZE(plan) < 1 || PyTuple_GET_SIZE(plan) > MAX_LEVELS) {
        PyErr_SetString(PyExc_ValueError, "plan: expected a tuple of 1 to 32 level lengths");
        return -1;
    }
    p->n = PyTuple_GET_SIZE(plan);
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < p->n; i++) {
        Py_ssize_t v = PyLong_AsSsize_t(PyTuple_GET_ITEM(plan, i));
        if (v == -1 && PyErr_Occurred()) return -1;
        if (v <= 0 || v > ((Py_ssize_t)1 << 40)) goto bad;
        if (i < p->n - 1 && v % FANOUT) goto bad;
        if (i > 0 && v != (p->len[i - 1] / FANOUT + FANOUT - 1) / FANOUT * FANOUT && v != p->len[i - 1] / FANOUT) goto bad;
        p->len[i] = v;
        p->at[i] = at;
        at += v;
    }
    p->cum = at;
    p->size = at + p->len[p->n - 1];
    if (capacity <= 0 || capacity > p->len[0] || p->size != size) goto bad;
    return 0;
bad:
    PyErr_SetString(PyExc_ValueError, "plan: level lengths do not match the tree's capacity and arrays");
    return -1;
}

static inline void prefetch_block(const double *at) {
    __builtin_prefetch(at);
    __builtin_prefetch(at + 8);
    __builtin_prefetch(at + FANOUT - 1);
}

/* The walk of sumtree.SumTree.find for n points: x holds the masses on entry (clobbered), node the
 * slots on return. Runs without the GIL (touches nothing but these arrays). */
static void find_core(const double *sums, const Plan *p, Py_ssize_t capacity, double *x, int64_t *node, Py_ssize_t n) {
    const double *cum = sums + p->cum;
    Py_ssize_t top = p->len[p->n - 1];
    double total = cum[top - 1];
    double below = nextafter(total, 0.0);
    for (Py_ssize_t i = 0; i < n; i++) {
        double m = x[i];
        if (m > below || isnan(below)) m = below; /* np.minimum: NaN propagates from either side */
        if (isnan(x[i])) m = x[i];
        x[i] = m;
        node[i] = 0;
    }
    /* searchsorted(cum, x, side="right"): the first index whose value is > x (NaN: the end, as
     * numpy sorts it), without branches, every point in lockstep: the halving is the same for
     * all of them, so each step's loads are independent and overlap (one point after another,
     * each step waited for the load before it: measured ~2x slower for 256 points) */
    Py_ssize_t len = top;
    while (len > 1) {
        Py_ssize_t half = len / 2;
        for (Py_ssize_t i = 0; i < n; i++) node[i] += (int64_t)(!(x[i] < cum[node[i] + half])) * half;
        len -= half;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t lo = node[i] + (Py_ssize_t)(!(x[i] < cum[node[i]]));
        if (lo > top - 1) lo = top - 1;
        double m = x[i];
        if (lo > 0) m -= cum[lo - 1];
        if (m < 0.0) m = 0.0;
        x[i] = m;
        node[i] = lo;
    }
    for (Py_ssize_t level = p->n - 2; level >= 0; level--) {
        const double *nodes = sums + p->at[level];
        Py_ssize_t rows = p->len[level] / FANOUT;
        /* every point's 16 children are a random 128 bytes of a large array: ask for all of
         * them first, so the misses overlap instead of following one another */
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t k = node[i] < rows - 1 ? node[i] : rows - 1;
            prefetch_block(nodes + k * FANOUT);
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t k = node[i];
            if (k > rows - 1) k = rows - 1;
            const double *c = nodes + k * FANOUT;
            double u = x[i], before[FANOUT], acc = 0.0;
            int count = 0;
            for (int j = 0; j < FANOUT; j++) {
                before[j] = acc;
                count += before[j] <= u;
                acc += c[j];
            }
            count -= 1;
            if (count < 0) count = 0;
            x[i] = u - before[count];
            node[i] = k * FANOUT + count;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (node[i] > capacity - 1) node[i] = capacity - 1;
}

/* find(sums, plan, capacity, mass, out): sumtree.SumTree.find, all points in lockstep */
static PyObject *tree_find(PyObject *self, PyObject *args) {
    PyObject *sums_o, *plan_o, *mass_o, *out_o;
    Py_ssize_t capacity;
    if (!PyArg_ParseTuple(args, "OOnOO", &sums_o, &plan_o, &capacity, &mass_o, &out_o)) return NULL;
    Py_buffer sb, mb, ob;
    if (get_buf(sums_o, &sb, 0, 8, "sums") < 0) return NULL;
    if (get_buf(mass_o, &mb, 0, 8, "mass") < 0) { PyBuffer_Release(&sb); return NULL; }
    if (get_buf(out_o, &ob, 1, 8, "out") < 0) { PyBuffer_Release(&sb); PyBuffer_Release(&mb); return NULL; }
    PyObject *result = NULL;
    Plan p;
    if (read_plan(plan_o, capacity, sb.len / 8, &p) < 0) goto done;
    Py_ssize_t n = mb.len / 8;
    if (ob.len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "out: expected one slot per point");
        goto done;
    }
    {
        double *u = (double *)PyMem_Malloc((size_t)(n ? n : 1) * sizeof(double));
        if (!u) { PyErr_NoMemory(); goto done; }
        if (n) memcpy(u, mb.buf, (size_t)n * sizeof(double));
        Py_BEGIN_ALLOW_THREADS
        find_core((const double *)sb.buf, &p, capacity, u, (int64_t *)ob.buf, n);
        Py_END_ALLOW_THREADS
        PyMem_Free(u);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&sb);
    PyBuffer_Release(&mb);
    PyBuffer_Release(&ob);
    return result;
}

/* The work of sumtree.SumTree.update: slots (all in [0, capacity), checked by the caller) get
 * values[i] (or scalar when values is NULL) in order, a repeated slot keeping its last value; then
 * their ancestors and the prefix sum of the top level from the first top node that changed.
 *
 * A sum is recomputed from its 16 children, in order, as always. A min is exact whatever the
 * order, so it is carried up instead: a parent's min becomes the new value where that is not
 * larger, stays where the child was not its smallest, and only where the smallest child grew is
 * it the min of the 16 again. So the mins of the leaves (a cold 8 MiB array at 1M rows: a draw
 * reads the sums, not the mins) cost a line per slot, not the block of 16: at 1M rows these
 * misses were most of an update's time. A run of consecutive slots (a push's rows) changes whole
 * blocks: there each parent's min is recomputed from its children once, as its sum is (carried,
 * slot after slot, such a run was slower than before: benchmarks/README.md). The carrying rests
 * on every parent holding the min of its children, which every writer keeps (a holder that died
 * mid-update is repaired by a rebuild before the next locker goes on: priorities.py). */
static void update_core(double *sums, double *mins, const Plan *p, const int64_t *slots, const double *values,
                        double scalar, Py_ssize_t n) {
    if (!n) return;
    Py_ssize_t top = p->n - 1;
    /* everything the update reads, asked for at once (the misses overlap): each slot's 16 leaves
     * and, level by level, the 16 siblings of its ancestor in sums; its own line in mins, level
     * by level below the top */
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t k = (uint64_t)slots[i];
        for (Py_ssize_t level = 0; level < top; level++, k /= FANOUT) {
            prefetch_block(sums + p->at[level] + (Py_ssize_t)(k / FANOUT * FANOUT));
            __builtin_prefetch(mins + p->at[level] + (Py_ssize_t)k, 1);
        }
    }
    /* one run of consecutive slots (a push's rows): whole blocks change, so each parent's min is
     * recomputed from its children once, as its sum is, instead of carried slot after slot */
    int run = 1;
    for (Py_ssize_t i = 1; i < n && run; i++) run = slots[i] == slots[0] + i;
    /* leaves in order: a repeated slot keeps its last value */
    for (Py_ssize_t i = 0; i < n; i++) {
        double v = values ? values[i] : scalar;
        sums[slots[i]] = v;
        if (run) mins[slots[i]] = v > 0 ? v : INFINITY;
    }
    for (Py_ssize_t level = 1; level < p->n; level++) {
        const double *cs = sums + p->at[level - 1], *cm = mins + p->at[level - 1];
        double *ps = sums + p->at[level], *pm = mins + p->at[level];
        int64_t last = -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t k = (uint64_t)slots[i];
            for (Py_ssize_t l = 1; l <= level; l++) k /= FANOUT;
            if ((int64_t)k == last) continue; /* recomputing it again would give the same */
            last = (int64_t)k;
            const double *c = cs + k * FANOUT;
            double s = 0.0;
            for (int j = 0; j < FANOUT; j++) s += c[j];
            ps[k] = s;
            if (run) {
                const double *m = cm + k * FANOUT;
                double lo = m[0];
                for (int j = 1; j < FANOUT; j++)
                    if (m[j] < lo) lo = m[j];
                pm[k] = lo;
            }
        }
    }
    if (run) goto prefix;
    if (top > 0) { /* the leaves whose block's min must be found again (below): ask for those blocks */
        const double *pm = mins + p->at[1];
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t k = (uint64_t)slots[i];
            double v = values ? values[i] : scalar;
            if (mins[k] == pm[k / FANOUT] && !(v > 0 && v <= pm[k / FANOUT])) prefetch_block(mins + k / FANOUT * FANOUT);
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* in order: a repeated slot keeps its last value */
        double v = values ? values[i] : scalar, now = v > 0 ? v : INFINITY;
        uint64_t k = (uint64_t)slots[i];
        double was = mins[k];
        mins[k] = now;
        for (Py_ssize_t level = 0; level < top && was != now; level++, k /= FANOUT) {
            double *up = mins + p->at[level + 1] + k / FANOUT, m = *up, next;
            if (now <= m) {
                next = now;
            } else if (was > m) {
                next = m; /* another child is the smallest, and still there */
            } else { /* the smallest child grew: the smallest of the 16 now */
                const double *c = mins + p->at[level] + k / FANOUT * FANOUT;
                next = c[0];
                for (int j = 1; j < FANOUT; j++)
                    if (c[j] < next) next = c[j];
            }
            *up = next;
            was = m;
            now = next;
        }
    }
prefix:
    /* the prefix sum from the first top node that changed: the sums before it are the
     * same additions in the same order, so the result equals numpy's cumsum of the whole */
    int64_t from = INT64_MAX;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t k = (uint64_t)slots[i];
        for (Py_ssize_t l = 1; l < p->n; l++) k /= FANOUT;
        if ((int64_t)k < from) from = (int64_t)k;
    }
    const double *topv = sums + p->at[p->n - 1];
    double *cum = sums + p->cum, acc = from > 0 ? cum[from - 1] : 0.0;
    for (Py_ssize_t j = from; j < p->len[p->n - 1]; j++) {
        acc += topv[j];
        cum[j] = acc;
    }
}

/* update(sums, mins, plan, capacity, slots, values): sumtree.SumTree.update; values is a buffer
 * of one float64 per slot or a float. Slots must lie in [0, capacity). */
static PyObject *tree_update(PyObject *self, PyObject *args) {
    PyObject *sums_o, *mins_o, *plan_o, *slots_o, *values_o;
    Py_ssize_t capacity;
    if (!PyArg_ParseTuple(args, "OOOnOO", &sums_o, &mins_o, &plan_o, &capacity, &slots_o, &values_o)) return NULL;
    Py_buffer sb, nb, kb, vb;
    int have_values = 0;
    double scalar = 0.0;
    if (PyFloat_Check(values_o) || PyLong_Check(values_o)) {
        scalar = PyFloat_AsDouble(values_o);
        if (scalar == -1.0 && PyErr_Occurred()) return NULL;
    } else {
        if (get_buf(values_o, &vb, 0, 8, "values") < 0) return NULL;
        have_values = 1;
    }
    if (get_buf(sums_o, &sb, 1, 8, "sums") < 0) { if (have_values) PyBuffer_Release(&vb); return NULL; }
    if (get_buf(mins_o, &nb, 1, 8, "mins") < 0) {
        PyBuffer_Release(&sb); if (have_values) PyBuffer_Release(&vb); return NULL;
    }
    if (get_buf(slots_o, &kb, 0, 8, "slots") < 0) {
        PyBuffer_Release(&sb); PyBuffer_Release(&nb); if (have_values) PyBuffer_Release(&vb); return NULL;
    }
    PyObject *result = NULL;
    Plan p;
    if (read_plan(plan_o, capacity, sb.len / 8, &p) < 0) goto done;
    if (nb.len != sb.len) {
        PyErr_SetString(PyExc_ValueError, "mins: expected as many floats as sums");
        goto done;
    }
    Py_ssize_t n = kb.len / 8;
    if (have_values && vb.len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "values: expected one value per slot");
        goto done;
    }
    const int64_t *slots = (const int64_t *)kb.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= capacity) {
            PyErr_Format(PyExc_IndexError, "slot %lld is outside the tree's %zd slots", (long long)slots[i], capacity);
            goto done;
        }
    }
    update_core((double *)sb.buf, (double *)nb.buf, &p, slots, have_values ? (const double *)vb.buf : NULL, scalar, n);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&sb);
    PyBuffer_Release(&nb);
    PyBuffer_Release(&kb);
    if (have_values) PyBuffer_Release(&vb);
    return result;
}

/* -- the ring's arithmetic ----------------------------------------------------------------------- */
static inline int64_t floordiv(int64_t a, int64_t b) {
    int64_t q = a / b;
    if ((a % b != 0) && ((a < 0) != (b < 0))) q -= 1;
    return q;
}
static inline int64_t floormod(int64_t a, int64_t b) {
    int64_t r = a % b;
    if (r != 0 && ((r < 0) != (b < 0))) r += b;
    return r;
}

/* -- gather ------------------------------------------------------------------------------------- */
#define MAX_COLS 64
#define GATHER_PAGE 4096
#define GATHER_AHEAD 2 /* rows */

/* The first line of each 4 KiB page of a row still to copy: /dev/shm maps 4 KiB pages, and the
 * hardware prefetcher stops at each page's end, so without this every page of a random row
 * starts with a TLB walk and a miss that the copy waits for (benchmarks/README.md, "Huge pages") */
static inline void prefetch_pages(const char *row, size_t w) {
    uintptr_t at = (uintptr_t)row, end = at + w;
    __builtin_prefetch(row);
    for (uintptr_t page = (at | (GATHER_PAGE - 1)) + 1; page < end; page += GATHER_PAGE) __builtin_prefetch((const char *)page);
}

/* gather(ids, lanes, stamp, sources, outs, ok): for each id, its slot and expected stamp
 * (ring.py's arithmetic); first stamps (acquire loads); each source column's row at the slot
 * into the same row of its out (each source is (capacity, row bytes), C-contiguous); an acquire
 * fence; second stamps; ok = both equal the expected stamp. ids of any value are safe (an id that
 * names no row, like ring.INVALID, reads as not intact). Returns the smallest id (INT64_MAX for
 * none), for the caller's check against the lanes' last clear(). */
static PyObject *gather(PyObject *self, PyObject *args) {
    PyObject *ids_o, *stamp_o, *src_o, *out_o, *ok_o;
    Py_ssize_t lanes;
    if (!PyArg_ParseTuple(args, "OnOO!O!O", &ids_o, &lanes, &stamp_o, &PyTuple_Type, &src_o, &PyTuple_Type, &out_o, &ok_o))
        return NULL;
    Py_ssize_t ncols = PyTuple_GET_SIZE(src_o);
    if (ncols != PyTuple_GET_SIZE(out_o) || ncols > MAX_COLS) {
        PyErr_SetString(PyExc_ValueError, "gather: expected as many outs as sources (at most 64)");
        return NULL;
    }
    Py_buffer ib, stb, kb, src[MAX_COLS], dst[MAX_COLS];
    Py_ssize_t got = 0;
    PyObject *result = NULL;
    int64_t *slots = NULL, *first = NULL, lowest = INT64_MAX;
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
    size_t total = 0;
    Py_ssize_t width[MAX_COLS];
    for (; got < ncols; got++) {
        if (get_buf(PyTuple_GET_ITEM(src_o, got), &src[got], 0, 0, "gather source") < 0) goto done;
        if (get_buf(PyTuple_GET_ITEM(out_o, got), &dst[got], 1, 0, "gather out") < 0) {
            PyBuffer_Release(&src[got]);
            goto done;
        }
        width[got] = src[got].len / capacity;
        if (src[got].len % capacity || dst[got].len != width[got] * n) {
            PyErr_Format(PyExc_ValueError, "gather: column %zd: expected a source of (capacity, w) bytes and an out of (n, w)", got);
            PyBuffer_Release(&src[got]);
            PyBuffer_Release(&dst[got]);
            goto done;
        }
        total += (size_t)width[got] * (size_t)n;
    }
    slots = (int64_t *)PyMem_Malloc((size_t)(n ? n : 1) * 2 * sizeof(int64_t));
    if (!slots) { PyErr_NoMemory(); goto done; }
    first = slots + (n ? n : 1);
    {
        const int64_t *ids = (const int64_t *)ib.buf;
        int64_t *stamp = (int64_t *)stb.buf;
        char *ok = (char *)kb.buf;
        int64_t lc = capacity / lanes;
        lowest = INT64_MAX;
        PyThreadState *ts = NULL;
        if (total >= NOGIL_BYTES) ts = PyEval_SaveThread();
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t id = ids[i], s;
            if (id < lowest) lowest = id;
            if (lanes == 1) s = floormod(id, lc);
            else s = floormod(id, lanes) * lc + floormod(floordiv(id, lanes), lc);
            slots[i] = s;
            first[i] = __atomic_load_n(&stamp[s], __ATOMIC_ACQUIRE);
            /* the rows are random: ask for their first lines now, so the misses overlap */
            for (Py_ssize_t c = 0; c < ncols; c++) {
                const char *row = (const char *)src[c].buf + (size_t)s * (size_t)width[c];
                __builtin_prefetch(row);
                if (width[c] > 64) __builtin_prefetch(row + 64);
                if (width[c] > 128) __builtin_prefetch(row + 128);
            }
        }
        for (Py_ssize_t c = 0; c < ncols; c++) {
            const char *from = (const char *)src[c].buf;
            char *to = (char *)dst[c].buf;
            size_t w = (size_t)width[c];
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
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t id = ids[i];
            /* 2 * (id // lanes) + 2, wrapping as numpy's int64 does */
            uint64_t row = (uint64_t)(lanes == 1 ? id : floordiv(id, lanes));
            int64_t expected = (int64_t)(row * 2u + 2u);
            int64_t second = __atomic_load_n(&stamp[slots[i]], __ATOMIC_RELAXED);
            ok[i] = first[i] == expected && second == expected;
        }
        if (ts) PyEval_RestoreThread(ts);
    }
    result = PyLong_FromLongLong(lowest);
done:
    for (Py_ssize_t c = 0; c < got; c++) {
        PyBuffer_Release(&src[c]);
        PyBuffer_Release(&dst[c]);
    }
    PyMem_Free(slots);
    PyBuffer_Release(&ib);
    PyBuffer_Release(&stb);
    PyBuffer_Release(&kb);
    return result;
}

/* -- frame stacks (frames.py) ------------------------------------------------------------------- */
#define KIND_END 1   /* frames.END */
#define KIND_START 2 /* frames.START */
#define KIND_ZERO 4  /* frames.ZERO */

/* stacks(win, ok, kind, lanes, stamp, column, k, lasts, outs, valid): frames.stack_plan and the
 * frames' gather in one pass, per transition still valid: for each newest-frame column `last` (one
 * per out), the k frames back from it (chronological in the out, (m, k, frame bytes)): real up to
 * and including the first row that starts an episode, older ones padding (that row's frame, or
 * zeros where it is marked ZERO). A real frame other than the newest must come from an intact
 * window row (ok) that is not an end row, else the transition is not valid. Every frame copied has
 * the stamp check (first stamps acquire, copies, acquire fence, second stamps); a failed one makes
 * its transition not valid. win/ok/kind are (m, W); ids of any value are safe. */
static PyObject *stacks(PyObject *self, PyObject *args) {
    PyObject *win_o, *ok_o, *kind_o, *stamp_o, *col_o, *lasts_o, *outs_o, *valid_o;
    Py_ssize_t lanes, k;
    if (!PyArg_ParseTuple(args, "OOOnOOnO!O!O", &win_o, &ok_o, &kind_o, &lanes, &stamp_o, &col_o, &k,
                          &PyTuple_Type, &lasts_o, &PyTuple_Type, &outs_o, &valid_o))
        return NULL;
    Py_ssize_t nst = PyTuple_GET_SIZE(lasts_o);
    if (nst != PyTuple_GET_SIZE(outs_o) || nst < 1 || nst > 8) {
        PyErr_SetString(PyExc_ValueError, "stacks: expected 1 to 8 lasts and as many outs");
        return NULL;
    }
    Py_buffer wb, ob, kb, stb, cb, vb, dst[8];
    Py_ssize_t nbuf = 0, got = 0;
    PyObject *result = NULL;
    int64_t *slots = NULL, *firsts = NULL, *rowids = NULL;
    Py_ssize_t last[8];
    Py_buffer *bufs[6] = {&wb, &ob, &kb, &stb, &cb, &vb};
    if (get_buf(win_o, &wb, 0, 8, "win") < 0) goto done;
    nbuf++;
    if (get_buf(ok_o, &ob, 0, 1, "ok") < 0) goto done;
    nbuf++;
    if (get_buf(kind_o, &kb, 0, 1, "kind") < 0) goto done;
    nbuf++;
    if (get_buf(stamp_o, &stb, 0, 8, "stamp") < 0) goto done;
    nbuf++;
    if (get_buf(col_o, &cb, 0, 0, "column") < 0) goto done;
    nbuf++;
    if (get_buf(valid_o, &vb, 1, 1, "valid") < 0) goto done;
    nbuf++;
    Py_ssize_t m = vb.len, capacity = stb.len / 8;
    if (lanes <= 0 || capacity <= 0 || capacity % lanes || cb.len % capacity || k < 1) {
        PyErr_SetString(PyExc_ValueError, "stacks: lanes must divide a positive capacity, the column be (capacity, w), k >= 1");
        goto done;
    }
    Py_ssize_t w = cb.len / capacity;
    Py_ssize_t width = m ? wb.len / 8 / m : 0;
    if (wb.len != m * width * 8 || ob.len != m * width || kb.len != m * width || (m && width < 1)) {
        PyErr_SetString(PyExc_ValueError, "stacks: win, ok and kind must be (m, W) with m = len(valid)");
        goto done;
    }
    for (Py_ssize_t t = 0; t < nst; t++) {
        last[t] = PyLong_AsSsize_t(PyTuple_GET_ITEM(lasts_o, t));
        if (last[t] == -1 && PyErr_Occurred()) goto done;
        if (last[t] < k - 1 || last[t] >= width) {
            PyErr_Format(PyExc_ValueError, "stacks: last %zd: expected a window column in [k - 1, W)", last[t]);
            goto done;
        }
    }
    for (; got < nst; got++) {
        if (get_buf(PyTuple_GET_ITEM(outs_o, got), &dst[got], 1, 0, "stacks out") < 0) goto done;
        if (dst[got].len != m * k * w) {
            PyErr_Format(PyExc_ValueError, "stacks: out %zd: expected (m, k, w) bytes", got);
            PyBuffer_Release(&dst[got]);
            goto done;
        }
    }
    size_t most = (size_t)(m ? m : 1) * (size_t)k * (size_t)nst;
    slots = (int64_t *)PyMem_Malloc(most * 3 * sizeof(int64_t));
    if (!slots) { PyErr_NoMemory(); goto done; }
    firsts = slots + most;
    rowids = firsts + most;
    {
        const int64_t *win = (const int64_t *)wb.buf;
        const char *ok = (const char *)ob.buf;
        const uint8_t *kind = (const uint8_t *)kb.buf;
        int64_t *stamp = (int64_t *)stb.buf;
        const char *from = (const char *)cb.buf;
        char *valid = (char *)vb.buf;
        int64_t lc = capacity / lanes;
        Py_ssize_t copied = 0;
        int64_t *owner = (int64_t *)PyMem_Malloc((most + 2 * (size_t)k) * sizeof(int64_t)); /* the transition of each copy */
        if (!owner) { PyErr_NoMemory(); goto done; }
        int64_t *psl = owner + most, *pid = psl + k; /* one stack's plan: slots and ids by position */
        PyThreadState *ts = NULL;
        if ((size_t)m * (size_t)k * (size_t)nst * (size_t)w >= NOGIL_BYTES) ts = PyEval_SaveThread();
        for (Py_ssize_t i = 0; i < m; i++) {
            if (!valid[i]) continue;
            const int64_t *wi = win + i * width;
            const char *oki = ok + i * width;
            const uint8_t *ki = kind + i * width;
            for (Py_ssize_t t = 0; t < nst && valid[i]; t++) {
                char *to = (char *)dst[t].buf + (size_t)i * (size_t)k * (size_t)w;
                Py_ssize_t first = last[t];
                int started = 0;
                /* the plan, newest frame first: each chronological position's slot (-1: zeros) */
                for (Py_ssize_t j = 0; j < k; j++) { /* j frames back from the newest */
                    Py_ssize_t col = last[t] - j, p = k - 1 - j;
                    if (!started && j && (!oki[col] || (ki[col] & KIND_END))) { valid[i] = 0; break; }
                    Py_ssize_t use = started ? first : col;
                    if (started && (ki[first] & KIND_ZERO)) { psl[p] = -1; }
                    else {
                        int64_t id = wi[use];
                        pid[p] = id;
                        if (lanes == 1) psl[p] = floormod(id, lc);
                        else psl[p] = floormod(id, lanes) * lc + floormod(floordiv(id, lanes), lc);
                    }
                    if (!started && (ki[col] & KIND_START)) { started = 1; first = col; }
                }
                if (!valid[i]) break;
                /* the copies, oldest first: frames of consecutive slots (a stack within its lane)
                 * are one copy, read forward as a whole row is (measured: faster than frame by
                 * frame, newest first) */
                for (Py_ssize_t p = 0; p < k;) {
                    if (psl[p] < 0) { memset(to + (size_t)p * (size_t)w, 0, (size_t)w); p++; continue; }
                    Py_ssize_t q = p + 1;
                    while (q < k && psl[q] == psl[q - 1] + 1) q++;
                    for (Py_ssize_t r = p; r < q; r++) {
                        firsts[copied] = __atomic_load_n(&stamp[psl[r]], __ATOMIC_ACQUIRE);
                        slots[copied] = psl[r];
                        rowids[copied] = pid[r];
                        owner[copied] = i;
                        copied++;
                    }
                    memcpy(to + (size_t)p * (size_t)w, from + (size_t)psl[p] * (size_t)w, (size_t)(q - p) * (size_t)w);
                    p = q;
                }
            }
        }
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        for (Py_ssize_t c = 0; c < copied; c++) {
            uint64_t row = (uint64_t)(lanes == 1 ? rowids[c] : floordiv(rowids[c], lanes));
            int64_t expected = (int64_t)(row * 2u + 2u);
            int64_t second = __atomic_load_n(&stamp[slots[c]], __ATOMIC_RELAXED);
            if (firsts[c] != expected || second != expected) valid[owner[c]] = 0;
        }
        if (ts) PyEval_RestoreThread(ts);
        PyMem_Free(owner);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    for (Py_ssize_t c = 0; c < got; c++) PyBuffer_Release(&dst[c]);
    for (Py_ssize_t b = 0; b < nbuf; b++) PyBuffer_Release(bufs[b]);
    PyMem_Free(slots);
    return result;
}

/* -- prioritized replay: a draw, its weights, an update's checks ---------------------------------- */
#define LANE_WORDS 8 /* layout._lanes: (lanes, 8) int64, [l, 0] the cursor, [l, 1] the base */
#define INVALID_ID (-((int64_t)1 << 62)) /* ring.INVALID */

/* lane_start(cursors, l, lc): ring.lane_bounds's first row of lane l: min(max(base, cur - lc), cur) */
static inline int64_t lane_start(const int64_t *cur, Py_ssize_t l, int64_t lc) {
    int64_t c = __atomic_load_n(&cur[LANE_WORDS * l + 0], __ATOMIC_ACQUIRE);
    int64_t b = __atomic_load_n(&cur[LANE_WORDS * l + 1], __ATOMIC_ACQUIRE);
    int64_t s = (int64_t)((uint64_t)c - (uint64_t)lc); /* numpy's int64 arithmetic wraps */
    if (b > s) s = b;
    return s < c ? s : c;
}

/* cursors: the (lanes, 8) int64 _lanes column, lanes >= 1 dividing capacity (0: error set) */
static Py_ssize_t lanes_of(const Py_buffer *cb, Py_ssize_t capacity, const char *what) {
    Py_ssize_t lanes = cb->len / (LANE_WORDS * 8);
    if (lanes <= 0 || cb->len % (LANE_WORDS * 8) || capacity <= 0 || capacity % lanes) {
        PyErr_Format(PyExc_ValueError, "%s: expected a (lanes, 8) int64 cursor array with lanes dividing the capacity", what);
        return 0;
    }
    return lanes;
}

/* tree_draw(sums, plan, capacity, total, u, stratified, stamp, cursors, slots, leaves, ids):
 * samplers.tree_draw after its rng.random(k) (u, k uniform floats in [0, 1); total, the tree's
 * total the caller read, > 0): the masses (stratified: (u_i + i) * (total / k), else
 * u_i * total, numpy's operations in numpy's order), find's slots, their leaves and
 * Ring.ids_of_slots(slots, leaves > 0): the id each slot's stamp names, INVALID where the slot is
 * empty, being written, older than its lane's bounds or on a leaf of 0. The tree and the stamps
 * are read without a lock, as the Python path reads them. */
static PyObject *tree_draw(PyObject *self, PyObject *args) {
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
        Plan p;
        if (read_plan(plan_o, capacity, b[0].len / 8, &p) < 0) goto done;
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
        const int64_t *stamp = (const int64_t *)b[2].buf, *cur = (const int64_t *)b[3].buf;
        int64_t lc = ring / lanes;
        find_core(sums, &p, capacity, x, slots, n);
        for (Py_ssize_t i = 0; i < n; i++) {
            leaves[i] = sums[slots[i]];
            ids[i] = __atomic_load_n(&stamp[slots[i]], __ATOMIC_ACQUIRE); /* the stamps first, then the bounds */
        }
        int64_t start0 = lanes == 1 ? lane_start(cur, 0, lc) : 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t s = ids[i], row = floordiv(s, 2) - 1, lane = lanes == 1 ? 0 : slots[i] / lc;
            int64_t start = lanes == 1 ? start0 : lane_start(cur, lane, lc);
            int bad = s <= 0 || (s & 1) || row < start || !(leaves[i] > 0);
            ids[i] = bad ? INVALID_ID : (int64_t)((uint64_t)row * (uint64_t)lanes + (uint64_t)lane);
        }
        result = Py_None;
        Py_INCREF(result);
    }
done:
    PyMem_Free(x);
    for (int i = 0; i < held; i++) PyBuffer_Release(&b[i]);
    return result;
}

/* weights(mins, plan, capacity, leaves, beta, out): Prioritized.weights into out (float32):
 * (max(leaf, low) / low) ** -beta with low the tree's min (SumTree.min), or 1 where the tree
 * has no positive leaf. pow here is the C library's, numpy's may be a vectorized one: float64
 * results can differ in the last bit, so the float32 weights agree to 1 ulp (tests/test_native.py). */
static PyObject *weights(PyObject *self, PyObject *args) {
    PyObject *mins_o, *plan_o, *leaves_o, *out_o;
    Py_ssize_t capacity;
    double beta;
    if (!PyArg_ParseTuple(args, "OOnOdO", &mins_o, &plan_o, &capacity, &leaves_o, &beta, &out_o)) return NULL;
    Py_buffer mb, lb, ob;
    if (get_buf(mins_o, &mb, 0, 8, "mins") < 0) return NULL;
    if (get_buf(leaves_o, &lb, 0, 8, "leaves") < 0) { PyBuffer_Release(&mb); return NULL; }
    if (get_buf(out_o, &ob, 1, 4, "out") < 0) { PyBuffer_Release(&mb); PyBuffer_Release(&lb); return NULL; }
    PyObject *result = NULL;
    Plan p;
    if (read_plan(plan_o, capacity, mb.len / 8, &p) < 0) goto done;
    Py_ssize_t n = lb.len / 8;
    if (ob.len / 4 != n) {
        PyErr_SetString(PyExc_ValueError, "weights: expected one float32 out per leaf");
        goto done;
    }
    {
        const double *top = (const double *)mb.buf + p.at[p.n - 1], *leaves = (const double *)lb.buf;
        float *out = (float *)ob.buf;
        /* numpy's min (NaN wins) of the top level, in 4 independent chains: one chain of 3907
         * dependent compares cost ~10 us, about all of a weights call for 256 leaves */
        Py_ssize_t m = p.len[p.n - 1], j = 0;
        double lo[4] = {top[0], top[0], top[0], top[0]};
        int nan = 0;
#ifdef __SSE2__
        /* two at a time: minpd is `v < lo ? v : lo`, the comparison below; cmpunordpd finds NaN
         * (the scalar loop did about one node a cycle: 1.5 us of a 1.8 us call for 256 leaves) */
        {
            __m128d l0 = _mm_set1_pd(top[0]), l1 = l0, l2 = l0, l3 = l0, bad = _mm_setzero_pd();
            for (; j + 8 <= m; j += 8) {
                __m128d v0 = _mm_loadu_pd(top + j), v1 = _mm_loadu_pd(top + j + 2);
                __m128d v2 = _mm_loadu_pd(top + j + 4), v3 = _mm_loadu_pd(top + j + 6);
                bad = _mm_or_pd(bad, _mm_or_pd(_mm_or_pd(_mm_cmpunord_pd(v0, v0), _mm_cmpunord_pd(v1, v1)),
                                               _mm_or_pd(_mm_cmpunord_pd(v2, v2), _mm_cmpunord_pd(v3, v3))));
                l0 = _mm_min_pd(v0, l0);
                l1 = _mm_min_pd(v1, l1);
                l2 = _mm_min_pd(v2, l2);
                l3 = _mm_min_pd(v3, l3);
            }
            nan |= _mm_movemask_pd(bad) != 0;
            double pair[8];
            _mm_storeu_pd(pair, l0);
            _mm_storeu_pd(pair + 2, l1);
            _mm_storeu_pd(pair + 4, l2);
            _mm_storeu_pd(pair + 6, l3);
            for (int q = 0; q < 8; q++) lo[q % 4] = pair[q] < lo[q % 4] ? pair[q] : lo[q % 4];
        }
#endif
        for (; j + 4 <= m; j += 4) {
            for (int q = 0; q < 4; q++) {
                double v = top[j + q];
                nan |= v != v;
                lo[q] = v < lo[q] ? v : lo[q];
            }
        }
        for (; j < m; j++) {
            nan |= top[j] != top[j];
            lo[0] = top[j] < lo[0] ? top[j] : lo[0];
        }
        double low = lo[0];
        for (int q = 1; q < 4; q++) low = lo[q] < low ? lo[q] : low;
        if (nan || !isfinite(low) || low <= 0) {
            for (Py_ssize_t i = 0; i < n; i++) out[i] = 1.0f;
        } else {
            for (Py_ssize_t i = 0; i < n; i++) {
                double l = leaves[i];
                if (!(l >= low) && !isnan(l)) l = low; /* np.maximum: NaN propagates */
                out[i] = (float)pow(l / low, -beta);
            }
        }
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&mb);
    PyBuffer_Release(&lb);
    PyBuffer_Release(&ob);
    return result;
}

/* scan(values) -> float: the largest of values (float64) when every one is finite and >= 0
 * (0.0 for none), else -1.0 (the caller's checks say which are not). */
static PyObject *scan(PyObject *self, PyObject *arg) {
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

/* known(ids, cursors) -> bool: Ring.check_ids's test, every id >= 0 and its row number
 * id // lanes below its lane's cursor (False: the caller finds which and raises). */
static PyObject *known(PyObject *self, PyObject *args) {
    PyObject *ids_o, *cur_o;
    if (!PyArg_ParseTuple(args, "OO", &ids_o, &cur_o)) return NULL;
    Py_buffer ib, cb;
    if (get_buf(ids_o, &ib, 0, 8, "ids") < 0) return NULL;
    if (get_buf(cur_o, &cb, 0, 8, "cursors") < 0) { PyBuffer_Release(&ib); return NULL; }
    PyObject *result = NULL;
    Py_ssize_t lanes = cb.len / (LANE_WORDS * 8);
    if (lanes <= 0 || cb.len % (LANE_WORDS * 8)) {
        PyErr_SetString(PyExc_ValueError, "known: expected a (lanes, 8) int64 cursor array");
        goto done;
    }
    {
        const int64_t *ids = (const int64_t *)ib.buf, *cur = (const int64_t *)cb.buf;
        Py_ssize_t n = ib.len / 8;
        int ok = 1;
        for (Py_ssize_t i = 0; i < n && ok; i++) {
            int64_t id = ids[i];
            if (id < 0) { ok = 0; break; }
            int64_t lane = lanes == 1 ? 0 : id % lanes, row = lanes == 1 ? id : id / lanes;
            ok = row < __atomic_load_n(&cur[LANE_WORDS * lane], __ATOMIC_ACQUIRE);
        }
        result = ok ? Py_True : Py_False;
        Py_INCREF(result);
    }
done:
    PyBuffer_Release(&ib);
    PyBuffer_Release(&cb);
    return result;
}

/* current(ids, stamp, cursors, ok): Ring.current into ok (bool): each id's slot holds its
 * committed stamp 2 (id // lanes) + 2 and the row is not older than its lane's base (clear()).
 * Ids of any value are safe (as in gather). */
static PyObject *current(PyObject *self, PyObject *args) {
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
        int64_t lc = capacity / lanes;
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t id = ids[i], lane = lanes == 1 ? 0 : floormod(id, lanes), row = lanes == 1 ? id : floordiv(id, lanes);
            int64_t s = lane * lc + floormod(row, lc);
            int64_t expected = (int64_t)((uint64_t)row * 2u + 2u);
            ok[i] = __atomic_load_n(&stamp[s], __ATOMIC_ACQUIRE) == expected &&
                    row >= __atomic_load_n(&cur[LANE_WORDS * lane + 1], __ATOMIC_ACQUIRE);
        }
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

#define LOCK_REPAIR 56 /* byte offset of the repair word in lock.py's 64-byte mutex column */

/* lock.py's robust mutex, only tried (the C lockers never wait, so no Python code runs under it):
 * 1 held, with no repair owed; 0 not taken: busy (or held by this thread), a repair owed, or its
 * holder died inside its critical section, whose repairs are Python's (ring.py): then they are
 * owed to the next locker (the repair word), which lock.py makes run them first */
static int try_lock(void *lock) {
    pthread_mutex_t *mutex = (pthread_mutex_t *)lock;
    int64_t *repair = (int64_t *)((char *)lock + LOCK_REPAIR);
    int rc = pthread_mutex_trylock(mutex);
    if (rc == EOWNERDEAD) {
        __atomic_store_n(repair, 1, __ATOMIC_RELEASE);
        pthread_mutex_consistent(mutex);
        pthread_mutex_unlock(mutex);
        return 0;
    }
    if (rc) return 0;
    if (__atomic_load_n(repair, __ATOMIC_ACQUIRE)) {
        pthread_mutex_unlock(mutex);
        return 0;
    }
    return 1;
}

/* update_priorities(lock, ids, priorities, leaves, stamp, cursors, sums, mins, plan, capacity, prio)
 * -> live count, or None with nothing changed: ReplayBuffer.update_priorities in one call, for a
 * buffer without max_use, given priorities the caller checked (finite, >= 0, leaves below
 * MAX_LEAF) and their leaves (numpy's (p + eps) ** alpha: the tree then holds what the Python
 * path writes, to the bit). Before the lock: every id known (Ring.check_ids), else None (the
 * Python path raises). The lock is only tried: None when it is busy, held by this thread, owes
 * repairs, or its holder died (as push: its repairs are owed to the next locker, lock.py). Under
 * it, and running no Python code: the ids still current (Ring.current) set their slots' leaves in
 * order (the last of a repeated slot wins) and the largest priority (prio[0]) takes the largest
 * of theirs. */
static PyObject *update_priorities(PyObject *self, PyObject *args) {
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
    {
        Plan p;
        if (read_plan(plan_o, capacity, b[6].len / 8, &p) < 0) goto done;
        Py_ssize_t n = b[1].len / 8, ring = b[4].len / 8;
        if (b[0].len < 64 || ((uintptr_t)b[0].buf & 7) || b[2].len / 8 != n || b[3].len / 8 != n ||
            b[7].len != b[6].len || ring != capacity || b[8].len < 8) {
            PyErr_SetString(PyExc_ValueError,
                            "update_priorities: expected a 64-byte lock, one priority and leaf per id, a stamp per "
                            "slot of the tree, mins as long as sums and a largest priority");
            goto done;
        }
        Py_ssize_t lanes = lanes_of(&b[5], ring, "update_priorities");
        if (!lanes) goto done;
        const int64_t *ids = (const int64_t *)b[1].buf, *stamp = (const int64_t *)b[4].buf, *cur = (const int64_t *)b[5].buf;
        const double *prios = (const double *)b[2].buf, *leaves = (const double *)b[3].buf;
        int64_t lc = ring / lanes;
        for (Py_ssize_t i = 0; i < n; i++) { /* Ring.check_ids: an id that never named a row is the caller's bug */
            int64_t id = ids[i];
            if (id < 0 || (lanes == 1 ? id : id / lanes) >= __atomic_load_n(&cur[LANE_WORDS * (lanes == 1 ? 0 : id % lanes)], __ATOMIC_ACQUIRE)) {
                result = Py_None;
                Py_INCREF(result);
                goto done;
            }
        }
        /* the live slots, then their leaves */
        live = (int64_t *)PyMem_Malloc((size_t)(n ? n : 1) * (sizeof(int64_t) + sizeof(double)));
        if (!live) { PyErr_NoMemory(); goto done; }
        double *values = (double *)(live + (n ? n : 1));
        pthread_mutex_t *mutex = (pthread_mutex_t *)b[0].buf;
        if (!try_lock(mutex)) {
            result = Py_None;
            Py_INCREF(result);
            goto done;
        }
        Py_ssize_t m = 0;
        double most = 0.0;
        for (Py_ssize_t i = 0; i < n; i++) { /* Ring.current: committed, and not older than a clear() */
            int64_t id = ids[i], lane = lanes == 1 ? 0 : id % lanes, row = lanes == 1 ? id : id / lanes;
            int64_t s = lane * lc + row % lc;
            if (__atomic_load_n(&stamp[s], __ATOMIC_ACQUIRE) == (int64_t)((uint64_t)row * 2u + 2u) &&
                row >= __atomic_load_n(&cur[LANE_WORDS * lane + 1], __ATOMIC_ACQUIRE)) {
                live[m] = s;
                values[m++] = leaves[i];
                if (prios[i] > most) most = prios[i];
            }
        }
        update_core((double *)b[6].buf, (double *)b[7].buf, &p, live, values, 0.0, m);
        double *top = (double *)b[8].buf;
        if (m && most > top[0]) top[0] = most; /* Priorities.set_rows: max(prio[0], the largest) */
        pthread_mutex_unlock(mutex);
        result = PyLong_FromSsize_t(m);
    }
done:
    PyMem_Free(live);
    for (int i = 0; i < held; i++) PyBuffer_Release(&b[i]);
    return result;
}

/* -- push ---------------------------------------------------------------------------------------- */
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

/* A push's copies: source c (k rows of w bytes, C-contiguous) into target c (a (capacity, row
 * bytes) column, C-contiguous) at byte offset c of each row. copies_open checks everything before
 * anything is copied: 1 ready, 0 a source needs a cast or a contiguous copy (formats: a tuple of
 * buffer format strings, or None; the caller casts), -1 an error raised. */
typedef struct {
    Py_ssize_t n;
    char *to[MAX_COLS];         /* each target's first row, at the field's offset */
    const char *from[MAX_COLS]; /* each source's k rows */
    Py_ssize_t width[MAX_COLS], row[MAX_COLS];
    size_t total;
    Py_buffer src[MAX_COLS], dst[MAX_COLS]; /* copies_open's views, released by copies_close */
} Copies;

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

/* the copies into the k slots (`slots`, or `first` and the k - 1 after it); no Python calls */
static void copies_run(const Copies *c, Py_ssize_t k, const int64_t *slots, int64_t first) {
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

/* each slot's stamp from odd to even with a release store: the copies become visible first */
static void commit_slots(int64_t *stamp, Py_ssize_t k, const int64_t *slots, int64_t first) {
    for (Py_ssize_t i = 0; i < k; i++) {
        int64_t st = __atomic_load_n(&stamp[SLOT(i)], __ATOMIC_RELAXED);
        __atomic_store_n(&stamp[SLOT(i)], st + 1, __ATOMIC_RELEASE);
    }
}

/* put(where, k, stamp, targets, offsets, formats, sources, commit) -> bool: the copies (Copies)
 * into the k slots of `where` (the first of consecutive slots, or k int64 slots); then, with
 * commit, commit_slots. False (nothing copied) when a source needs a cast; bad sizes raise. */
static PyObject *put(PyObject *self, PyObject *args) {
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

/* -- the one-call push ----------------------------------------------------------------------------
 * plan(...) -> capsule: what a push writes, once per buffer (ring.Copier): the ring's lock,
 * cursors, counters, stamps, owners and writer table, this process's writer entry (`me`, int64
 * [pid, entry], kept by Ring.writer_id), each field's name, format, shape, target column and
 * offset, the episode column, envs. Its views stay held until the capsule goes (buffer.close
 * drops it first).
 *
 * push(plan, data, lane, episode) -> ids or None: a whole push as one call, for the usual case:
 * the fast checks (check below), the lanes, the reservation under the tried lock (lock.py's
 * robust mutex; its word at LOCK_REPAIR names a repair still owed), the copies (casting float64
 * to float32 and Python numbers where Schema.validate would, with the same bytes), the commit.
 * No Python code runs from the rows turning odd to their commit, so no signal handler can come
 * between. None, with nothing changed, wherever Python must decide or explain: anything the fast
 * checks do not take (validate raises or casts), a lane out of range or a lane too full, a missing
 * or unwanted episode, a push whose episode ids could show a vector env pushed into one lane
 * (edits.note_interleaving), this process not registered as a writer, the lock busy, a repair
 * owed, frozen, a slot odd. */
#define MAX_DIMS 16
static pid_t my_pid; /* this process's pid, renewed in a forked child: no system call per push */
static void after_fork(void) { my_pid = getpid(); }

typedef struct {
    Py_buffer lock, cur, stats, stamp, owner, writers, me, episode;
    int has_episode, held, closed, busy; /* closed: plan_close was called; busy: pushes in flight */
    pid_t busy_pid;                     /* the process whose pushes `busy` counts (not a forked child: none in flight there) */
    Py_ssize_t n_dst;                   /* target views held (0 once released) */
    Py_ssize_t n, lanes, capacity, lc, envs, frozen_at, inserted_at;
    PyObject *names[MAX_COLS];
    char *format[MAX_COLS];
    Py_buffer dst[MAX_COLS];
    Py_ssize_t offset[MAX_COLS], width[MAX_COLS], row[MAX_COLS], ndim[MAX_COLS], shape[MAX_COLS][MAX_DIMS];
    PyObject *empty, *int64;
    PyObject *block, *table; /* the ring.Block and its field table the plan was made for (push_call) */
} PushPlan;

static void plan_release(PushPlan *p) {
    Py_buffer *views[8] = {&p->lock, &p->cur, &p->stats, &p->stamp, &p->owner, &p->writers, &p->me, &p->episode};
    for (int i = 0; i < p->held && i < 8; i++) PyBuffer_Release(views[i]);
    p->held = 0;
    for (Py_ssize_t g = 0; g < p->n_dst; g++) PyBuffer_Release(&p->dst[g]);
    p->n_dst = 0;
    Py_CLEAR(p->block);
    Py_CLEAR(p->table);
    p->closed = 1;
}

static void plan_free(PushPlan *p) {
    if (p->held || p->n_dst || p->block) plan_release(p);
    for (Py_ssize_t g = 0; g < p->n; g++) {
        Py_XDECREF(p->names[g]);
        PyMem_Free(p->format[g]);
    }
    Py_XDECREF(p->empty);
    Py_XDECREF(p->int64);
    PyMem_Free(p);
}

static void plan_capsule_free(PyObject *capsule) { plan_free((PushPlan *)PyCapsule_GetPointer(capsule, "shmbuffer.plan")); }

/* plan(lock, cursors, stats, stamp, owner, writers, me, frozen, inserted, names, formats, shapes,
 *      widths, targets, offsets, episode, envs, empty, int64, block, table) -> capsule */
static PyObject *plan(PyObject *self, PyObject *args) {
    PyObject *lock_o, *cur_o, *stats_o, *stamp_o, *owner_o, *writers_o, *me_o, *names_o, *fmts_o, *shapes_o, *widths_o,
        *dst_o, *off_o, *episode_o, *empty_o, *int64_o, *block_o, *table_o;
    Py_ssize_t frozen_at, inserted_at, envs;
    if (!PyArg_ParseTuple(args, "OOOOOOOnnO!O!O!O!O!O!OnOOOO", &lock_o, &cur_o, &stats_o, &stamp_o, &owner_o, &writers_o,
                          &me_o, &frozen_at, &inserted_at, &PyTuple_Type, &names_o, &PyTuple_Type, &fmts_o, &PyTuple_Type,
                          &shapes_o, &PyTuple_Type, &widths_o, &PyTuple_Type, &dst_o, &PyTuple_Type, &off_o, &episode_o,
                          &envs, &empty_o, &int64_o, &block_o, &table_o))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(names_o);
    if (n < 1 || n > MAX_COLS || PyTuple_GET_SIZE(fmts_o) != n || PyTuple_GET_SIZE(shapes_o) != n ||
        PyTuple_GET_SIZE(widths_o) != n || PyTuple_GET_SIZE(dst_o) != n || PyTuple_GET_SIZE(off_o) != n) {
        PyErr_SetString(PyExc_ValueError, "plan: expected 1 to 64 fields, each with a format, shape, width, target and offset");
        return NULL;
    }
    PushPlan *p = (PushPlan *)PyMem_Calloc(1, sizeof(PushPlan));
    if (!p) return PyErr_NoMemory();
    struct { PyObject *o; Py_buffer *v; Py_ssize_t item; const char *what; } views[8] = {
        {lock_o, &p->lock, 0, "lock"}, {cur_o, &p->cur, 8, "cursors"}, {stats_o, &p->stats, 8, "stats"},
        {stamp_o, &p->stamp, 8, "stamp"}, {owner_o, &p->owner, 2, "owner"}, {writers_o, &p->writers, 8, "writers"},
        {me_o, &p->me, 8, "me"}, {episode_o, &p->episode, 8, "episode"}};
    p->has_episode = episode_o != Py_None;
    for (int i = 0; i < (p->has_episode ? 8 : 7); i++) {
        if (get_buf(views[i].o, views[i].v, 1, views[i].item, views[i].what) < 0) goto fail;
        p->held = i + 1;
    }
    p->capacity = p->stamp.len / 8;
    p->lanes = lanes_of(&p->cur, p->capacity, "plan");
    if (!p->lanes) goto fail;
    p->lc = p->capacity / p->lanes;
    if (p->lock.len < 64 || ((uintptr_t)p->lock.buf & 7) || p->owner.len / 2 != p->capacity || p->me.len != 16 ||
        p->writers.len < 8 || p->writers.len / 8 > 65536 || (p->has_episode && p->episode.len / 8 != p->capacity) ||
        frozen_at < 0 || inserted_at < 0 || frozen_at >= p->stats.len / 8 || inserted_at >= p->stats.len / 8 || envs < 0 ||
        (envs && p->lanes != envs)) {
        PyErr_SetString(PyExc_ValueError, "plan: lock, owners, writers, me, episodes, counters or envs do not fit the ring");
        goto fail;
    }
    p->frozen_at = frozen_at;
    p->inserted_at = inserted_at;
    p->envs = envs;
    for (Py_ssize_t g = 0; g < n; g++) {
        PyObject *name = PyTuple_GET_ITEM(names_o, g), *fmt = PyTuple_GET_ITEM(fmts_o, g), *shape = PyTuple_GET_ITEM(shapes_o, g);
        if (!PyUnicode_Check(name) || !PyBytes_Check(fmt) || !PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) > MAX_DIMS) {
            PyErr_SetString(PyExc_TypeError, "plan: names are str, formats bytes, shapes tuples of at most 16 ints");
            goto fail;
        }
        if (get_buf(PyTuple_GET_ITEM(dst_o, g), &p->dst[g], 1, 0, "plan target") < 0) goto fail;
        p->n = p->n_dst = g + 1;
        Py_INCREF(name);
        p->names[g] = name;
        Py_ssize_t flen = PyBytes_GET_SIZE(fmt);
        p->format[g] = (char *)PyMem_Malloc((size_t)flen + 1);
        if (!p->format[g]) { PyErr_NoMemory(); goto fail; }
        memcpy(p->format[g], PyBytes_AS_STRING(fmt), (size_t)flen + 1);
        p->ndim[g] = PyTuple_GET_SIZE(shape);
        for (Py_ssize_t j = 0; j < p->ndim[g]; j++) {
            p->shape[g][j] = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, j));
            if (p->shape[g][j] < 0) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "plan: a negative dimension");
                goto fail;
            }
        }
        p->offset[g] = PyLong_AsSsize_t(PyTuple_GET_ITEM(off_o, g));
        p->width[g] = PyLong_AsSsize_t(PyTuple_GET_ITEM(widths_o, g));
        if (PyErr_Occurred()) goto fail;
        p->row[g] = p->dst[g].len / p->capacity;
        if (p->dst[g].len % p->capacity || p->offset[g] < 0 || p->width[g] < 0 || p->offset[g] + p->width[g] > p->row[g]) {
            PyErr_Format(PyExc_ValueError, "plan: field %zd: expected a target of (capacity, row) bytes with offset + width <= row", g);
            goto fail;
        }
    }
    Py_INCREF(empty_o);
    p->empty = empty_o;
    Py_INCREF(int64_o);
    p->int64 = int64_o;
    Py_INCREF(block_o);
    p->block = block_o;
    Py_INCREF(table_o);
    p->table = table_o;
    PyObject *capsule = PyCapsule_New(p, "shmbuffer.plan", plan_capsule_free);
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
static PyObject *plan_close(PyObject *self, PyObject *capsule) {
    PushPlan *p = (PushPlan *)PyCapsule_GetPointer(capsule, "shmbuffer.plan");
    if (!p) return NULL;
    p->closed = 1;
    if (!p->busy || p->busy_pid != my_pid) plan_release(p);
    Py_RETURN_NONE;
}

/* one field's value as rows, checked against the plan without touching anything */
typedef struct {
    Py_buffer view;
    int held, convert; /* convert: 0 none, 1 float64 -> float32, 2 float32 -> float64 */
    int reshaped;      /* cpprb's rule took it (a scalar or (k,) for a (1,) field): not as validate returns it */
    union { double d; float f; int64_t q; uint64_t u; char c[8]; } scalar;
} Source;

/* a Python number into a scalar field of format f (one char): 1 ok, 0 not taken here
 * (Schema.validate casts it or explains) */
static int number(PyObject *v, const char *f, Source *s) {
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

/* field g's value: 1 with s filled (*one: a single row without a leading dimension, *k rows),
 * 0 not taken here, -1 an error raised */
static int source(const PushPlan *p, Py_ssize_t g, PyObject *v, Source *s, int *one, Py_ssize_t *k) {
    s->held = s->convert = s->reshaped = 0;
    Py_ssize_t m = p->ndim[g];
    int cpprb = m == 1 && p->shape[g][0] == 1; /* cpprb's default shape (1,): a scalar is one row, (k,) k rows */
    if (PyBytes_Check(v)) return 0; /* numpy makes it one string, which validate refuses */
    if (!PyObject_CheckBuffer(v)) {
        if ((m != 0 && !cpprb) || !number(v, p->format[g], s)) return 0;
        *one = 1;
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
        *one = b->ndim == 0 || b->shape[0] == 1;
        *k = b->ndim == 0 ? 1 : b->shape[0];
    } else if (b->ndim == m || b->ndim == m + 1) {
        lead = b->ndim - m;
        for (Py_ssize_t j = 0; j < m; j++)
            if (b->shape[lead + j] != p->shape[g][j]) return 0;
        *one = lead == 0;
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
        int one = 0;
        Py_ssize_t kk = 0;
        int got = source(p, g, vals[g], &src[g], &one, &kk);
        *opened = g + 1;
        if (got <= 0) return got;
        if (k < 0) {
            k = kk;
            *single = one;
        } else if (k != kk || *single != one) {
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

/* check(plan, data) -> (k, single) or None: push's checks of the fields without any cast, for
 * the steps in edits.py (a prioritized push, a rate-limited one) */
static PyObject *check(PyObject *self, PyObject *args) {
    PyObject *capsule, *data;
    if (!PyArg_ParseTuple(args, "OO", &capsule, &data)) return NULL;
    PushPlan *p = (PushPlan *)PyCapsule_GetPointer(capsule, "shmbuffer.plan");
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

static PyObject *push_held(const PushPlan *p, PyObject *const *vals, PyObject *lane_o, PyObject *episode_o);

/* the push of the field values `vals` (see above): the ids, None, or NULL with an error set */
static PyObject *push_rows(PushPlan *p, PyObject *const *vals, PyObject *lane_o, PyObject *episode_o) {
    if (p->closed) Py_RETURN_NONE;
    if (p->busy_pid != my_pid) { /* the first push here, or in a forked child: none in flight */
        p->busy = 0;
        p->busy_pid = my_pid;
    }
    p->busy++; /* (the GIL is held here: only a copy without it lets plan_close run meanwhile) */
    PyObject *got = push_held(p, vals, lane_o, episode_o);
    if (--p->busy == 0 && p->closed && p->n_dst) plan_release(p); /* closed meanwhile: ours to release */
    return got;
}

/* push_rows with the plan's views held */
static PyObject *push_held(const PushPlan *p, PyObject *const *vals, PyObject *lane_o, PyObject *episode_o) {
    const int64_t *me = (const int64_t *)p->me.buf, *writers = (const int64_t *)p->writers.buf;
    if (me[0] != (int64_t)my_pid || me[1] < 0 || me[1] >= p->writers.len / 8 ||
        __atomic_load_n(&writers[me[1]], __ATOMIC_RELAXED) != me[0])
        Py_RETURN_NONE; /* not registered (or a forked child): Ring.writer_id first */
    Source src[MAX_COLS];
    Py_buffer lb, eb;
    int lane_held = 0, ep_held = 0, single = 0;
    int64_t *slots = NULL, *scratch = NULL;
    PyObject *ids_o = NULL, *result = NULL;
    Py_ssize_t opened = 0, k = sources_open(p, vals, src, &opened, &single);
    if (k <= 0) goto done;
    Py_ssize_t lanes = p->lanes, lc = p->lc;
    int64_t one = -1;
    const int64_t *lane = NULL;
    /* the lanes: as given (an int, or k int64), else envs' lane per env (edits.check's rules) */
    if (lane_o == Py_None) {
        if (p->envs > 1) {
            if (k % p->envs) goto done;
        } else if (lanes > 1) {
            goto done;
        } else {
            one = 0;
        }
    } else if (PyLong_CheckExact(lane_o)) {
        int overflow = 0;
        one = PyLong_AsLongLongAndOverflow(lane_o, &overflow);
        if (overflow || one < 0 || one >= lanes) { PyErr_Clear(); goto done; }
    } else {
        if (PyObject_GetBuffer(lane_o, &lb, PyBUF_RECORDS_RO) < 0) { PyErr_Clear(); goto done; }
        lane_held = 1;
        if (!lb.format || lb.itemsize != 8 || (strcmp(lb.format, "l") && strcmp(lb.format, "q")) || lb.ndim != 1 ||
            lb.shape[0] != k || !PyBuffer_IsContiguous(&lb, 'C'))
            goto done;
        lane = (const int64_t *)lb.buf;
    }
    if (!lane && k > lc) goto done; /* more rows than a lane holds: check_push explains */
    /* the episode ids: one for all rows, or k int64 */
    int64_t ep_one = 0;
    const int64_t *ep = NULL;
    if (p->has_episode != (episode_o != Py_None)) goto done; /* missing or unwanted: edits.check says so */
    if (p->has_episode) {
        if (PyLong_CheckExact(episode_o)) {
            int overflow = 0;
            ep_one = PyLong_AsLongLongAndOverflow(episode_o, &overflow);
            if (overflow || (ep_one == -1 && PyErr_Occurred())) { PyErr_Clear(); goto done; }
        } else {
            if (PyObject_GetBuffer(episode_o, &eb, PyBUF_RECORDS_RO) < 0) { PyErr_Clear(); goto done; }
            ep_held = 1;
            if (!eb.format || eb.itemsize != 8 || (strcmp(eb.format, "l") && strcmp(eb.format, "q")) || eb.ndim > 1 ||
                (eb.ndim == 1 && eb.shape[0] != k) || !PyBuffer_IsContiguous(&eb, 'C'))
                goto done;
            if (eb.ndim == 0) {
                ep_one = *(const int64_t *)eb.buf;
            } else {
                if (k > 1 && lane_o == Py_None && p->envs == 0) goto done; /* edits.note_interleaving's case */
                ep = (const int64_t *)eb.buf;
            }
        }
    }
    /* per-row lanes: as given or envs' (row i to lane i % envs); each lane must hold its rows */
    slots = (int64_t *)PyMem_Malloc((size_t)(2 * k + 2 * lanes) * sizeof(int64_t));
    if (!slots) { PyErr_NoMemory(); goto done; }
    int64_t *rows = slots + k, *at = rows + k, *count = at + lanes;
    for (Py_ssize_t l = 0; l < lanes; l++) count[l] = 0;
    if (lane_o == Py_None && p->envs > 1) {
        for (Py_ssize_t i = 0; i < k; i++) rows[i] = i % p->envs;
        lane = rows; /* rows is free until the reservation below: lanes go to `slots` first */
    }
    if (lane) {
        for (Py_ssize_t i = 0; i < k; i++)
            if (lane[i] < 0 || lane[i] >= lanes || ++count[lane[i]] > lc) goto done; /* check_push explains */
        memcpy(slots, lane, (size_t)k * sizeof(int64_t));
        lane = slots; /* the lanes, then (after the reservation) the slots */
    }
    /* the copies: casts into scratch first, so nothing can fail once rows are odd */
    Copies c;
    c.n = p->n;
    c.total = 0;
    size_t need = 0;
    for (Py_ssize_t g = 0; g < p->n; g++)
        if (src[g].convert || !src[g].held) need += (size_t)(k * p->width[g] + 7) / 8;
    if (need) {
        scratch = (int64_t *)PyMem_Malloc(need * 8);
        if (!scratch) { PyErr_NoMemory(); goto done; }
    }
    int64_t *free_at = scratch;
    for (Py_ssize_t g = 0; g < p->n; g++) {
        Source *s = &src[g];
        c.to[g] = (char *)p->dst[g].buf + p->offset[g];
        c.width[g] = p->width[g];
        c.row[g] = p->row[g];
        c.total += (size_t)(k * p->width[g]);
        if (s->held && !s->convert) {
            c.from[g] = (const char *)s->view.buf;
            continue;
        }
        char *to = (char *)free_at;
        free_at += (k * p->width[g] + 7) / 8;
        c.from[g] = to;
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
    PyObject *kobj = PyLong_FromSsize_t(k);
    if (!kobj) goto done;
    PyObject *call[2] = {kobj, p->int64};
    ids_o = PyObject_Vectorcall(p->empty, call, 2, NULL);
    Py_DECREF(kobj);
    if (!ids_o) goto done;
    Py_buffer ib;
    if (get_buf(ids_o, &ib, 1, 8, "ids") < 0) goto done;
    int64_t *ids = (int64_t *)ib.buf;
    if (ib.len != k * 8) {
        PyBuffer_Release(&ib);
        PyErr_SetString(PyExc_ValueError, "push: empty() gave the wrong size");
        goto done;
    }
    {
        pthread_mutex_t *mutex = (pthread_mutex_t *)p->lock.buf;
        int64_t *cur = (int64_t *)p->cur.buf, *stats = (int64_t *)p->stats.buf, *stamp = (int64_t *)p->stamp.buf;
        uint16_t *owner = (uint16_t *)p->owner.buf;
        uint16_t writer = (uint16_t)me[1];
        int pushed = 0;
        if (try_lock(mutex)) {
            if (!stats[p->frozen_at]) {
                int fits = 1;
                for (Py_ssize_t l = 0; l < lanes; l++) {
                    int64_t cu = cur[LANE_WORDS * l], b = cur[LANE_WORDS * l + 1];
                    at[l] = cu > b ? cu : b;
                    fits &= at[l] >= 0 && at[l] <= INT64_MAX / 4;
                    count[l] = 0;
                }
                int64_t odd = 0;
                for (Py_ssize_t i = 0; i < k && fits; i++) {
                    int64_t l = lane ? lane[i] : one, row = at[l] + count[l]++;
                    rows[i] = row;
                    slots[i] = l * lc + row % lc; /* lane[i] read before slots[i] is written */
                    ids[i] = lanes > 1 ? row * lanes + l : row;
                    odd |= __atomic_load_n(&stamp[slots[i]], __ATOMIC_RELAXED);
                }
                if (fits && !(odd & 1)) { /* ring.py's order: owners, odd stamps, the cursors, the count */
                    for (Py_ssize_t i = 0; i < k; i++) __atomic_store_n(&owner[slots[i]], writer, __ATOMIC_RELAXED);
                    for (Py_ssize_t i = 0; i < k; i++) __atomic_store_n(&stamp[slots[i]], 2 * rows[i] + 1, __ATOMIC_RELEASE);
                    for (Py_ssize_t l = 0; l < lanes; l++)
                        if (count[l]) __atomic_store_n(&cur[LANE_WORDS * l], at[l] + count[l], __ATOMIC_RELEASE);
                    stats[p->inserted_at] += k;
                    pushed = 1;
                }
            }
            pthread_mutex_unlock(mutex);
        }
        if (pushed) {
            PyThreadState *ts = c.total >= NOGIL_BYTES ? PyEval_SaveThread() : NULL;
            copies_run(&c, k, slots, 0);
            if (p->has_episode) {
                int64_t *e = (int64_t *)p->episode.buf;
                for (Py_ssize_t i = 0; i < k; i++) e[slots[i]] = ep ? ep[i] : ep_one;
            }
            commit_slots(stamp, k, slots, 0);
            if (ts) PyEval_RestoreThread(ts);
            result = ids_o;
            ids_o = NULL;
        }
    }
    PyBuffer_Release(&ib);
done:
    if (!result && !PyErr_Occurred()) {
        result = Py_None;
        Py_INCREF(result);
    }
    Py_XDECREF(ids_o);
    PyMem_Free(scratch);
    PyMem_Free(slots);
    if (lane_held) PyBuffer_Release(&lb);
    if (ep_held) PyBuffer_Release(&eb);
    sources_close(src, opened);
    return result;
}

static PyObject *push(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "push(plan, data, lane, episode)");
        return NULL;
    }
    PushPlan *p = (PushPlan *)PyCapsule_GetPointer(args[0], "shmbuffer.plan");
    if (!p) return NULL;
    PyObject *vals[MAX_COLS];
    int have = values_of(p, args[1], vals);
    if (have <= 0) {
        if (have < 0) return NULL;
        Py_RETURN_NONE;
    }
    return push_rows(p, vals, args[2], args[3]);
}

/* push_args(plan, args, nargs, kwnames): ReplayBuffer.push's usual calls, push(**fields) or
 * push(data_dict) with lane= and episode= or without, straight from the call's arguments to
 * push_rows with no dict made: the ids, or None (a new reference) where the Python method must run
 * (any other call, and every push push_rows leaves to Python), or NULL with an error. The plan's
 * block.fields must still be its table (a block whose field table was replaced copies with numpy:
 * ring.Copier). */
static PyObject *push_args(PushPlan *p, PyObject *const *args, Py_ssize_t given, PyObject *kwnames) {
    static PyObject *s_lane, *s_episode, *s_fields;
    if (!s_lane && (!(s_lane = PyUnicode_InternFromString("lane")) || !(s_episode = PyUnicode_InternFromString("episode")) ||
                    !(s_fields = PyUnicode_InternFromString("fields"))))
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
        Py_ssize_t g = 0;
        while (g < p->n && p->names[g] != name) g++;
        if (g == p->n) { /* not interned alike: compare the text */
            for (g = 0; g < p->n; g++) {
                int eq = PyUnicode_Compare(p->names[g], name);
                if (eq == -1 && PyErr_Occurred()) return NULL;
                if (eq == 0) break;
            }
            if (g == p->n) { usual = 0; break; } /* an unknown field, priority=, a name built at runtime... */
        }
        if (given || vals[g]) { usual = 0; break; }
        vals[g] = kwvals[i];
        found++;
    }
    if (usual) {
        PyObject *table = PyObject_GetAttr(p->block, s_fields);
        if (!table) return NULL;
        usual = table == p->table;
        Py_DECREF(table);
    }
    if (usual && given) {
        int have = values_of(p, args[0], vals);
        if (have < 0) return NULL;
        usual = have;
    } else if (usual) {
        usual = found == p->n;
    }
    if (usual) return push_rows(p, vals, lane_o, episode_o);
    Py_RETURN_NONE;
}

/* -- push as a method ------------------------------------------------------------------------------
 * PushMethod(func) stands for ReplayBuffer.push (and add) on the class (buffer.py). Read from an
 * instance whose `_push_plan` is a plan (ReplayBuffer._setup: a uniform buffer the one call
 * serves), it gives a BoundPush: a bound method, holding its buffer as any bound method does,
 * whose usual calls are push_args and every other call func(buffer, ...). Read from the class, it
 * is func; from an instance without a plan, func bound as usual. */
typedef struct {
    PyObject_HEAD
    PyObject *func;
} PushMethod;

typedef struct {
    PyObject_HEAD
    PyObject *plan, *self, *func;
    vectorcallfunc vectorcall;
} BoundPush;

static PyTypeObject BoundPushType;

static PyObject *bound_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    BoundPush *b = (BoundPush *)callable;
    PushPlan *p = (PushPlan *)PyCapsule_GetPointer(b->plan, "shmbuffer.plan");
    if (!p) return NULL;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *ids = push_args(p, args, nargs, kwnames);
    if (ids != Py_None) return ids; /* the ids, or NULL with an error */
    Py_DECREF(ids);
    PyObject *method = PyMethod_New(b->func, b->self);
    if (!method) return NULL;
    PyObject *got = PyObject_Vectorcall(method, args, (size_t)nargs, kwnames);
    Py_DECREF(method);
    return got;
}

static int bound_traverse(BoundPush *b, visitproc visit, void *arg) {
    Py_VISIT(b->plan);
    Py_VISIT(b->self);
    Py_VISIT(b->func);
    return 0;
}

static int bound_clear(BoundPush *b) {
    Py_CLEAR(b->plan);
    Py_CLEAR(b->self);
    Py_CLEAR(b->func);
    return 0;
}

static void bound_dealloc(BoundPush *b) {
    PyObject_GC_UnTrack(b);
    bound_clear(b);
    PyObject_GC_Del(b);
}

static PyObject *bound_repr(BoundPush *b) {
    PyObject *name = PyObject_GetAttrString(b->func, "__qualname__");
    if (!name) return NULL;
    PyObject *r = PyUnicode_FromFormat("<bound method %S of %R>", name, b->self);
    Py_DECREF(name);
    return r;
}

/* pickled as a bound method is: getattr(buffer, name), so an unpickled push holds its buffer */
static PyObject *bound_reduce(BoundPush *b, PyObject *unused) {
    PyObject *name = PyObject_GetAttrString(b->func, "__name__");
    if (!name) return NULL;
    PyObject *builtins = PyEval_GetBuiltins(); /* borrowed */
    PyObject *getattr_ = builtins ? PyDict_GetItemString(builtins, "getattr") : NULL;
    if (!getattr_) {
        Py_DECREF(name);
        PyErr_SetString(PyExc_RuntimeError, "push: builtins.getattr not found");
        return NULL;
    }
    return Py_BuildValue("(O(ON))", getattr_, b->self, name);
}

static PyObject *bound_doc(BoundPush *b, void *unused) { return PyObject_GetAttrString(b->func, "__doc__"); }
static PyObject *bound_name(BoundPush *b, void *unused) { return PyObject_GetAttrString(b->func, "__name__"); }
static PyObject *bound_qualname(BoundPush *b, void *unused) { return PyObject_GetAttrString(b->func, "__qualname__"); }
static PyObject *bound_module(BoundPush *b, void *unused) { return PyObject_GetAttrString(b->func, "__module__"); }

/* inspect.signature(buf.push): the method's, bound (without self) */
static PyObject *bound_signature(BoundPush *b, void *unused) {
    PyObject *inspect = PyImport_ImportModule("inspect");
    if (!inspect) return NULL;
    PyObject *method = PyMethod_New(b->func, b->self);
    PyObject *sig = method ? PyObject_CallMethod(inspect, "signature", "O", method) : NULL;
    Py_XDECREF(method);
    Py_DECREF(inspect);
    return sig;
}

/* equal, as bound methods are, when they bind the same function to the same buffer */
static PyObject *bound_richcompare(PyObject *a, PyObject *b, int op) {
    if ((op != Py_EQ && op != Py_NE) || Py_TYPE(b) != Py_TYPE(a)) Py_RETURN_NOTIMPLEMENTED;
    BoundPush *x = (BoundPush *)a, *y = (BoundPush *)b;
    int eq = x->self == y->self && x->func == y->func;
    if (op == Py_NE) eq = !eq;
    return PyBool_FromLong(eq);
}

static Py_hash_t bound_hash(BoundPush *b) {
    Py_hash_t x = PyObject_Hash(b->func);
    if (x == -1) return -1;
    uintptr_t p = (uintptr_t)b->self; /* as CPython hashes a pointer: rotated by 4 bits */
    Py_hash_t y = (Py_hash_t)((p >> 4) | (p << (8 * sizeof(p) - 4)));
    Py_hash_t h = x ^ y;
    return h == -1 ? -2 : h;
}

static PyObject *method_get(PushMethod *m, PyObject *obj, PyObject *type);

/* BoundPush(func, buffer): func bound to buffer, as PushMethod binds it (weakref.WeakMethod
 * rebuilds a bound method this way) */
static PyObject *bound_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *func, *self;
    if ((kwds && PyDict_GET_SIZE(kwds)) || !PyArg_ParseTuple(args, "OO:BoundPush", &func, &self)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "BoundPush(func, buffer) takes no keywords");
        return NULL;
    }
    PushMethod m;
    m.func = func;
    return method_get(&m, self, NULL);
}

static PyMemberDef bound_members[] = {
    {"__self__", T_OBJECT, offsetof(BoundPush, self), READONLY, "the buffer"},
    {"__func__", T_OBJECT, offsetof(BoundPush, func), READONLY, "the Python method (ReplayBuffer.push)"},
    {NULL, 0, 0, 0, NULL},
};
static PyGetSetDef bound_getset[] = {
    {"__doc__", (getter)bound_doc, NULL, NULL, NULL},
    {"__name__", (getter)bound_name, NULL, NULL, NULL},
    {"__qualname__", (getter)bound_qualname, NULL, NULL, NULL},
    {"__module__", (getter)bound_module, NULL, NULL, NULL},
    {"__signature__", (getter)bound_signature, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};
static PyMethodDef bound_methods[] = {
    {"__reduce__", (PyCFunction)bound_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject BoundPushType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmbuffer._native.BoundPush",
    .tp_basicsize = sizeof(BoundPush),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A buffer's push: a bound method whose usual calls run in C (PushMethod).",
    .tp_vectorcall_offset = offsetof(BoundPush, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_traverse = (traverseproc)bound_traverse,
    .tp_clear = (inquiry)bound_clear,
    .tp_dealloc = (destructor)bound_dealloc,
    .tp_repr = (reprfunc)bound_repr,
    .tp_richcompare = bound_richcompare,
    .tp_hash = (hashfunc)bound_hash,
    .tp_new = bound_new,
    .tp_members = bound_members,
    .tp_getset = bound_getset,
    .tp_methods = bound_methods,
};

static PyObject *method_get(PushMethod *m, PyObject *obj, PyObject *type) {
    static PyObject *s_plan;
    if (!s_plan && !(s_plan = PyUnicode_InternFromString("_push_plan"))) return NULL;
    if (!m->func) {
        PyErr_SetString(PyExc_TypeError, "PushMethod: made without its function (PushMethod(func))");
        return NULL;
    }
    if (obj == NULL || obj == Py_None) {
        Py_INCREF(m->func);
        return m->func;
    }
    PyObject *plan = PyObject_GetAttr(obj, s_plan);
    if (!plan) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
        PyErr_Clear();
    }
    if (!plan || !PyCapsule_IsValid(plan, "shmbuffer.plan")) {
        Py_XDECREF(plan);
        return PyMethod_New(m->func, obj);
    }
    BoundPush *b = PyObject_GC_New(BoundPush, &BoundPushType);
    if (!b) {
        Py_DECREF(plan);
        return NULL;
    }
    b->plan = plan;
    Py_INCREF(obj);
    b->self = obj;
    Py_INCREF(m->func);
    b->func = m->func;
    b->vectorcall = bound_call;
    PyObject_GC_Track(b);
    return (PyObject *)b;
}

static int method_init(PushMethod *m, PyObject *args, PyObject *kwds) {
    PyObject *func;
    if (kwds && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "PushMethod(func) takes no keywords");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O:PushMethod", &func)) return -1;
    if (!PyCallable_Check(func)) {
        PyErr_SetString(PyExc_TypeError, "PushMethod(func): func must be callable");
        return -1;
    }
    Py_INCREF(func);
    Py_XSETREF(m->func, func);
    return 0;
}

static int method_traverse(PushMethod *m, visitproc visit, void *arg) {
    Py_VISIT(m->func);
    return 0;
}

static int method_clear(PushMethod *m) {
    Py_CLEAR(m->func);
    return 0;
}

static void method_dealloc(PushMethod *m) {
    PyObject_GC_UnTrack(m);
    method_clear(m);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static PyObject *method_doc(PushMethod *m, void *unused) {
    if (!m->func) Py_RETURN_NONE;
    return PyObject_GetAttrString(m->func, "__doc__");
}

static PyMemberDef method_members[] = {
    {"__func__", T_OBJECT, offsetof(PushMethod, func), READONLY, "the Python method"},
    {NULL, 0, 0, 0, NULL},
};
static PyGetSetDef method_getset[] = {
    {"__doc__", (getter)method_doc, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PushMethodType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmbuffer._native.PushMethod",
    .tp_basicsize = sizeof(PushMethod),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "PushMethod(func): ReplayBuffer.push on the class; a BoundPush on an instance with a push plan.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)method_init,
    .tp_traverse = (traverseproc)method_traverse,
    .tp_clear = (inquiry)method_clear,
    .tp_dealloc = (destructor)method_dealloc,
    .tp_descr_get = (descrgetfunc)method_get,
    .tp_members = method_members,
    .tp_getset = method_getset,
};

/* reserve(stamp, owner, first, k, n0, writer, old) -> bool: under the ring's lock, the k consecutive
 * slots from `first` for rows n0.. : False (nothing written) if one of them is odd (being
 * written: the caller's lapping rules decide); else each slot's stamp into `old` (k int64: what
 * Ring.undo puts back), each slot's owner, then its stamp 2n + 1. */
static PyObject *reserve(PyObject *self, PyObject *args) {
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
        writer < 0 || writer > 65535 || oldb.len / 8 != k) {
        PyErr_SetString(PyExc_ValueError, "reserve: slots, rows or writer out of range");
        goto done;
    }
    {
        int64_t *stamp = (int64_t *)stb.buf + first;
        uint16_t *owner = (uint16_t *)ob.buf + first;
        int64_t odd = 0;
        for (Py_ssize_t i = 0; i < k; i++) odd |= __atomic_load_n(&stamp[i], __ATOMIC_RELAXED);
        if (odd & 1) {
            result = Py_False;
        } else {
            int64_t *was = (int64_t *)oldb.buf;
            for (Py_ssize_t i = 0; i < k; i++) was[i] = stamp[i];
            for (Py_ssize_t i = 0; i < k; i++) __atomic_store_n(&owner[i], (uint16_t)writer, __ATOMIC_RELAXED);
            for (Py_ssize_t i = 0; i < k; i++) __atomic_store_n(&stamp[i], 2 * (n0 + i) + 1, __ATOMIC_RELEASE);
            result = Py_True;
        }
        Py_INCREF(result);
    }
done:
    PyBuffer_Release(&stb);
    PyBuffer_Release(&ob);
    PyBuffer_Release(&oldb);
    return result;
}

/* reserve_lanes(cursors, stamp, owner, lane, writer, n, slots, old) -> bool: under the ring's lock,
 * one row in each lane of `lane` (k int64 lane numbers): row numbers from each lane's
 * max(cursor, base) in order (into n), their slots (into slots); False (nothing written) if one
 * of the slots is odd (being written: the caller's lapping rules decide); else the slots' stamps
 * into old (what Ring.undo puts back), owners, odd
 * stamps 2n + 1, then every lane's cursor to max(cursor, base) + its rows (ring.py's order:
 * stamps odd before the cursor moves). cursors is the (lanes, 8) int64 _lanes column. */
static PyObject *reserve_lanes(PyObject *self, PyObject *args) {
    PyObject *cur_o, *stamp_o, *owner_o, *lane_o, *n_o, *slots_o, *old_o;
    long long writer;
    if (!PyArg_ParseTuple(args, "OOOOLOOO", &cur_o, &stamp_o, &owner_o, &lane_o, &writer, &n_o, &slots_o, &old_o)) return NULL;
    Py_buffer cb, stb, ob, lb, nb, sb, oldb;
    int held = 0;
    PyObject *result = NULL;
    int64_t *base = NULL;
    if (get_buf(cur_o, &cb, 1, 8, "cursors") < 0) return NULL;
    held++;
    if (get_buf(stamp_o, &stb, 1, 8, "stamp") < 0) goto done;
    held++;
    if (get_buf(owner_o, &ob, 1, 2, "owner") < 0) goto done;
    held++;
    if (get_buf(lane_o, &lb, 0, 8, "lane") < 0) goto done;
    held++;
    if (get_buf(n_o, &nb, 1, 8, "n") < 0) goto done;
    held++;
    if (get_buf(slots_o, &sb, 1, 8, "slots") < 0) goto done;
    held++;
    if (get_buf(old_o, &oldb, 1, 8, "old") < 0) goto done;
    held++;
    {
        Py_ssize_t lanes = cb.len / 64, capacity = stb.len / 8, k = lb.len / 8;
        if (lanes <= 0 || cb.len % 64 || capacity % lanes || ob.len / 2 != capacity || nb.len / 8 != k ||
            sb.len / 8 != k || oldb.len / 8 != k || writer < 0 || writer > 65535) {
            PyErr_SetString(PyExc_ValueError, "reserve_lanes: arrays of inconsistent sizes, or a writer out of range");
            goto done;
        }
        int64_t lc = capacity / lanes;
        int64_t *cur = (int64_t *)cb.buf, *stamp = (int64_t *)stb.buf, *n = (int64_t *)nb.buf, *slots = (int64_t *)sb.buf;
        const int64_t *lane = (const int64_t *)lb.buf;
        uint16_t *owner = (uint16_t *)ob.buf;
        for (Py_ssize_t i = 0; i < k; i++) {
            if (lane[i] < 0 || lane[i] >= lanes) {
                PyErr_Format(PyExc_ValueError, "reserve_lanes: lane %lld is outside [0, %zd)", (long long)lane[i], lanes);
                goto done;
            }
        }
        base = (int64_t *)PyMem_Calloc((size_t)lanes * 2, sizeof(int64_t));
        if (!base) { PyErr_NoMemory(); goto done; }
        int64_t *count = base + lanes;
        for (Py_ssize_t l = 0; l < lanes; l++) {
            int64_t c = __atomic_load_n(&cur[8 * l + 0], __ATOMIC_RELAXED), b = __atomic_load_n(&cur[8 * l + 1], __ATOMIC_RELAXED);
            base[l] = c > b ? c : b;
            if (base[l] < 0 || base[l] > INT64_MAX / 4) {
                PyErr_SetString(PyExc_ValueError, "reserve_lanes: a cursor out of range");
                goto done;
            }
        }
        int64_t odd = 0;
        for (Py_ssize_t i = 0; i < k; i++) {
            int64_t l = lane[i], row = base[l] + count[l]++;
            n[i] = row;
            slots[i] = l * lc + row % lc;
            odd |= __atomic_load_n(&stamp[slots[i]], __ATOMIC_RELAXED);
        }
        if (odd & 1) {
            result = Py_False;
        } else {
            int64_t *was = (int64_t *)oldb.buf;
            for (Py_ssize_t i = 0; i < k; i++) was[i] = stamp[slots[i]];
            for (Py_ssize_t i = 0; i < k; i++) __atomic_store_n(&owner[slots[i]], (uint16_t)writer, __ATOMIC_RELAXED);
            for (Py_ssize_t i = 0; i < k; i++) __atomic_store_n(&stamp[slots[i]], 2 * n[i] + 1, __ATOMIC_RELEASE);
            for (Py_ssize_t l = 0; l < lanes; l++) __atomic_store_n(&cur[8 * l + 0], base[l] + count[l], __ATOMIC_RELEASE);
            result = Py_True;
        }
        Py_INCREF(result);
    }
done:
    PyMem_Free(base);
    if (held > 6) PyBuffer_Release(&oldb);
    if (held > 5) PyBuffer_Release(&sb);
    if (held > 4) PyBuffer_Release(&nb);
    if (held > 3) PyBuffer_Release(&lb);
    if (held > 2) PyBuffer_Release(&ob);
    if (held > 1) PyBuffer_Release(&stb);
    PyBuffer_Release(&cb);
    return result;
}

/* lanes_worst(lane, lanes) -> the most rows any lane gets, or -1 when a lane is outside [0, lanes) */
static PyObject *lanes_worst(PyObject *self, PyObject *args) {
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

static PyMethodDef methods[] = {
    {"tree_find", tree_find, METH_VARARGS, "tree_find(sums, plan, capacity, mass, out): SumTree.find into out (int64)."},
    {"tree_update", tree_update, METH_VARARGS, "tree_update(sums, mins, plan, capacity, slots, values): SumTree.update."},
    {"tree_draw", tree_draw, METH_VARARGS, "tree_draw(sums, plan, capacity, total, u, stratified, stamp, cursors, slots, leaves, ids): a tree draw's ids."},
    {"weights", weights, METH_VARARGS, "weights(mins, plan, capacity, leaves, beta, out): importance weights (float32)."},
    {"scan", scan, METH_O, "scan(values) -> largest value, or -1.0 when one is not finite and >= 0."},
    {"known", known, METH_VARARGS, "known(ids, cursors) -> bool: every id >= 0 and below its lane's cursor."},
    {"current", current, METH_VARARGS, "current(ids, stamp, cursors, ok): Ring.current into ok."},
    {"update_priorities", update_priorities, METH_VARARGS,
     "update_priorities(lock, ids, priorities, leaves, stamp, cursors, sums, mins, plan, capacity, prio) -> live count or None."},
    {"gather", gather, METH_VARARGS, "gather(ids, lanes, stamp, sources, outs, ok) -> smallest id: rows with the stamp check."},
    {"put", put, METH_VARARGS, "put(where, k, stamp, targets, offsets, formats, sources, commit) -> bool: a push's copies, its commit."},
    {"plan", plan, METH_VARARGS, "plan(lock, cursors, stats, stamp, owner, writers, me, frozen, inserted, names, formats, shapes, widths, targets, offsets, episode, envs, empty, int64, block, table) -> a push's plan."},
    {"push", (PyCFunction)(void (*)(void))push, METH_FASTCALL, "push(plan, data, lane, episode) -> ids, or None where Python decides."},
    {"plan_close", plan_close, METH_O, "plan_close(plan): release a push plan's views of the buffer."},
    {"reserve", reserve, METH_VARARGS, "reserve(stamp, owner, first, k, n0, writer, old) -> bool: mark consecutive slots odd."},
    {"reserve_lanes", reserve_lanes, METH_VARARGS, "reserve_lanes(cursors, stamp, owner, lane, writer, n, slots, old) -> bool."},
    {"lanes_worst", lanes_worst, METH_VARARGS, "lanes_worst(lane, lanes) -> most rows in one lane, or -1."},
    {"stacks", stacks, METH_VARARGS, "stacks(win, ok, kind, lanes, stamp, column, k, lasts, outs, valid): frame stacks read with their plan."},
    {"check", check, METH_VARARGS, "check(plan, data) -> (k, single) or None: a push's fast checks, no casts."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "shmbuffer._native", "shmbuffer's native hot path (see native.py).", -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    my_pid = getpid();
    if (pthread_atfork(NULL, NULL, after_fork)) {
        PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
        return NULL;
    }
    if (PyType_Ready(&BoundPushType) < 0 || PyType_Ready(&PushMethodType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    /* the numbers this file shares with the Python modules, compared by tests/test_native.py */
    if (PyModule_AddIntConstant(m, "FANOUT", FANOUT) < 0 || PyModule_AddIntConstant(m, "LANE_WORDS", LANE_WORDS) < 0 ||
        PyModule_AddIntConstant(m, "LOCK_REPAIR", LOCK_REPAIR) < 0 || PyModule_AddIntConstant(m, "KIND_END", KIND_END) < 0 ||
        PyModule_AddIntConstant(m, "KIND_START", KIND_START) < 0 || PyModule_AddIntConstant(m, "KIND_ZERO", KIND_ZERO) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    PyObject *invalid = PyLong_FromLongLong(INVALID_ID);
    if (!invalid || PyModule_AddObjectRef(m, "INVALID_ID", invalid) < 0) {
        Py_XDECREF(invalid);
        Py_DECREF(m);
        return NULL;
    }
    Py_DECREF(invalid);
    if (PyModule_AddObjectRef(m, "PushMethod", (PyObject *)&PushMethodType) < 0 ||
        PyModule_AddObjectRef(m, "BoundPush", (PyObject *)&BoundPushType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
