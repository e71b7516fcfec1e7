/* What the extension's C files share besides the block's layout (layout.h): buffer views, the
 * priority tree's levels and walks, the lock, a push's copies, the push plan and the push method
 * types, and the functions module.c lists in its method table. */
#ifndef SHMBUFFER_NATIVE_H
#define SHMBUFFER_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>

#include "layout.h"

#define MAX_COLS 64   /* columns (fields) of one gather, put or push */
#define MAX_LEVELS 32 /* levels of the priority tree */
#define MAX_DIMS 16   /* dimensions of a field's shape in a push plan */

/* Copies of at least this many bytes in all run without the GIL (gather, stacks, put, push);
 * -DNOGIL_BYTES=... overrides it for a measurement. Releasing the GIL costs nothing measurable
 * for copies of 16 KiB and more and lets another thread run Python meanwhile, but below about
 * 1 MiB that thread got no more work done either way (2 cores): 256 KiB lies between the two. */
#ifndef NOGIL_BYTES
#define NOGIL_BYTES (256 * 1024)
#endif

/* -- buffers (common.c) ------------------------------------------------------------------------ */
int same_format(const char *f, const char *want);
int get_buf(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize, const char *what);
Py_ssize_t lanes_of(const Py_buffer *cursors, Py_ssize_t capacity, const char *what);
/* the reservation in lanes, under the ring's lock (copies.c): -1 a cursor out of range, 0 a slot
 * odd (nothing written), 1 reserved */
int reserve_in_lanes(int64_t *cur, Py_ssize_t lanes, int64_t lc, int64_t *stamp, uint16_t *owner, const int64_t *each,
                     int64_t all, Py_ssize_t k, uint16_t writer, int64_t *rows, int64_t *slots, int64_t *ids, int64_t *was,
                     int64_t *at, int64_t *count);

/* lock.py's robust mutex, tried once (common.c): 1 held, 0 not taken */
int lock_try(void *lock);

/* a lane's cursor and base, loaded with acquire (a writer's release store moved them) */
static inline int64_t load_cursor(const int64_t *cur, int64_t lane) {
    return __atomic_load_n(&cur[LANE_WORDS * lane + LANE_CURSOR], __ATOMIC_ACQUIRE);
}
static inline int64_t load_base(const int64_t *cur, int64_t lane) {
    return __atomic_load_n(&cur[LANE_WORDS * lane + LANE_BASE], __ATOMIC_ACQUIRE);
}
/* a lane's rows now (rows.bounds): its cursor (returned: the stop) and its first row (*start). The
 * cursor is loaded before the base, in two statements (a call's arguments have no order): a
 * clear() moves the base first, so one between the loads reads as an empty lane, never as its
 * cleared rows */
static inline int64_t lane_bounds(const int64_t *cur, int64_t lane, int64_t lc, int64_t *start) {
    int64_t stop = load_cursor(cur, lane);
    *start = first_row(stop, load_base(cur, lane), lc);
    return stop;
}

/* Ring.current's test for one id: its slot holds its committed stamp and the row is not older
 * than its lane's base (clear()); *slot is its slot */
static inline int id_current(int64_t id, const int64_t *stamp, const int64_t *cur, Py_ssize_t lanes, int64_t lc, int64_t *slot) {
    int64_t lane = lane_of_id(id, lanes), row = number_of_id(id, lanes);
    *slot = slot_of(lane, row, lc);
    return __atomic_load_n(&stamp[*slot], __ATOMIC_ACQUIRE) == committed_stamp(row) && row >= load_base(cur, lane);
}

/* The reader's stamped copy (rows.py's commit protocol, the memory order in module.c), which
 * every C reader follows: stamp_first(slot) before the row's copy (acquire: the copy's loads stay
 * after it); once all the copies are done, stamps_fence() (acquire: the copies' loads stay before
 * the second loads); then stamp_intact(slot, first, expected) for each row, the second load
 * (relaxed: the fence orders it) and rows.intact. */
static inline int64_t stamp_first(const int64_t *stamp, int64_t slot) { return __atomic_load_n(&stamp[slot], __ATOMIC_ACQUIRE); }
static inline void stamps_fence(void) { __atomic_thread_fence(__ATOMIC_ACQUIRE); }
static inline int stamp_intact(const int64_t *stamp, int64_t slot, int64_t first, int64_t expected) {
    return intact(first, __atomic_load_n(&stamp[slot], __ATOMIC_RELAXED), expected);
}

/* the id each slot's stamp names (ring.Ring.ids_of_slots), INVALID_ID where the slot is empty,
 * being written, older than its lane's bounds or on a leaf of 0: the stamps are loaded first,
 * then the bounds (priorities.c) */
void ids_of_slots(const int64_t *stamp, const int64_t *cur, Py_ssize_t lanes, int64_t lc, const int64_t *slots,
                  const double *leaves, int64_t *ids, Py_ssize_t n);

/* -- the draws' generator: xoshiro256** (sample.c's read plans, learner.c's device samples) ----- */
static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static inline uint64_t next_u64(uint64_t *s) {
    uint64_t result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

/* a double in [0, 1) from the top 53 bits, as numpy's random() makes one */
static inline double next_double(uint64_t *s) { return (double)(next_u64(s) >> 11) * (1.0 / 9007199254740992.0); }

/* a position in [0, m) (m > 0), uniform: samplers.uniform_ids' rule */
static inline int64_t next_below(uint64_t *s, int64_t m) {
    int64_t pos = (int64_t)(next_double(s) * (double)m);
    return pos < m ? pos : m - 1;
}

/* a counter-based double in [0, 1): point `i` of the stream `key` (sampling/ranks.py's `uniforms`,
 * the same arithmetic in numpy): splitmix64's finaliser of i * golden + key, its top 53 bits. Any
 * point of a draw is computed alone, so each rank computes only its own points of a global batch */
static inline double keyed_double(uint64_t key, uint64_t i) {
    uint64_t z = i * 0x9E3779B97F4A7C15ULL + key;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

/* -- the priority tree (tree.c) ---------------------------------------------------------------- */
typedef struct {
    Py_ssize_t n;               /* levels, leaves first; the last is the top */
    Py_ssize_t len[MAX_LEVELS]; /* nodes per level */
    Py_ssize_t at[MAX_LEVELS];  /* offset of each level in the arrays */
    Py_ssize_t cum;             /* offset of the prefix sum of the top level */
    Py_ssize_t size;            /* the arrays' length */
} Levels;

int levels_read(PyObject *lengths, Py_ssize_t capacity, Py_ssize_t size, Levels *lv);
void tree_walk(const double *sums, const Levels *lv, Py_ssize_t capacity, double *x, int64_t *node, Py_ssize_t n);
void weights_of(const double *mins, const Levels *lv, const double *leaves, Py_ssize_t n, double beta, float *out);
void tree_set(double *sums, double *mins, const Levels *lv, const int64_t *slots, const double *values, double scalar,
              Py_ssize_t n);

/* -- a push's copies (copies.c) ---------------------------------------------------------------- */
/* source g (k rows of width[g] bytes, C-contiguous) into the k slots of target g, a (capacity,
 * row[g] bytes) column, at to[g] (the column's first row plus the field's offset) */
typedef struct {
    Py_ssize_t n;
    char *to[MAX_COLS];
    const char *from[MAX_COLS];
    Py_ssize_t width[MAX_COLS], row[MAX_COLS];
    size_t total;
    Py_buffer src[MAX_COLS], dst[MAX_COLS]; /* views held by copies_open, released by copies_close */
} Copies;

/* the copies into the k slots (`slots`, or `first` and the k - 1 after it); no Python calls */
void copies_run(const Copies *c, Py_ssize_t k, const int64_t *slots, int64_t first);
/* each slot's stamp from 2n + 1 to 2n + 2 with a release store: the copies become visible first */
void commit_slots(int64_t *stamp, Py_ssize_t k, const int64_t *slots, int64_t first);

/* -- the reader's gather (gather.c) ----------------------------------------------------------- */
/* a gather's columns: source c is (capacity, width[c] bytes), out c (n, width[c] bytes) */
typedef struct {
    Py_ssize_t n;
    Py_buffer src[MAX_COLS], dst[MAX_COLS];
    Py_ssize_t width[MAX_COLS];
    size_t total;
} Columns;

/* the views of the sources and outs (tuples of as many), checked; -1 with an error, none held */
int columns_open(Columns *c, PyObject *src_o, PyObject *out_o, Py_ssize_t capacity, Py_ssize_t n);
void columns_close(Columns *c);
/* The stamped copy of n rows: each id's slot and first stamp (acquire), the columns' rows, an
 * acquire fence, the second stamps; ok[i]: both equal the stamp the id's row shows once committed.
 * slots and first: scratch of n. Returns the smallest id (INT64_MAX for none). No Python calls. */
int64_t gather_rows(const Columns *c, const int64_t *ids, Py_ssize_t n, Py_ssize_t lanes, const int64_t *stamp,
                    int64_t lc, int64_t *slots, int64_t *first, char *ok);

/* rows n0 .. n0 + n - 1 in the consecutive slots first .. first + n - 1 (a lane's run) into rows
 * to .. to + n - 1 of the outs by the stamped copy, each column's run one memcpy; ok[i]: row
 * n0 + i is intact. firsts: scratch of n. Returns the intact rows. No Python calls. */
Py_ssize_t gather_run_rows(const Columns *c, Py_ssize_t first, Py_ssize_t n, int64_t n0, const int64_t *stamp,
                           Py_ssize_t to, int64_t *firsts, char *ok);

/* rows slots[i] of every source into row i of its out, without stamps (the caller knows the rows
 * stay as they are: a device copy's held rows, under its mutex); the pool's threads when big */
void copy_slots(const Columns *c, const int64_t *slots, Py_ssize_t n);

#define GATHER_PAGE 4096
#define GATHER_AHEAD 2 /* rows (transitions) ahead whose pages are asked for */

/* The first line of each 4 KiB page of a row still to copy: /dev/shm maps 4 KiB pages, and the
 * hardware prefetcher stops at each page's end, so without this every page of a random row
 * starts with a TLB walk and a miss that the copy waits for (benchmarks/README.md, "Huge pages") */
static inline void prefetch_pages(const char *row, size_t w) {
    uintptr_t at = (uintptr_t)row, end = at + w;
    __builtin_prefetch(row);
    for (uintptr_t page = (at | (GATHER_PAGE - 1)) + 1; page < end; page += GATHER_PAGE) __builtin_prefetch((const char *)page);
}

/* frames.py's read rules on one transition's window of rows (their _kind bits, oldest first; the
 * transition's own row is column c). frames.center's part that the kinds decide: row c is not an
 * end or lead row, and with `ahead` (next_of) row c + 1 does not start another episode. */
int frames_center(const uint8_t *kind, Py_ssize_t c, int ahead);
/* frames.stack_plan: the window column of each of the k frames (chronological) of the stack whose
 * newest frame is column `last` (>= k - 1), -1 for a zero: real back to and including the first row
 * that starts an episode, older ones that row's frame (or zeros where it is marked ZERO). 0 when a
 * real frame other than the newest is an end row. Every column named must be an intact row. */
int frames_stack(const uint8_t *kind, Py_ssize_t last, Py_ssize_t k, int64_t *cols);

/* -- the one-call sample (sample.c) ----------------------------------------------------------- */
PyObject *py_read_plan(PyObject *self, PyObject *args);
PyObject *py_read_close(PyObject *self, PyObject *capsule);
PyObject *py_sample(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* -- the copy threads (pool.c) ----------------------------------------------------------------- */
/* Big gathers (gather_rows, stacks) split their copies over up to POOL_MAX threads, the caller
 * included, never more than the CPUs the process may use; only copies of at least POOL_BYTES in
 * all (-DPOOL_BYTES=... overrides it for a measurement). Measured on the 2-core VM (shared with
 * other work, random Atari rows from /dev/shm): the hand-off costs 5-10 us at the median, 2 threads
 * were 0.85-0.9x of one at 1.7-3.5 MiB and break even from about 7 MiB; 256 MuJoCo rows (42 KiB)
 * never come near it. Each thread claims contiguous chunks, POOL_CHUNKS per thread in all. */
#ifndef POOL_BYTES
#define POOL_BYTES (4 * 1024 * 1024)
#endif
#ifndef POOL_MAX
#define POOL_MAX 4
#endif
#ifndef POOL_CHUNKS
#define POOL_CHUNKS 4
#endif
/* one chunk of a pool job: items [lo, hi) of it, on thread `who` (0: the caller; < POOL_MAX) */
typedef void (*pool_fn)(void *arg, Py_ssize_t lo, Py_ssize_t hi, int who);
/* fn over [0, n) in contiguous chunks, on the pool's threads when `bytes` (the job's copies) is at
 * least POOL_BYTES, else on this thread alone; returns once every chunk is done, all its writes
 * visible to the caller (a mutex join). Never calls Python; safe without the GIL and in a forked child. */
void pool_run(pool_fn fn, void *arg, Py_ssize_t n, size_t bytes);
int pool_init(void);          /* the fork handlers, at import (module.c); -1: the pool stays off */
int pool_threads(void);       /* threads a big gather uses now, the caller included */
void pool_set_threads(int k); /* k >= 1 threads (1: off), 0: automatic */

/* -- the push plan (plan.c) and the one-call push (push.c) -------------------------------------- */
#define PLAN_CAPSULE "shmbuffer.plan"

/* what a push writes, once per buffer: views of the ring's columns and each field's target */
typedef struct {
    Py_buffer lock, cur, stats, stamp, owner, writers, me, episode;
    int has_episode, held, closed, busy; /* held: ring views held; closed: plan_close was called; busy: pushes in flight */
    pid_t busy_pid;                     /* the process whose pushes `busy` counts (not a forked child: none in flight there) */
    Py_ssize_t n_dst;                   /* target views held (0 once released) */
    Py_ssize_t n, lanes, capacity, lc, envs;
    PyObject *names[MAX_COLS];
    char *format[MAX_COLS];
    Py_buffer dst[MAX_COLS];
    Py_ssize_t offset[MAX_COLS], width[MAX_COLS], row[MAX_COLS], ndim[MAX_COLS], shape[MAX_COLS][MAX_DIMS];
    PyObject *empty, *int64; /* numpy.empty and numpy's int64 dtype: the ids' array */
} PushPlan;

extern pid_t push_pid; /* this process's pid, renewed in a forked child: no system call per push */
int push_init(void);
void plan_release(PushPlan *p);
PushPlan *plan_of(PyObject *capsule);
/* ReplayBuffer.push's usual calls in C (push.c): the ids, None (a new reference) where the
 * Python method must run, or NULL with an error */
PyObject *push_from_args(PushPlan *p, PyObject *const *args, Py_ssize_t given, PyObject *kwnames);

/* -- the push method (method.c) ---------------------------------------------------------------- */
extern PyTypeObject PushMethodType, BoundPushType;

/* -- a device copy on the CPU (refresh.c: its refresh; learner.c: its mutex, lag question and
 * uniform sample on the learner's thread) ----------------------------------------------------- */
/* the words of the copy's state array (rows.py's State) */
#define ST_COUNT 0    /* usable slots: the first ST_COUNT entries of dense */
#define ST_PENDING 1  /* ids in pending */
#define ST_UPDATES 2  /* Counter.UPDATES as of the last refresh (the lag question's) */
#define ST_DELETES 3  /* Counter.DELETES as of the last refresh (the lag question's) */
#define ST_INSERTED 4 /* Counter.INSERTED read as the last refresh began */
#define ST_AT 5       /* CLOCK_MONOTONIC ns as the last refresh began (Python's time.monotonic_ns) */
#define ST_DONE 6     /* refreshes done */
#define ST_ERROR 7    /* 1: the background refresher stopped on inconsistent slot lists */
#define ST_SPENT 8    /* ns spent inside refreshes, all told */
#define ST_TAKEN 9    /* rows taken in by refreshes, all told */
#define ST_WAITED 10  /* ns of ST_SPENT waiting for the slot lists' mutex (a sample held it), all told */
#define ST_CPU 11     /* ns of CPU time the refreshing thread spent in them, all told */
#define ST_EDITS 12   /* Counter.EDITS as the last refresh began, -1: copy every row again */
#define ST_REDRAWN 13 /* rows device_sample drew again: a refresh dropped their slot as they were copied */
#define ST_DROPS 14   /* the lists' changes that dropped slots (each drop stores it in the slot's `dropped`) */
#define ST_WORDS 16
/* the copy's two private pthread mutexes in 2 * MUTEX_BYTES of a numpy array of the copy's: the
 * slot lists' at byte 0, the refreshes' (one at a time) at byte MUTEX_BYTES */
#define MUTEX_BYTES 64
/* the view of a copy's mutexes, checked: 0, or -1 with an error set and none held */
int get_mutex(PyObject *o, Py_buffer *view);
pthread_mutex_t *refresh_mutex(void *mutexes);
int64_t now_ns(void); /* CLOCK_MONOTONIC ns (Python's time.monotonic_ns) */
/* replay.py's _behind, from the shared cursors and counters and the copy's state and bases: a
 * lane cleared, or past a bound (rows_bound rows, or an update or a delete, under a row bound;
 * ns_bound ns since the last refresh began, once something changed; < 0: no such bound), or, with
 * no bound and `idle` (the refresher's question), anything changed */
int copy_behind(const int64_t *cur, Py_ssize_t lanes, const int64_t *counters, const int64_t *state,
                const int64_t *bases, int64_t rows_bound, int64_t ns_bound, int idle);

/* -- the module's functions ------------------------------------------------------------------- */
PyObject *py_tree_find(PyObject *self, PyObject *args);
PyObject *py_tree_update(PyObject *self, PyObject *args);
PyObject *py_weights(PyObject *self, PyObject *args);
PyObject *py_tree_draw(PyObject *self, PyObject *args);
PyObject *py_scan(PyObject *self, PyObject *arg);
PyObject *py_known(PyObject *self, PyObject *args);
PyObject *py_current(PyObject *self, PyObject *args);
PyObject *py_update_priorities(PyObject *self, PyObject *args);
PyObject *py_gather(PyObject *self, PyObject *args);
PyObject *py_gather_run(PyObject *self, PyObject *args);
PyObject *py_refresh(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_refresher_start(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_refresher_stop(PyObject *self, PyObject *capsule);
PyObject *py_refresher_running(PyObject *self, PyObject *capsule);
PyObject *py_behind(PyObject *self, PyObject *args);
PyObject *py_device_sample(PyObject *self, PyObject *args);
PyObject *py_mutex_init(PyObject *self, PyObject *arg);
PyObject *py_mutex_lock(PyObject *self, PyObject *arg);
PyObject *py_mutex_unlock(PyObject *self, PyObject *arg);
PyObject *py_stacks(PyObject *self, PyObject *args);
PyObject *py_put(PyObject *self, PyObject *args);
PyObject *py_reserve(PyObject *self, PyObject *args);
PyObject *py_reserve_lanes(PyObject *self, PyObject *args);
PyObject *py_lanes_worst(PyObject *self, PyObject *args);
PyObject *py_plan(PyObject *self, PyObject *args, PyObject *kwds);
PyObject *py_plan_close(PyObject *self, PyObject *capsule);
PyObject *py_check(PyObject *self, PyObject *args);
PyObject *py_push(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_set_threads(PyObject *self, PyObject *arg);
PyObject *py_stop_threads(PyObject *self, PyObject *unused);
PyObject *py_threads(PyObject *self, PyObject *unused);

#endif
