/* The one-call sample (protocol/reader.py's fast_draw): a uniform or prioritized draw, the stamped
 * gather of the rows drawn, re-draws of the rows that were not intact and the importance weights,
 * in one call on a read plan made once per buffer. The draw's random numbers come from the plan's
 * xoshiro256** generator (seeded from the buffer's numpy generator): the same distribution as the
 * Python path (samplers.py), another stream. What the call does not serve (an empty buffer, a
 * tree with nothing to draw, rows still not intact after the rounds, an update during the gather)
 * it says, and the Python path takes over. */
#include "native.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define READ_CAPSULE "shmbuffer.read"
#define REDRAW_ROUNDS 8 /* reader.REDRAW_ROUNDS: rounds of re-draws before Python's slow path */

#define MAX_WINDOW 64 /* rows of a transition's window (frames): a bit each in a uint64 */

/* what a transition's read copies into one out (frames: next_of, stack): from column `col` of the
 * plan, `width` bytes at `offset` of a row; a row part (k 0) from window column `wcol`, a stack
 * part k frames (frames_stack) whose newest is window column `wcol`. Stack parts of one source
 * (the observation's stack and the next one's) are next to each other and share `group`. */
typedef struct {
    Py_ssize_t col, offset, width, wcol, k, group;
} Part;

typedef struct {
    Py_buffer stamp, cur, stats, sums, mins, lock, uses; /* the ring's stamps, cursors, counters; the tree; max_use's */
    Py_buffer src[MAX_COLS];                 /* the columns a sample copies, in the caller's order */
    Py_ssize_t width[MAX_COLS], ncols;
    int held;        /* views of stamp, cur, stats, sums, mins, lock, uses taken, in this order */
    int tree;        /* rows are drawn from the tree (prioritized, or uniform under max_use) */
    int counting;    /* max_use: each row returned counts a use, under the lock */
    int closed, busy;
    int64_t max_use;
    pid_t busy_pid;
    Py_ssize_t lanes, capacity, lc;
    Levels lv;
    uint64_t rng[4]; /* xoshiro256** */
    /* frames (next_of/stack): each id drawn is a transition read from its window of rows, the
     * depth rows before it and `ahead` after it, into one out per part */
    int frames;
    Py_buffer kind; /* _kind, held when frames */
    Py_ssize_t depth, ahead, window, nparts;
    Part part[MAX_COLS];
} ReadPlan;

/* -- the plan ---------------------------------------------------------------------------------- */
static void read_release(ReadPlan *p) {
    Py_buffer *views[7] = {&p->stamp, &p->cur, &p->stats, &p->sums, &p->mins, &p->lock, &p->uses};
    for (int i = 0; i < p->held; i++) PyBuffer_Release(views[i]);
    p->held = 0;
    for (Py_ssize_t g = 0; g < p->ncols; g++) PyBuffer_Release(&p->src[g]);
    p->ncols = 0;
    if (p->frames) PyBuffer_Release(&p->kind);
    p->frames = 0;
    p->closed = 1;
}

static void read_capsule_free(PyObject *capsule) {
    ReadPlan *p = (ReadPlan *)PyCapsule_GetPointer(capsule, READ_CAPSULE);
    if (!p) return;
    read_release(p);
    PyMem_Free(p);
}

/* the frames of a read plan: (kind, depth, ahead, parts), parts a tuple of (column, offset,
 * width, window column, k) (Part); -1 with an error */
static int frames_read(ReadPlan *p, PyObject *frames_o) {
    PyObject *kind_o, *parts_o;
    if (!PyArg_ParseTuple(frames_o, "OnnO!:read_plan frames", &kind_o, &p->depth, &p->ahead, &PyTuple_Type, &parts_o)) return -1;
    p->window = p->depth + p->ahead + 1;
    p->nparts = PyTuple_GET_SIZE(parts_o);
    if (p->depth < 0 || p->ahead < 0 || p->ahead > 1 || p->window > MAX_WINDOW || p->nparts < 1 || p->nparts > MAX_COLS) {
        PyErr_SetString(PyExc_ValueError, "read_plan: frames: expected depth >= 0, ahead 0 or 1, a window of at most 64 rows, 1 to 64 parts");
        return -1;
    }
    for (Py_ssize_t g = 0; g < p->nparts; g++) {
        Part *t = &p->part[g];
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(parts_o, g), "nnnnn:read_plan part", &t->col, &t->offset, &t->width, &t->wcol, &t->k))
            return -1;
        int bad = t->col < 0 || t->col >= p->ncols || t->offset < 0 || t->width < 1 || t->wcol < 0 || t->wcol >= p->window;
        if (!bad) bad = t->offset + t->width > p->width[t->col] || t->k < 0 || t->k == 1 || (t->k && t->wcol < t->k - 1);
        if (bad) {
            PyErr_Format(PyExc_ValueError, "read_plan: frames: part %zd does not fit its column or the window", g);
            return -1;
        }
        const Part *before = g ? &p->part[g - 1] : NULL;
        t->group = t->k && before && before->k && before->col == t->col && before->offset == t->offset && before->width == t->width
                       ? before->group : g;
    }
    if (get_buf(kind_o, &p->kind, 0, 1, "kind") < 0) return -1;
    p->frames = 1;
    if (p->kind.len != p->capacity) {
        PyErr_SetString(PyExc_ValueError, "read_plan: frames: the kinds are not one byte a slot");
        return -1;
    }
    return 0;
}

/* read_plan(stamp, cursors, counters, columns, seed, tree=None, claim=None) -> capsule: what a
 * one-call sample reads, once per buffer: the ring's stamps (capacity int64), cursors ((lanes,
 * LANE_WORDS) int64), counters (STATS_WORDS int64), the columns to copy (a tuple of (capacity, row
 * bytes) arrays), the generator's seed (4 uint64, not all 0), for a buffer that draws from its
 * tree (sums, mins, levels), and under max_use (lock, uses, max_use): the lock's column, the
 * uses (capacity uint32) and the bound (the draws are then from the tree). Its views stay held
 * until read_close or the capsule goes. */
PyObject *py_read_plan(PyObject *self, PyObject *args) {
    PyObject *stamp_o, *cur_o, *stats_o, *cols_o, *seed_o, *tree_o = Py_None, *claim_o = Py_None, *frames_o = Py_None;
    if (!PyArg_ParseTuple(args, "OOOO!O|OOO:read_plan", &stamp_o, &cur_o, &stats_o, &PyTuple_Type, &cols_o, &seed_o, &tree_o,
                          &claim_o, &frames_o))
        return NULL;
    Py_ssize_t ncols = PyTuple_GET_SIZE(cols_o);
    if (ncols < 1 || ncols > MAX_COLS) {
        PyErr_SetString(PyExc_ValueError, "read_plan: expected 1 to 64 columns");
        return NULL;
    }
    ReadPlan *p = (ReadPlan *)PyMem_Calloc(1, sizeof(ReadPlan));
    if (!p) return PyErr_NoMemory();
    Py_buffer sb;
    if (get_buf(seed_o, &sb, 0, 8, "seed") < 0) goto fail;
    if (sb.len != 32) {
        PyBuffer_Release(&sb);
        PyErr_SetString(PyExc_ValueError, "read_plan: the seed is 4 uint64");
        goto fail;
    }
    memcpy(p->rng, sb.buf, 32);
    PyBuffer_Release(&sb);
    if (!(p->rng[0] | p->rng[1] | p->rng[2] | p->rng[3])) p->rng[0] = 1; /* the one state xoshiro cannot leave */
    if (get_buf(stamp_o, &p->stamp, 0, 8, "stamp") < 0) goto fail;
    p->held = 1;
    if (get_buf(cur_o, &p->cur, 0, 8, "cursors") < 0) goto fail;
    p->held = 2;
    if (get_buf(stats_o, &p->stats, 1, 8, "counters") < 0) goto fail;
    p->held = 3;
    p->capacity = p->stamp.len / 8;
    p->lanes = lanes_of(&p->cur, p->capacity, "read_plan");
    if (!p->lanes) goto fail;
    p->lc = p->capacity / p->lanes;
    if (p->stats.len != STATS_WORDS * 8) {
        PyErr_SetString(PyExc_ValueError, "read_plan: the counters do not fit the layout");
        goto fail;
    }
    for (Py_ssize_t g = 0; g < ncols; g++) {
        if (get_buf(PyTuple_GET_ITEM(cols_o, g), &p->src[g], 0, 0, "read_plan column") < 0) goto fail;
        p->ncols = g + 1;
        p->width[g] = p->src[g].len / p->capacity;
        if (p->src[g].len % p->capacity || !p->width[g]) {
            PyErr_Format(PyExc_ValueError, "read_plan: column %zd is not (capacity, row bytes)", g);
            goto fail;
        }
    }
    if (tree_o != Py_None) {
        PyObject *sums_o, *mins_o, *levels_o;
        if (!PyArg_ParseTuple(tree_o, "OOO!:read_plan tree", &sums_o, &mins_o, &PyTuple_Type, &levels_o)) goto fail;
        if (get_buf(sums_o, &p->sums, 1, 8, "sums") < 0) goto fail;
        p->held = 4;
        if (get_buf(mins_o, &p->mins, 1, 8, "mins") < 0) goto fail;
        p->held = 5;
        if (levels_read(levels_o, p->capacity, p->sums.len / 8, &p->lv) < 0) goto fail;
        if (p->mins.len != p->sums.len) {
            PyErr_SetString(PyExc_ValueError, "read_plan: sums and mins differ in size");
            goto fail;
        }
        p->tree = 1;
    }
    if (claim_o != Py_None) {
        PyObject *lock_o, *uses_o;
        long long max_use;
        if (!p->tree) {
            PyErr_SetString(PyExc_ValueError, "read_plan: max_use draws from the tree: give it");
            goto fail;
        }
        if (!PyArg_ParseTuple(claim_o, "OOL:read_plan claim", &lock_o, &uses_o, &max_use)) goto fail;
        if (get_buf(lock_o, &p->lock, 1, 0, "lock") < 0) goto fail;
        p->held = 6;
        if (get_buf(uses_o, &p->uses, 1, 4, "uses") < 0) goto fail;
        p->held = 7;
        if (p->lock.len < LOCK_SIZE || ((uintptr_t)p->lock.buf & 7) || p->uses.len / 4 != p->capacity || max_use < 1) {
            PyErr_SetString(PyExc_ValueError, "read_plan: the lock, the uses or max_use do not fit the ring");
            goto fail;
        }
        p->max_use = max_use;
        p->counting = 1;
    }
    if (frames_o != Py_None && frames_read(p, frames_o) < 0) goto fail;
    PyObject *capsule = PyCapsule_New(p, READ_CAPSULE, read_capsule_free);
    if (capsule) return capsule;
fail:
    read_release(p);
    PyMem_Free(p);
    return NULL;
}

/* read_close(plan): no sample runs through the plan any more (each says so: None) and its views
 * of the buffer are released, now or by the last sample in flight in another thread */
PyObject *py_read_close(PyObject *self, PyObject *capsule) {
    ReadPlan *p = (ReadPlan *)PyCapsule_GetPointer(capsule, READ_CAPSULE);
    if (!p) return NULL;
    p->closed = 1;
    if (!p->busy || p->busy_pid != push_pid) read_release(p);
    Py_RETURN_NONE;
}

/* a rank's part of a global draw (sampling/ranks.py): the points start .. start + k of a draw of
 * `of` points whose numbers are keyed_double(key, point) */
typedef struct {
    uint64_t key;
    int64_t start, of;
} Keyed;

/* -- the draws --------------------------------------------------------------------------------- */
/* the lanes' bounds now: first[l], and ends[l] the running sum of their sizes; the total */
static int64_t read_bounds(const ReadPlan *p, int64_t *first, int64_t *ends) {
    const int64_t *cur = (const int64_t *)p->cur.buf;
    int64_t total = 0;
    for (Py_ssize_t l = 0; l < p->lanes; l++) {
        int64_t stop = lane_bounds(cur, l, p->lc, &first[l]);
        total += stop - first[l];
        ends[l] = total;
    }
    return total;
}

/* k ids uniform over the m rows of the bounds (samplers.uniform_ids with replacement: a position
 * in [0, m), then its lane by the running sums) */
static void draw_uniform(ReadPlan *p, const int64_t *first, const int64_t *ends, int64_t m, int64_t *ids, Py_ssize_t k,
                         const Keyed *kd) {
    Py_ssize_t lanes = p->lanes;
    for (Py_ssize_t i = 0; i < k; i++) {
        int64_t pos;
        if (kd) {
            pos = (int64_t)(keyed_double(kd->key, (uint64_t)(kd->start + i)) * (double)m);
            if (pos >= m) pos = m - 1;
        } else {
            pos = next_below(p->rng, m);
        }
        if (lanes == 1) {
            ids[i] = first[0] + pos;
            continue;
        }
        Py_ssize_t lo = 0, hi = lanes - 1; /* the first lane whose running end is past pos */
        while (lo < hi) {
            Py_ssize_t mid = (lo + hi) / 2;
            if (ends[mid] > pos) hi = mid;
            else lo = mid + 1;
        }
        int64_t before = lo ? ends[lo - 1] : 0;
        ids[i] = row_id(first[lo] + pos - before, lo, lanes);
    }
}

/* k rows in proportion to their leaves (samplers.tree_draw): stratified over k segments of the
 * total on a first draw, plainly on a re-draw; their leaves and ids (INVALID_ID: not a row now) */
static void draw_tree(ReadPlan *p, double total, int stratified, int64_t *slots, double *x, double *leaves, int64_t *ids,
                      Py_ssize_t k, const Keyed *kd) {
    const double *sums = (const double *)p->sums.buf;
    double step = total / (double)k;
    if (kd) { /* points start.. of a stratified draw of `of` points (ranks.py's tree_points) */
        step = total / (double)kd->of;
        for (Py_ssize_t i = 0; i < k; i++) {
            uint64_t at = (uint64_t)(kd->start + i);
            x[i] = (keyed_double(kd->key, at) + (double)at) * step;
        }
    } else {
        for (Py_ssize_t i = 0; i < k; i++)
            x[i] = stratified ? (next_double(p->rng) + (double)i) * step : next_double(p->rng) * total;
    }
    tree_walk(sums, &p->lv, p->capacity, x, slots, k);
    /* the rows' stamps and first lines now: their misses overlap the ones of the leaves and the
     * stamps below, and the gather finds them on the way */
    const int64_t *stamp = (const int64_t *)p->stamp.buf;
    for (Py_ssize_t i = 0; i < k; i++) {
        __builtin_prefetch(stamp + slots[i]);
        for (Py_ssize_t g = 0; g < p->ncols; g++) __builtin_prefetch((const char *)p->src[g].buf + slots[i] * p->width[g]);
    }
    for (Py_ssize_t i = 0; i < k; i++) leaves[i] = sums[slots[i]];
    ids_of_slots((const int64_t *)p->stamp.buf, (const int64_t *)p->cur.buf, p->lanes, p->lc, slots, leaves, ids, k);
}

/* reader._unless_updated: an update (ReplayBuffer.update) turns its rows odd and back to the same
 * committed stamp, so a copy across it passes the stamp check half old, half new; every update
 * counts itself first, so when the count moved since `before` (loaded before the first stamps)
 * no row of this gather counts. They are re-drawn (an update anywhere rejects them all, whichever
 * they are: the distribution stays) */
static void unless_updated(const ReadPlan *p, int64_t before, char *ok, Py_ssize_t n) {
    if (__atomic_load_n(&((const int64_t *)p->stats.buf)[COUNTER_UPDATES], __ATOMIC_ACQUIRE) != before) memset(ok, 0, (size_t)n);
}

/* the rows older than their lane's last clear() are not intact (Ring.cleared) */
static void drop_cleared(const ReadPlan *p, const int64_t *ids, Py_ssize_t n, char *ok) {
    const int64_t *cur = (const int64_t *)p->cur.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (ok[i] && number_of_id(ids[i], p->lanes) < load_base(cur, lane_of_id(ids[i], p->lanes))) ok[i] = 0;
}

/* -- transitions (frames.py) ------------------------------------------------------------------ */
/* a transitions read's copies: the outs (one per part), each transition's window slots (-1: not a
 * row of its lane now) and what it found: ok cleared where the kinds rule it out, used the window
 * columns whose rows must be intact */
typedef struct {
    const ReadPlan *p;
    const Columns *c;
    const int64_t *slots;
    char *ok;
    uint64_t *used;
} FramesJob;

/* the first lines of the big rows a transition copies (its window's frames, its own large fields) */
static void frames_prefetch(const ReadPlan *p, const int64_t *sl) {
    for (Py_ssize_t g = 0; g < p->nparts; g++) {
        const Part *t = &p->part[g];
        if (t->width < 256 || (t->k && t->group != g)) continue;
        const char *base = (const char *)p->src[t->col].buf + t->offset;
        size_t stride = (size_t)p->width[t->col];
        for (Py_ssize_t w = t->k ? t->wcol - t->k + 1 : t->wcol; w <= t->wcol; w++)
            if (sl[w] >= 0) prefetch_pages(base + (size_t)sl[w] * stride, (size_t)t->width);
    }
}

/* transitions [lo, hi): their kinds, frames_center, and the parts' copies: a row part from its
 * window row, a stack part by frames_stack, each frame copied from the block once per transition
 * and source (the next observation's stack copies the frames it shares with the observation's
 * from the out, where they are in cache). One chunk of a pool job; no Python calls. */
static void frames_chunk(void *arg, Py_ssize_t lo, Py_ssize_t hi, int who) {
    const FramesJob *j = (const FramesJob *)arg;
    const ReadPlan *p = j->p;
    Py_ssize_t W = p->window, c = p->depth;
    const uint8_t *kinds = (const uint8_t *)p->kind.buf;
    uint8_t kind[MAX_WINDOW];
    int64_t cols[MAX_WINDOW];
    const char *seen[MAX_WINDOW];
    (void)who;
    for (Py_ssize_t i = lo; i < hi; i++) {
        const int64_t *sl = j->slots + i * W;
        if (i + GATHER_AHEAD < hi) frames_prefetch(p, sl + GATHER_AHEAD * W);
        int fine = sl[c] >= 0 && (!p->ahead || sl[c + 1] >= 0);
        for (Py_ssize_t w = 0; w < W; w++) kind[w] = sl[w] >= 0 ? kinds[sl[w]] : 0;
        fine = fine && frames_center(kind, c, (int)p->ahead);
        uint64_t used = ((uint64_t)1 << c) | (p->ahead ? (uint64_t)1 << (c + 1) : 0);
        Py_ssize_t group = -1;
        for (Py_ssize_t g = 0; g < p->nparts && fine; g++) {
            const Part *t = &p->part[g];
            const char *base = (const char *)p->src[t->col].buf + t->offset;
            size_t stride = (size_t)p->width[t->col], w = (size_t)t->width;
            char *to = (char *)j->c->dst[g].buf + (size_t)i * (size_t)j->c->width[g];
            if (!t->k) {
                if (sl[t->wcol] < 0) fine = 0;
                else memcpy(to, base + (size_t)sl[t->wcol] * stride, w);
                used |= (uint64_t)1 << t->wcol;
                continue;
            }
            if (t->group != group) {
                group = t->group;
                memset(seen, 0, sizeof(seen));
            }
            if (!frames_stack(kind, t->wcol, t->k, cols)) {
                fine = 0;
                break;
            }
            for (Py_ssize_t q = 0; q < t->k;) {
                int64_t col = cols[q];
                if (col < 0) {
                    memset(to + (size_t)q * w, 0, w);
                    q++;
                    continue;
                }
                if (sl[col] < 0) {
                    fine = 0;
                    break;
                }
                Py_ssize_t r = q + 1;
                if (seen[col]) { /* copied already: from the out, consecutive frames as one */
                    while (r < t->k && cols[r] == cols[r - 1] + 1 && seen[cols[r]] == seen[cols[r - 1]] + w) r++;
                    memcpy(to + (size_t)q * w, seen[col], (size_t)(r - q) * w);
                } else { /* from the block: frames of consecutive slots of a column of frames as one */
                    if (stride == w)
                        while (r < t->k && cols[r] == cols[r - 1] + 1 && !seen[cols[r]] && sl[cols[r]] == sl[cols[r - 1]] + 1) r++;
                    memcpy(to + (size_t)q * w, base + (size_t)sl[col] * stride, (size_t)(r - q) * w);
                    for (Py_ssize_t x = q; x < r; x++) seen[cols[x]] = to + (size_t)x * w;
                }
                for (Py_ssize_t x = q; x < r; x++) used |= (uint64_t)1 << cols[x];
                q = r;
            }
        }
        if (!fine) j->ok[i] = 0;
        j->used[i] = used;
    }
}

/* the transitions `ids` (frames.py's reads, protocol/reader.py's _transitions): each id's window
 * of rows in its lane (within the lane's rows now), their first stamps (acquire), the copies of
 * the parts (frames_chunk, on the pool's threads when big), an acquire fence, the second stamps
 * of the rows used; ok[i]: the transition is whole, every row it used intact. No Python calls. */
static void read_transitions(const ReadPlan *p, const Columns *c, const int64_t *ids, Py_ssize_t n, char *ok) {
    Py_ssize_t W = p->window, lanes = p->lanes;
    size_t mw = (size_t)n * (size_t)W;
    int64_t *slots = (int64_t *)malloc((2 * mw + (size_t)n) * sizeof(int64_t));
    if (!slots) { /* the rows are re-drawn, and Python's path reads them in the end */
        memset(ok, 0, (size_t)n);
        return;
    }
    int64_t *firsts = slots + mw;
    uint64_t *used = (uint64_t *)(firsts + mw);
    const int64_t *cur = (const int64_t *)p->cur.buf, *stamp = (const int64_t *)p->stamp.buf;
    const uint8_t *kinds = (const uint8_t *)p->kind.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t lane = lane_of_id(ids[i], lanes), num = number_of_id(ids[i], lanes);
        int64_t start, stop = lane_bounds(cur, lane, p->lc, &start);
        int64_t *sl = slots + (size_t)i * (size_t)W, *fi = firsts + (size_t)i * (size_t)W;
        ok[i] = 1;
        for (Py_ssize_t w = 0; w < W; w++) {
            int64_t r = wrap_madd(1, num, w - p->depth);
            if (r < start || r >= stop) {
                sl[w] = -1;
                continue;
            }
            sl[w] = slot_of(lane, r, p->lc);
            fi[w] = stamp_first(stamp, sl[w]);
            __builtin_prefetch(kinds + sl[w]);
        }
        for (Py_ssize_t g = 0; g < p->nparts; g++) { /* the rows are random: their first lines now */
            const Part *t = &p->part[g];
            if (sl[t->wcol] < 0) continue;
            const char *row = (const char *)p->src[t->col].buf + (size_t)sl[t->wcol] * (size_t)p->width[t->col] + t->offset;
            for (Py_ssize_t b = 0; b < t->width && b < 256; b += 64) __builtin_prefetch(row + b);
        }
    }
    FramesJob job = {p, c, slots, ok, used};
    pool_run(frames_chunk, &job, n, c->total);
    stamps_fence();
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!ok[i]) continue;
        int64_t num = number_of_id(ids[i], lanes);
        const int64_t *sl = slots + (size_t)i * (size_t)W, *fi = firsts + (size_t)i * (size_t)W;
        for (Py_ssize_t w = 0; w < W; w++) {
            if (!(used[i] >> w & 1)) continue;
            if (!stamp_intact(stamp, sl[w], fi[w], committed_stamp(wrap_madd(1, num, w - p->depth)))) {
                ok[i] = 0;
                break;
            }
        }
    }
    free(slots);
}

/* -- the call ---------------------------------------------------------------------------------- */
/* per call: the outs' views and the scratch */
typedef struct {
    Columns c;
    Py_buffer ids, ok, leaves, weights;
    int nviews; /* of ids, ok, leaves, weights */
} Call;

/* the rows (or with frames the transitions) `ids` into the outs, ok[i]: intact; scratch of 2n */
static void read_rows(const ReadPlan *p, Columns *c, const int64_t *ids, Py_ssize_t n, int64_t *scratch, char *ok) {
    if (p->frames) read_transitions(p, c, ids, n, ok);
    else gather_rows(c, ids, n, p->lanes, (const int64_t *)p->stamp.buf, p->lc, scratch, scratch + n, ok);
}

/* Under max_use (reader.claim, Priorities.claim): under the lock, count a use of each of the k rows
 * `ids` whose ok is set, in order, while it is still current and has uses left; the ok of the
 * others is cleared (they are re-drawn). A row that reaches max_use leaves the tree (`done`:
 * scratch of k slots). Returns 0, or -1 when the lock is not taken at once (busy, its holder
 * died, repairs owed: Python's steps wait or repair): then nothing is counted and every ok is
 * cleared. No Python calls. */
static int claim_rows(ReadPlan *p, const int64_t *ids, char *ok, Py_ssize_t k, int64_t *done) {
    if (!lock_try(p->lock.buf)) {
        memset(ok, 0, (size_t)k);
        return -1;
    }
    const int64_t *stamp = (const int64_t *)p->stamp.buf, *cur = (const int64_t *)p->cur.buf;
    uint32_t *uses = (uint32_t *)p->uses.buf;
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (!ok[i]) continue;
        int64_t slot;
        if (!id_current(ids[i], stamp, cur, p->lanes, p->lc, &slot) || uses[slot] >= (uint64_t)p->max_use) {
            ok[i] = 0;
            continue;
        }
        if (++uses[slot] >= (uint64_t)p->max_use) done[m++] = slot;
    }
    if (m) {
        tree_set((double *)p->sums.buf, (double *)p->mins.buf, &p->lv, done, NULL, 0.0, m);
        ((int64_t *)p->stats.buf)[COUNTER_REMOVED] = 1;
    }
    pthread_mutex_unlock((pthread_mutex_t *)p->lock.buf);
    return 0;
}

/* re-draw and gather again the positions not intact (or not claimed), a few rounds, each drawn
 * from the bounds or the tree's total of now (as the Python re-draw reads them: rows written,
 * updated or used up meanwhile move them); the positions still not intact (or not claimed: under
 * max_use every position that is ok has been counted, every other not) */
static Py_ssize_t redraw(ReadPlan *p, Columns *c, int64_t *ids, char *ok, double *leaves, Py_ssize_t n, int64_t *first,
                         int64_t *ends) {
    Py_ssize_t bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) bad += !ok[i];
    if (!bad) return 0;
    /* scratch: positions, ids, slots + first stamps (2 each), oks, leaves, x, and the rows */
    size_t rowbytes = 0;
    for (Py_ssize_t g = 0; g < c->n; g++) rowbytes += (size_t)c->width[g];
    char *mem = (char *)PyMem_Malloc((size_t)bad * (6 * 8 + 1 + rowbytes) + 64);
    if (!mem) return bad; /* the caller's slow path re-draws them (nothing counted for them) */
    int64_t *at = (int64_t *)mem, *nid = at + bad, *scratch = nid + bad;
    double *nleaf = (double *)(scratch + 2 * bad), *x = nleaf + bad;
    char *nok = (char *)(x + bad), *rows = nok + bad;
    Columns t;
    t.n = c->n;
    t.total = 0;
    size_t off = 0;
    for (Py_ssize_t g = 0; g < c->n; g++) {
        t.src[g].buf = c->src[g].buf;
        t.width[g] = c->width[g];
        t.dst[g].buf = rows + off;
        off += (size_t)c->width[g] * (size_t)bad;
    }
    for (int round = 0; round < REDRAW_ROUNDS && bad; round++) {
        Py_ssize_t k = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            if (!ok[i]) at[k++] = i;
        if (p->tree) {
            double total = ((const double *)p->sums.buf)[p->lv.size - 1];
            if (!(total > 0)) break;
            draw_tree(p, total, 0, scratch, x, nleaf, nid, k, NULL);
        } else {
            int64_t m = read_bounds(p, first, ends);
            if (m <= 0) break;
            draw_uniform(p, first, ends, m, nid, k, NULL);
        }
        int64_t updates = __atomic_load_n(&((const int64_t *)p->stats.buf)[COUNTER_UPDATES], __ATOMIC_ACQUIRE);
        read_rows(p, &t, nid, k, scratch, nok);
        unless_updated(p, updates, nok, k);
        drop_cleared(p, nid, k, nok);
        int stop = p->counting && claim_rows(p, nid, nok, k, scratch) < 0;
        for (Py_ssize_t j = 0; j < k; j++) {
            Py_ssize_t i = at[j];
            ids[i] = nid[j];
            ok[i] = nok[j];
            if (leaves) leaves[i] = nleaf[j];
            for (Py_ssize_t g = 0; g < c->n; g++) {
                size_t w = (size_t)c->width[g];
                memcpy((char *)c->dst[g].buf + (size_t)i * w, (char *)t.dst[g].buf + (size_t)j * w, w);
            }
            bad -= nok[j] != 0;
        }
        if (stop) break; /* the lock is busy: Python's loop claims the rest */
    }
    PyMem_Free(mem);
    return bad;
}

static void call_close(Call *call) {
    Py_buffer *views[4] = {&call->ids, &call->ok, &call->leaves, &call->weights};
    for (int i = 0; i < call->nviews; i++) PyBuffer_Release(views[i]);
    for (Py_ssize_t g = 0; g < call->c.n; g++) PyBuffer_Release(&call->c.dst[g]);
    call->c.n = 0;
}

/* the outs of a call: one per plan column ((n, row bytes), writable), ids (n int64), ok (n bool),
 * and with a tree leaves (n float64) and weights (n float32) (args[5], args[6]); -1 with an error */
static int call_open(const ReadPlan *p, Call *call, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t *n) {
    PyObject *outs = args[1];
    call->nviews = 0;
    call->c.n = 0;
    Py_ssize_t nouts = p->frames ? p->nparts : p->ncols;
    if (!PyTuple_Check(outs) || PyTuple_GET_SIZE(outs) != nouts) {
        PyErr_SetString(PyExc_ValueError, "sample: expected one out per column (with frames: per part) of the plan");
        return -1;
    }
    if (get_buf(args[2], &call->ids, 1, 8, "ids") < 0) return -1;
    call->nviews = 1;
    if (get_buf(args[3], &call->ok, 1, 1, "ok") < 0) return -1;
    call->nviews = 2;
    *n = call->ids.len / 8;
    if (call->ok.len != *n || *n < 1) {
        PyErr_SetString(PyExc_ValueError, "sample: expected at least one id and one ok per id");
        return -1;
    }
    if (p->tree) {
        if (nargs < 7 || get_buf(args[5], &call->leaves, 1, 8, "leaves") < 0) goto no_tree;
        call->nviews = 3;
        if (call->leaves.len / 8 != *n) {
            PyErr_SetString(PyExc_ValueError, "sample: expected one leaf per id");
            return -1;
        }
        if (args[6] != Py_None) { /* weights: None for a uniform draw from the tree (max_use) */
            if (get_buf(args[6], &call->weights, 1, 4, "weights") < 0) return -1;
            call->nviews = 4;
            if (call->weights.len / 4 != *n) {
                PyErr_SetString(PyExc_ValueError, "sample: expected one weight per id");
                return -1;
            }
        }
    }
    call->c.total = 0;
    for (Py_ssize_t g = 0; g < nouts; g++) {
        if (get_buf(PyTuple_GET_ITEM(outs, g), &call->c.dst[g], 1, 0, "sample out") < 0) return -1;
        call->c.n = g + 1;
        const Part *t = &p->part[g];
        call->c.src[g].buf = p->frames ? NULL : p->src[g].buf;
        call->c.width[g] = p->frames ? t->width * (t->k ? t->k : 1) : p->width[g];
        if (call->c.dst[g].len != call->c.width[g] * *n) {
            PyErr_Format(PyExc_ValueError, "sample: out %zd: expected (n, %zd) bytes", g, call->c.width[g]);
            return -1;
        }
        call->c.total += (size_t)call->c.width[g] * (size_t)*n;
    }
    return 0;
no_tree:
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "sample: a prioritized plan takes leaves and weights");
    return -1;
}

/* sample(plan, outs, ids, ok, nogil[, leaves, weights, beta][, keyed]) -> int: len(ids) rows drawn (uniform, or
 * with the plan's tree in proportion to their leaves, stratified, and their importance weights
 * with `beta`), gathered with the stamp check into outs (one per column of the plan), the rows not
 * intact re-drawn and gathered again (a few rounds). Returns how many positions are still not
 * intact (ok says which; the caller's slow path takes them; under max_use exactly the positions
 * that are ok counted a use), or -1 when the call served nothing and counted nothing: the plan is
 * closed, the buffer holds no row (or the tree no mass) to draw, or the lock was busy for the
 * first claim, or (frames) no position holds a whole transition. The GIL is released around the gather when it is
 * big (NOGIL_BYTES) or `nogil` is true (a thread that samples for another: the loader's). `keyed`,
 * (key, start, of) or None: the first draw is a rank's points start .. start + n of a global draw of
 * `of` points (Keyed), not the plan's generator's; re-draws take the plan's generator. */
PyObject *py_sample(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 5 || nargs > 9) {
        PyErr_SetString(PyExc_TypeError, "sample(plan, outs, ids, ok, nogil[, leaves, weights, beta][, keyed])");
        return NULL;
    }
    ReadPlan *p = (ReadPlan *)PyCapsule_GetPointer(args[0], READ_CAPSULE);
    if (!p) return NULL;
    if (p->closed) return PyLong_FromLong(-1);
    int nogil = PyObject_IsTrue(args[4]);
    if (nogil < 0) return NULL;
    Keyed keyed, *kd = NULL;
    Py_ssize_t at = p->tree ? 8 : 5; /* keyed's place: after the tree's arguments */
    if (nargs > at + 1) {
        PyErr_SetString(PyExc_TypeError, "sample: too many arguments for this plan");
        return NULL;
    }
    if (nargs == at + 1 && args[at] != Py_None) {
        unsigned long long key;
        if (!PyArg_ParseTuple(args[at], "KLL:sample keyed", &key, &keyed.start, &keyed.of)) return NULL;
        keyed.key = (uint64_t)key;
        kd = &keyed;
    }
    double beta = 0.0;
    if (p->tree) {
        if (nargs < 8) {
            PyErr_SetString(PyExc_TypeError, "sample: a prioritized plan takes leaves, weights and beta");
            return NULL;
        }
        beta = PyFloat_AsDouble(args[7]);
        if (beta == -1.0 && PyErr_Occurred()) return NULL;
    }
    Call call;
    Py_ssize_t n = 0;
    PyObject *result = NULL;
    int64_t *scratch = NULL, *first = NULL;
    if (call_open(p, &call, args, nargs, &n) < 0) goto done;
    if (kd && (kd->start < 0 || kd->of < kd->start + n)) {
        PyErr_SetString(PyExc_ValueError, "sample: keyed points start .. start + n must lie in a draw of `of` points");
        goto done;
    }
    int64_t *ids = (int64_t *)call.ids.buf;
    char *ok = (char *)call.ok.buf;
    double *leaves = p->tree ? (double *)call.leaves.buf : NULL;
    /* scratch: slots and first stamps (2n), the x of a tree draw (n), the lanes' bounds (2 lanes) */
    scratch = (int64_t *)PyMem_Malloc(((size_t)n * 3 + 2 * (size_t)p->lanes) * sizeof(int64_t));
    if (!scratch) { PyErr_NoMemory(); goto done; }
    first = scratch + 3 * n;
    int64_t *ends = first + p->lanes;
    const int64_t *counters = (const int64_t *)p->stats.buf;
    int64_t updates = __atomic_load_n(&counters[COUNTER_UPDATES], __ATOMIC_ACQUIRE);
    double total = 0.0;
    if (p->tree) {
        const double *sums = (const double *)p->sums.buf;
        total = sums[p->lv.size - 1]; /* SumTree.total: the last prefix sum of the top level */
        if (!(total > 0)) { result = PyLong_FromLong(-1); goto done; }
        draw_tree(p, total, 1, scratch, (double *)(scratch + n), leaves, ids, n, kd);
    } else {
        int64_t m = read_bounds(p, first, ends);
        if (m <= 0) { result = PyLong_FromLong(-1); goto done; }
        draw_uniform(p, first, ends, m, ids, n, kd);
    }
    if (p->busy_pid != push_pid) { /* the first sample here, or in a forked child: none in flight */
        p->busy = 0;
        p->busy_pid = push_pid;
    }
    p->busy++; /* the GIL is held here: only a copy without it lets read_close run meanwhile */
    PyThreadState *ts = nogil || call.c.total >= NOGIL_BYTES ? PyEval_SaveThread() : NULL;
    read_rows(p, &call.c, ids, n, scratch, ok);
    if (ts) PyEval_RestoreThread(ts);
    p->busy--;
    if (p->closed) { /* closed meanwhile: the views are ours to release, the rows not to serve */
        if (!p->busy) read_release(p);
        result = PyLong_FromLong(-1);
        goto done;
    }
    unless_updated(p, updates, ok, n);
    drop_cleared(p, ids, n, ok);
    if (p->counting && claim_rows(p, ids, ok, n, scratch) < 0) { /* nothing counted: Python's steps */
        result = PyLong_FromLong(-1);
        goto done;
    }
    Py_ssize_t bad = redraw(p, &call.c, ids, ok, leaves, n, first, ends);
    if (p->frames && bad == n) { /* no whole transition (frames.py): maybe none is held; nothing counted */
        result = PyLong_FromLong(-1);
        goto done;
    }
    if (call.nviews == 4) weights_of((const double *)p->mins.buf, &p->lv, leaves, n, beta, (float *)call.weights.buf);
    result = PyLong_FromSsize_t(bad);
done:
    PyMem_Free(scratch);
    call_close(&call);
    return result;
}
