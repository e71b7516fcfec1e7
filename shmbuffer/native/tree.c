/* The priority tree (sampling/sumtree.py): its levels, the walk of a draw (find), a change of
 * leaves (update) and the importance weights read from its mins. */
#include "native.h"

#include <math.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

/* the tree's levels from sumtree's plan, a tuple of level lengths (leaves first), checked against
 * the capacity and the arrays' size; -1 with a ValueError */
int levels_read(PyObject *plan, Py_ssize_t capacity, Py_ssize_t size, Levels *lv) {
    if (!PyTuple_Check(plan) || PyTuple_GET_SIZE(plan) < 1 || PyTuple_GET_SIZE(plan) > MAX_LEVELS) {
        PyErr_SetString(PyExc_ValueError, "plan: expected a tuple of 1 to 32 level lengths");
        return -1;
    }
    lv->n = PyTuple_GET_SIZE(plan);
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < lv->n; i++) {
        Py_ssize_t v = PyLong_AsSsize_t(PyTuple_GET_ITEM(plan, i));
        if (v == -1 && PyErr_Occurred()) return -1;
        if (v <= 0 || v > ((Py_ssize_t)1 << 40)) goto bad;
        if (i < lv->n - 1 && v % FANOUT) goto bad;
        if (i > 0 && v != (lv->len[i - 1] / FANOUT + FANOUT - 1) / FANOUT * FANOUT && v != lv->len[i - 1] / FANOUT) goto bad;
        lv->len[i] = v;
        lv->at[i] = at;
        at += v;
    }
    lv->cum = at;
    lv->size = at + lv->len[lv->n - 1];
    if (capacity <= 0 || capacity > lv->len[0] || lv->size != size) goto bad;
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
void tree_walk(const double *sums, const Levels *lv, Py_ssize_t capacity, double *x, int64_t *node, Py_ssize_t n) {
    const double *cum = sums + lv->cum;
    Py_ssize_t top = lv->len[lv->n - 1];
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
     * each step waiting for the load before it: about 2x slower for 256 points) */
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
    for (Py_ssize_t level = lv->n - 2; level >= 0; level--) {
        const double *nodes = sums + lv->at[level];
        Py_ssize_t rows = lv->len[level] / FANOUT;
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
PyObject *py_tree_find(PyObject *self, PyObject *args) {
    PyObject *sums_o, *plan_o, *mass_o, *out_o;
    Py_ssize_t capacity;
    if (!PyArg_ParseTuple(args, "OOnOO", &sums_o, &plan_o, &capacity, &mass_o, &out_o)) return NULL;
    Py_buffer sb, mb, ob;
    if (get_buf(sums_o, &sb, 0, 8, "sums") < 0) return NULL;
    if (get_buf(mass_o, &mb, 0, 8, "mass") < 0) { PyBuffer_Release(&sb); return NULL; }
    if (get_buf(out_o, &ob, 1, 8, "out") < 0) { PyBuffer_Release(&sb); PyBuffer_Release(&mb); return NULL; }
    PyObject *result = NULL;
    Levels lv;
    if (levels_read(plan_o, capacity, sb.len / 8, &lv) < 0) goto done;
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
        tree_walk((const double *)sb.buf, &lv, capacity, u, (int64_t *)ob.buf, n);
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

/* everything an update reads, asked for at once (the misses overlap): each slot's 16 leaves and,
 * level by level, the 16 siblings of its ancestor in sums; its own line in mins, level by level
 * below the top */
static void set_prefetch(const double *sums, const double *mins, const Levels *lv, const int64_t *slots, Py_ssize_t n) {
    Py_ssize_t top = lv->n - 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t k = (uint64_t)slots[i];
        for (Py_ssize_t level = 0; level < top; level++, k /= FANOUT) {
            prefetch_block(sums + lv->at[level] + (Py_ssize_t)(k / FANOUT * FANOUT));
            __builtin_prefetch(mins + lv->at[level] + (Py_ssize_t)k, 1);
        }
    }
}

/* the leaves' sums (and, for a run, their mins) in order, a repeated slot keeping its last value;
 * then each changed parent's sum from its 16 children, in order (for a run, its min too) */
static void set_sums(double *sums, double *mins, const Levels *lv, const int64_t *slots, const double *values,
                     double scalar, Py_ssize_t n, int run) {
    for (Py_ssize_t i = 0; i < n; i++) {
        double v = values ? values[i] : scalar;
        sums[slots[i]] = v;
        if (run) mins[slots[i]] = v > 0 ? v : INFINITY;
    }
    for (Py_ssize_t level = 1; level < lv->n; level++) {
        const double *cs = sums + lv->at[level - 1], *cm = mins + lv->at[level - 1];
        double *ps = sums + lv->at[level], *pm = mins + lv->at[level];
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
}

/* the leaves' mins in order, each carried up its ancestors (see tree_set) */
static void set_mins_carried(double *mins, const Levels *lv, const int64_t *slots, const double *values, double scalar,
                             Py_ssize_t n) {
    Py_ssize_t top = lv->n - 1;
    if (top > 0) { /* the leaves whose block's min must be found again (below): ask for those blocks */
        const double *pm = mins + lv->at[1];
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
            double *up = mins + lv->at[level + 1] + k / FANOUT, m = *up, next;
            if (now <= m) {
                next = now;
            } else if (was > m) {
                next = m; /* another child is the smallest, and still there */
            } else { /* the smallest child grew: the smallest of the 16 now */
                const double *c = mins + lv->at[level] + k / FANOUT * FANOUT;
                next = c[0];
                for (int j = 1; j < FANOUT; j++)
                    if (c[j] < next) next = c[j];
            }
            *up = next;
            was = m;
            now = next;
        }
    }
}

/* the prefix sum of the top level from the first top node that changed: the sums before it are
 * the same additions in the same order, so the result equals numpy's cumsum of the whole */
static void set_prefix(double *sums, const Levels *lv, const int64_t *slots, Py_ssize_t n) {
    int64_t from = INT64_MAX;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t k = (uint64_t)slots[i];
        for (Py_ssize_t l = 1; l < lv->n; l++) k /= FANOUT;
        if ((int64_t)k < from) from = (int64_t)k;
    }
    const double *topv = sums + lv->at[lv->n - 1];
    double *cum = sums + lv->cum, acc = from > 0 ? cum[from - 1] : 0.0;
    for (Py_ssize_t j = from; j < lv->len[lv->n - 1]; j++) {
        acc += topv[j];
        cum[j] = acc;
    }
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
 * blocks: there each parent's min is recomputed from its children once, as its sum is (carried
 * slot after slot, such a run is slower: benchmarks/README.md). The carrying rests
 * on every parent holding the min of its children, which every writer keeps (a holder that died
 * mid-update is repaired by a rebuild before the next locker goes on: priorities.py). */
void tree_set(double *sums, double *mins, const Levels *lv, const int64_t *slots, const double *values, double scalar,
              Py_ssize_t n) {
    if (!n) return;
    set_prefetch(sums, mins, lv, slots, n);
    /* one run of consecutive slots (a push's rows): whole blocks change, so each parent's min is
     * recomputed from its children once, as its sum is, instead of carried slot after slot */
    int run = 1;
    for (Py_ssize_t i = 1; i < n && run; i++) run = slots[i] == slots[0] + i;
    set_sums(sums, mins, lv, slots, values, scalar, n, run);
    if (!run) set_mins_carried(mins, lv, slots, values, scalar, n);
    set_prefix(sums, lv, slots, n);
}

/* update(sums, mins, plan, capacity, slots, values): sumtree.SumTree.update; values is a buffer
 * of one float64 per slot or a float. Slots must lie in [0, capacity). */
PyObject *py_tree_update(PyObject *self, PyObject *args) {
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
    Levels lv;
    if (levels_read(plan_o, capacity, sb.len / 8, &lv) < 0) goto done;
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
    tree_set((double *)sb.buf, (double *)nb.buf, &lv, slots, have_values ? (const double *)vb.buf : NULL, scalar, n);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&sb);
    PyBuffer_Release(&nb);
    PyBuffer_Release(&kb);
    if (have_values) PyBuffer_Release(&vb);
    return result;
}


/* numpy's min of the top level (NaN wins: *nan set), in 4 independent chains: one chain of 3907
 * dependent compares cost ~10 us, about all of a weights call for 256 leaves */
static double top_min(const double *top, Py_ssize_t m, int *nan) {
    Py_ssize_t j = 0;
    double lo[4] = {top[0], top[0], top[0], top[0]};
    *nan = 0;
#ifdef __SSE2__
    /* two at a time: minpd is `v < lo ? v : lo`, the comparison below; cmpunordpd finds NaN
     * (the scalar loop does about one node a cycle: 1.5 us of a 1.8 us call for 256 leaves) */
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
        *nan |= _mm_movemask_pd(bad) != 0;
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
            *nan |= v != v;
            lo[q] = v < lo[q] ? v : lo[q];
        }
    }
    for (; j < m; j++) {
        *nan |= top[j] != top[j];
        lo[0] = top[j] < lo[0] ? top[j] : lo[0];
    }
    double low = lo[0];
    for (int q = 1; q < 4; q++) low = lo[q] < low ? lo[q] : low;
    return low;
}

/* samplers.importance_weights for n leaves: (max(leaf, low) / low) ** -beta as float32, low the
 * smallest positive leaf (the top level of mins); all ones when low is not a positive finite
 * number. No Python calls. */
void weights_of(const double *mins, const Levels *lv, const double *leaves, Py_ssize_t n, double beta, float *out) {
    int nan;
    double low = top_min(mins + lv->at[lv->n - 1], lv->len[lv->n - 1], &nan);
    if (nan || !isfinite(low) || low <= 0) {
        for (Py_ssize_t i = 0; i < n; i++) out[i] = 1.0f;
        return;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        double l = leaves[i];
        if (!(l >= low) && !isnan(l)) l = low; /* np.maximum: NaN propagates */
        out[i] = (float)pow(l / low, -beta);
    }
}

/* weights(mins, plan, capacity, leaves, beta, out): Prioritized.weights into out (float32):
 * (max(leaf, low) / low) ** -beta with low the tree's min (SumTree.min), or 1 where the tree
 * has no positive leaf. pow here is the C library's, numpy's may be a vectorized one: float64
 * results can differ in the last bit, so the float32 weights agree to 1 ulp (tests/test_native.py). */
PyObject *py_weights(PyObject *self, PyObject *args) {
    PyObject *mins_o, *plan_o, *leaves_o, *out_o;
    Py_ssize_t capacity;
    double beta;
    if (!PyArg_ParseTuple(args, "OOnOdO", &mins_o, &plan_o, &capacity, &leaves_o, &beta, &out_o)) return NULL;
    Py_buffer mb, lb, ob;
    if (get_buf(mins_o, &mb, 0, 8, "mins") < 0) return NULL;
    if (get_buf(leaves_o, &lb, 0, 8, "leaves") < 0) { PyBuffer_Release(&mb); return NULL; }
    if (get_buf(out_o, &ob, 1, 4, "out") < 0) { PyBuffer_Release(&mb); PyBuffer_Release(&lb); return NULL; }
    PyObject *result = NULL;
    Levels lv;
    if (levels_read(plan_o, capacity, mb.len / 8, &lv) < 0) goto done;
    Py_ssize_t n = lb.len / 8;
    if (ob.len / 4 != n) {
        PyErr_SetString(PyExc_ValueError, "weights: expected one float32 out per leaf");
        goto done;
    }
    weights_of((const double *)mb.buf, &lv, (const double *)lb.buf, n, beta, (float *)ob.buf);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&mb);
    PyBuffer_Release(&lb);
    PyBuffer_Release(&ob);
    return result;
}
