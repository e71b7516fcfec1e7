/* shmbuffer's native hot path, the module shmbuffer.native._native: its method table and init.
 *
 * Plain C and the CPython C API (buffer protocol only: no numpy headers, so the build needs
 * nothing but a compiler and setuptools). Every entry point checks what it is given (buffer
 * sizes, contiguity, slots in range) and raises rather than reading or writing out of bounds;
 * the Python callers are the reference implementation and the fallback (shmbuffer/native/
 * __init__.py), and tests/test_native.py checks both agree.
 *
 * The files: layout.h (the block's layout and the row arithmetic, checked against the Python
 * definitions by tests/test_native.py), native.h (what the C files share), common.c (buffer
 * views, the lock), tree.c (the priority tree), priorities.c (prioritized draws and updates),
 * gather.c (the reader's stamped copies, a lane's runs of rows, frame stacks), refresh.c (a device copy's
 * refresh on the CPU), learner.c (that copy's mutex, lag question and uniform sample), sample.c (the one-call sample: draw, gather,
 * re-draws, weights), pool.c (the threads that share a big gather's copies), copies.c (a push's copies, commit and
 * reservation as steps Python drives), plan.c and push.c (the one-call push), method.c
 * (ReplayBuffer.push as a method whose usual calls run in C).
 *
 * Memory ordering (the commit protocol, a seqlock per row: protocol/rows.py). The C kernels use
 * the C11/GCC __atomic builtins with the orders named at each use: a reader loads each slot's
 * stamp with acquire before it copies the row, issues an acquire fence after the copies, then
 * loads the stamps again (native.h's stamp_first, stamps_fence, stamp_intact); a writer stores
 * the odd stamps with release after the owners, the cursors with release after the stamps, and
 * the committing even stamp with release after its copies (copies.c's reserve_slots,
 * commit_slots). The package still refuses every CPU but x86-64 (ring.check_platform): the pure-Python
 * path, which runs where the extension is not built, stores and loads stamps as plain numpy
 * operations without fences and relies on x86-64's ordering of stores and of loads.
 */
#include "native.h"

static PyMethodDef methods[] = {
    {"tree_find", py_tree_find, METH_VARARGS, "tree_find(sums, plan, capacity, mass, out): SumTree.find into out (int64)."},
    {"tree_update", py_tree_update, METH_VARARGS, "tree_update(sums, mins, plan, capacity, slots, values): SumTree.update."},
    {"tree_draw", py_tree_draw, METH_VARARGS,
     "tree_draw(sums, plan, capacity, total, u, stratified, stamp, cursors, slots, leaves, ids): a tree draw's ids."},
    {"weights", py_weights, METH_VARARGS, "weights(mins, plan, capacity, leaves, beta, out): importance weights (float32)."},
    {"scan", py_scan, METH_O, "scan(values) -> largest value, or -1.0 when one is not finite and >= 0."},
    {"known", py_known, METH_VARARGS, "known(ids, cursors) -> bool: every id >= 0 and below its lane's cursor."},
    {"current", py_current, METH_VARARGS, "current(ids, stamp, cursors, ok): Ring.current into ok."},
    {"update_priorities", py_update_priorities, METH_VARARGS,
     "update_priorities(lock, ids, priorities, leaves, stamp, cursors, sums, mins, plan, capacity, prio) -> live count or None."},
    {"gather", py_gather, METH_VARARGS, "gather(ids, lanes, stamp, sources, outs, ok) -> smallest id: rows with the stamp check."},
    {"gather_run", py_gather_run, METH_VARARGS,
     "gather_run(first, n0, stamp, sources, outs, ok) -> intact rows: a lane's consecutive rows with the stamp check."},
    {"refresh", (PyCFunction)(void (*)(void))py_refresh, METH_FASTCALL,
     "refresh(mutex, stamp, cursors, counters, log, sources, outs, held, dropped, dense, where, nxt, bases, pending, "
     "state, piece, publish, seen) -> rows newly held, or -1 when another refresh ran since state[6] was seen: a device copy's "
     "refresh on the CPU, without the GIL (device/rows.py)."},
    {"refresher_start", (PyCFunction)(void (*)(void))py_refresher_start, METH_FASTCALL,
     "refresher_start(<refresh's first 17 arguments>, pace_s, rows_bound, seconds_bound) -> a background refresher "
     "thread that never takes the GIL."},
    {"refresher_stop", py_refresher_stop, METH_O, "refresher_stop(refresher): end it (joined). Idempotent."},
    {"refresher_running", py_refresher_running, METH_O, "refresher_running(refresher) -> whether it runs."},
    {"behind", py_behind, METH_VARARGS,
     "behind(cursors, counters, state, bases, rows_bound, ns_bound, idle) -> whether a device copy is past its bounds."},
    {"device_sample", py_device_sample, METH_VARARGS,
     "device_sample(mutex, held, dropped, dense, state, rng, sources, outs, ids, lanes) -> rows drawn uniformly over a device "
     "copy's usable slots and copied from its columns (CPU), 0 when it holds none."},
    {"mutex_init", py_mutex_init, METH_O, "mutex_init(mutex): two private pthread mutexes in 128 bytes of a numpy array (the slot lists', the refreshes')."},
    {"mutex_lock", py_mutex_lock, METH_O, "mutex_lock(mutex): take it (the GIL released while it is busy)."},
    {"mutex_unlock", py_mutex_unlock, METH_O, "mutex_unlock(mutex): release it."},
    {"read_plan", py_read_plan, METH_VARARGS,
     "read_plan(stamp, cursors, counters, columns, seed, tree=None, claim=None, frames=None) -> a one-call sample's plan; "
     "tree: (sums, mins, levels); claim: (lock, uses, max_use); frames: (kind, depth, ahead, parts)."},
    {"read_close", py_read_close, METH_O, "read_close(plan): release a read plan's views of the buffer."},
    {"sample", (PyCFunction)(void (*)(void))py_sample, METH_FASTCALL,
     "sample(plan, outs, ids, ok, nogil[, leaves, weights, beta]) -> rows not intact, or -1: a whole draw and gather."},
    {"stacks", py_stacks, METH_VARARGS,
     "stacks(win, ok, kind, lanes, stamp, column, k, lasts, outs, valid): frame stacks read with their plan."},
    {"put", py_put, METH_VARARGS,
     "put(where, k, stamp, targets, offsets, formats, sources, commit) -> bool: a push's copies, then its commit if asked."},
    {"reserve", py_reserve, METH_VARARGS, "reserve(stamp, owner, first, k, n0, writer, old) -> bool: mark consecutive slots odd."},
    {"reserve_lanes", py_reserve_lanes, METH_VARARGS, "reserve_lanes(cursors, stamp, owner, lane, writer, n, slots, old) -> bool."},
    {"lanes_worst", py_lanes_worst, METH_VARARGS, "lanes_worst(lane, lanes) -> most rows in one lane, or -1."},
    {"plan", (PyCFunction)(void (*)(void))py_plan, METH_VARARGS | METH_KEYWORDS,
     "plan(ring, fields, episode=None, envs=0) -> a push's plan; ring: (lock, cursors, stats, stamp, owner, writers, me), "
     "fields: ((name, format, shape, width, target, offset), ...)."},
    {"plan_close", py_plan_close, METH_O, "plan_close(plan): release a push plan's views of the buffer."},
    {"check", py_check, METH_VARARGS, "check(plan, data) -> (k, single) or None: a push's fast checks, no casts."},
    {"push", (PyCFunction)(void (*)(void))py_push, METH_FASTCALL, "push(plan, data, lane, episode) -> ids, or None where Python decides."},
    {"set_threads", py_set_threads, METH_O,
     "set_threads(k) -> threads: the threads of a big gather's copies, the caller included (1: off, 0: automatic; "
     "capped at the CPUs this process may use and at 4)."},
    {"stop_threads", py_stop_threads, METH_NOARGS, "stop_threads(): end the copy threads (joined); the next big gather starts them."},
    {"threads", py_threads, METH_NOARGS, "threads() -> the threads a big gather's copies use now, the caller included."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "shmbuffer.native._native",
                                    "shmbuffer's native hot path (see shmbuffer/native/__init__.py).", -1, methods};

/* the numbers layout.h shares with the Python modules, as module attributes */
static int add_constants(PyObject *m) {
    static const struct { const char *name; long long value; } constants[] = {
        {"LANE_WORDS", LANE_WORDS},   {"LANE_CURSOR", LANE_CURSOR},       {"LANE_BASE", LANE_BASE},
        {"STATS_WORDS", STATS_WORDS}, {"COUNTER_UPDATES", COUNTER_UPDATES}, {"COUNTER_DELETES", COUNTER_DELETES}, {"COUNTER_DEVICE_ROWS", COUNTER_DEVICE_ROWS}, {"COUNTER_DEVICE_AT", COUNTER_DEVICE_AT}, {"COUNTER_INSERTED", COUNTER_INSERTED}, {"COUNTER_FROZEN", COUNTER_FROZEN}, {"COUNTER_REMOVED", COUNTER_REMOVED}, {"COUNTER_EDITS", COUNTER_EDITS}, {"COUNTER_EDITS_BEGUN", COUNTER_EDITS_BEGUN},
        {"WRITERS", WRITERS},         {"LOCK_SIZE", LOCK_SIZE},           {"LOCK_REPAIR", LOCK_REPAIR},
        {"KIND_END", KIND_END},       {"KIND_START", KIND_START},         {"KIND_ZERO", KIND_ZERO}, {"KIND_LEAD", KIND_LEAD},
        {"FANOUT", FANOUT},           {"INVALID_ID", INVALID_ID},
    };
    for (size_t i = 0; i < sizeof(constants) / sizeof(constants[0]); i++) {
        PyObject *v = PyLong_FromLongLong(constants[i].value);
        if (!v || PyModule_AddObjectRef(m, constants[i].name, v) < 0) {
            Py_XDECREF(v);
            return -1;
        }
        Py_DECREF(v);
    }
    return 0;
}

PyMODINIT_FUNC PyInit__native(void) {
    if (push_init() < 0) return NULL;
    pool_init(); /* failing, the copy threads stay off: big gathers copy on the calling thread */
    if (PyType_Ready(&BoundPushType) < 0 || PyType_Ready(&PushMethodType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (add_constants(m) < 0 || PyModule_AddObjectRef(m, "PushMethod", (PyObject *)&PushMethodType) < 0 ||
        PyModule_AddObjectRef(m, "BoundPush", (PyObject *)&BoundPushType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
