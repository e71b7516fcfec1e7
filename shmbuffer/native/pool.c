/* A small pool of native threads for the copy phase of big gathers (gather.c): pool_run splits
 * [0, n) into contiguous chunks that the calling thread and the pool's workers claim one at a
 * time (an atomic counter), and returns once every chunk is done.
 *
 * - Sized to the machine: at most min(POOL_MAX, the CPUs sched_getaffinity allows) threads in all,
 *   the caller included; set_threads(k) (module.c) or SHMBUFFER_THREADS (native/__init__.py) sets
 *   k, and k = 1 turns the pool off. Only copies of POOL_BYTES and more use it (native.h).
 * - Lazy: the workers are created by the first pool_run that wants them.
 * - The join is a proper synchronisation: each worker leaves a job under the pool's mutex, and the
 *   caller waits, under the same mutex, until none is left in it; everything a worker copied
 *   happens before pool_run returns (the gather's acquire fence and second stamp loads follow).
 *   The job is published under the mutex too, after the caller's first stamp loads.
 * - A caller does not wait for a slow worker to wake: the chunks are claimed, so a worker that
 *   is not scheduled in time finds none left and the caller has copied them all itself; it waits
 *   only for chunks a worker has claimed.
 * - One job at a time: a second thread calling while the pool is busy copies on its own thread.
 * - Stragglers: a worker descheduled mid-chunk (its CPU taken by other work) makes the caller wait
 *   for it, which can cost more than the threads save; in automatic mode (no set_threads count)
 *   the caller then copies alone for a while (8 to 256 big jobs) before it tries again. An
 *   explicit count (set_threads, SHMBUFFER_THREADS) always uses its threads.
 * - Idle workers block on a condition variable (no spinning) and block every signal (they take
 *   none of the interpreter's); a process's exit ends them. set_threads(k) with fewer threads than
 *   there are ends and joins them all (pool_stop): a process back on one thread can fork without
 *   Python 3.12's warning about forking with threads; the next big gather starts what it needs.
 * - Fork: pthread_atfork holds the mutex across fork(); the child has no workers, so it resets
 *   the pool (count 0, fresh mutex and condition variables) and creates new ones when it needs them.
 *   A worker that cannot be created leaves the pool with those it has (at worst none: the caller
 *   copies alone). */
#define _GNU_SOURCE /* pthread_setname_np */
#include "native.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <time.h>

typedef struct {
    pool_fn fn;
    void *arg;
    Py_ssize_t n, chunks;
    int k; /* threads that take part, the caller included: workers 1 to k - 1 */
} Job;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work_cv = PTHREAD_COND_INITIALIZER; /* a new job (gen changed) */
static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER; /* a worker left the job */
static pthread_cond_t idle_cv = PTHREAD_COND_INITIALIZER; /* a job ended (busy 0) */
static pthread_t tids[POOL_MAX];
static int workers;          /* created (and alive) workers: tids[0, workers) */
static int busy;             /* a caller owns the pool */
static int stopping;         /* pool_stop is ending the workers: callers copy alone meanwhile */
static int stops;            /* pool_stops waiting for the job in flight to end: no new job starts */
static int active;           /* workers inside the current job */
static uint64_t gen;         /* the job's generation */
static Job job;              /* the current job (under mu) */
static Py_ssize_t next_chunk; /* the next chunk to claim (atomic) */
static int wanted;           /* threads asked for (set_threads); 0: automatic */
static int skip, backoff;    /* automatic: big jobs still to run alone, and the next such run's length */
static int atfork_done;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void chunk_bounds(const Job *j, Py_ssize_t c, Py_ssize_t *lo, Py_ssize_t *hi) {
    *lo = j->n * c / j->chunks;
    *hi = j->n * (c + 1) / j->chunks;
}

/* claim and run chunks of j until none is left */
static void claim(const Job *j, int who) {
    for (;;) {
        Py_ssize_t c = __atomic_fetch_add(&next_chunk, 1, __ATOMIC_RELAXED), lo, hi;
        if (c >= j->chunks) return;
        chunk_bounds(j, c, &lo, &hi);
        j->fn(j->arg, lo, hi, who);
    }
}

static void *worker(void *arg) {
    int who = (int)(intptr_t)arg;
    pthread_mutex_lock(&mu);
    uint64_t seen = busy ? gen - 1 : gen; /* created for the job in progress: it takes part */
    for (;;) {
        while (gen == seen && !stopping) pthread_cond_wait(&work_cv, &mu);
        if (stopping) break;
        seen = gen;
        if (!busy || who >= job.k) continue; /* woke after the job ended, or not one of its threads */
        Job j = job;
        active++;
        pthread_mutex_unlock(&mu);
        claim(&j, who);
        pthread_mutex_lock(&mu);
        if (--active == 0) pthread_cond_signal(&done_cv);
    }
    pthread_mutex_unlock(&mu);
    return NULL;
}

static void before_fork(void) { pthread_mutex_lock(&mu); }
static void parent_after_fork(void) { pthread_mutex_unlock(&mu); }
static void child_after_fork(void) {
    /* no worker exists here: a fresh pool (the mutex was held by the forking thread) */
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&work_cv, NULL);
    pthread_cond_init(&done_cv, NULL);
    pthread_cond_init(&idle_cv, NULL);
    workers = 0;
    busy = 0;
    stopping = 0;
    stops = 0; /* a stop waiting in another thread of the parent is not in the child */
    active = 0;
}

static int cpus(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
        int k = CPU_COUNT(&set);
        if (k >= 1) return k;
    }
    return 1;
}

int pool_threads(void) {
    int most = cpus(), k = __atomic_load_n(&wanted, __ATOMIC_RELAXED);
    if (most > POOL_MAX) most = POOL_MAX;
    if (k <= 0 || k > most) k = most;
    return k;
}

void pool_set_threads(int k) { __atomic_store_n(&wanted, k < 0 ? 0 : k, __ATOMIC_RELAXED); }

/* the fork handlers, once, at the module's import (module.c): registered there, not at the first
 * big gather, so that no fork can start before them and give its child the parent's pool state
 * (glibc takes the handlers that exist when a fork starts; a gather in another thread could
 * register them, start a worker and run a job while the fork runs the prepare handlers of others).
 * -1 when they cannot be registered: the pool then never starts a thread. */
int pool_init(void) {
    if (pthread_atfork(before_fork, parent_after_fork, child_after_fork)) return -1;
    atfork_done = 1;
    return 0;
}

/* up to k - 1 workers (mu held); returns how many there are */
static int grow(int k) {
    if (!atfork_done) return workers; /* no fork handlers: no threads (a child could inherit them half-made) */
    while (workers < k - 1) {
        pthread_attr_t attr;
        sigset_t all, old;
        pthread_t t;
        if (pthread_attr_init(&attr)) break;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        int err = pthread_create(&t, &attr, worker, (void *)(intptr_t)(workers + 1));
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        pthread_attr_destroy(&attr);
        if (err) break;
#ifdef __linux__
        pthread_setname_np(t, "shmbuffer-copy"); /* what ps -L, top and /proc/<pid>/task/<tid>/comm show */
#endif
        tids[workers++] = t;
    }
    return workers;
}

void pool_run(pool_fn fn, void *arg, Py_ssize_t n, size_t bytes) {
    int k = bytes >= POOL_BYTES && n > 1 ? pool_threads() : 1;
    if (k > n) k = (int)n;
    int automatic = __atomic_load_n(&wanted, __ATOMIC_RELAXED) == 0;
    if (k > 1) {
        pthread_mutex_lock(&mu);
        if (busy || stopping || stops || (automatic && skip > 0)) { /* another thread's job, the workers
                                                                      * ending or to end, or backing off: copy alone */
            if (!busy && !stopping && !stops) skip--;
            pthread_mutex_unlock(&mu);
            k = 1;
        } else {
            int have = grow(k);
            if (have < k - 1) k = have + 1;
            if (k <= 1) pthread_mutex_unlock(&mu); /* no worker could be created: copy alone, the pool usable */
        }
    }
    if (k <= 1) {
        fn(arg, 0, n, 0);
        return;
    }
    /* mu held: publish the job */
    Py_ssize_t chunks = (Py_ssize_t)k * POOL_CHUNKS;
    if (chunks > n) chunks = n;
    job.fn = fn;
    job.arg = arg;
    job.n = n;
    job.chunks = chunks;
    job.k = k;
    __atomic_store_n(&next_chunk, 0, __ATOMIC_RELAXED);
    busy = 1;
    gen++;
    Job j = job;
    pthread_cond_broadcast(&work_cv);
    pthread_mutex_unlock(&mu);
    double t0 = now();
    claim(&j, 0);
    double t1 = now();
    pthread_mutex_lock(&mu);
    while (active > 0) pthread_cond_wait(&done_cv, &mu);
    double t2 = now();
    /* a straggler: the caller waited for a worker longer than half its own share took (a worker
     * descheduled mid-chunk, its CPU busy with other work). Automatic mode then copies alone for
     * the next 8, 16, ... 256 big jobs, and tries the threads again; a job without one resets it. */
    if (!automatic) {
        /* an explicit count always uses its threads: nothing to back off from */
    } else if (t2 - t1 > (t1 - t0) / 2 + 20e-6) {
        backoff = backoff ? (backoff < 256 ? backoff * 2 : 256) : 8;
        skip = backoff;
    } else {
        backoff = 0;
    }
    busy = 0;
    pthread_cond_broadcast(&idle_cv);
    pthread_mutex_unlock(&mu);
}

/* end the workers (joined) once no job is in flight; the next big gather starts new ones */
static void pool_stop(void) {
    pthread_mutex_lock(&mu);
    stops++; /* no new job starts on the workers meanwhile: a caller gathering back to back cannot keep this waiting */
    while (busy || stopping) pthread_cond_wait(&idle_cv, &mu);
    stops--;
    int n = workers;
    pthread_t t[POOL_MAX];
    memcpy(t, tids, sizeof(t));
    stopping = 1;
    pthread_cond_broadcast(&work_cv);
    pthread_mutex_unlock(&mu);
    for (int i = 0; i < n; i++) pthread_join(t[i], NULL);
    pthread_mutex_lock(&mu);
    workers = 0;
    stopping = 0;
    pthread_cond_broadcast(&idle_cv);
    pthread_mutex_unlock(&mu);
}

/* set_threads(k): the pool's threads, the caller included, for the copies of big gathers: k >= 1
 * (1: off; capped at the CPUs this process may use and at POOL_MAX), 0: automatic. */
PyObject *py_set_threads(PyObject *self, PyObject *arg) {
    long k = PyLong_AsLong(arg);
    if (k == -1 && PyErr_Occurred()) return NULL;
    if (k < 0) {
        PyErr_SetString(PyExc_ValueError, "set_threads: expected k >= 0 (0: automatic, 1: off)");
        return NULL;
    }
    pool_set_threads(k > POOL_MAX ? POOL_MAX : (int)k);
    int now = pool_threads();
    pthread_mutex_lock(&mu);
    int more = workers > now - 1;
    pthread_mutex_unlock(&mu);
    if (more) { /* fewer threads than there are: end them all (a process back to one thread can fork
                 * without Python's warning about threads); the next big gather starts what it needs */
        Py_BEGIN_ALLOW_THREADS
        pool_stop();
        Py_END_ALLOW_THREADS
    }
    return PyLong_FromLong(now);
}

/* stop_threads(): end the workers (joined) once no job is in flight; the next big gather starts
 * new ones. native/__init__.py calls it before every os.fork() (os.register_at_fork): the parent
 * then forks with no thread of ours, so Python 3.12's warning about forking a multi-threaded
 * process (which counts every thread of the process) is not about them, and the child needs none
 * renewed. A no-op when there are none. */
PyObject *py_stop_threads(PyObject *self, PyObject *unused) {
    pthread_mutex_lock(&mu);
    int some = workers > 0;
    pthread_mutex_unlock(&mu);
    if (some) {
        Py_BEGIN_ALLOW_THREADS
        pool_stop();
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

/* threads() -> the threads a big gather uses now, the caller included (1: the pool is off) */
PyObject *py_threads(PyObject *self, PyObject *unused) { return PyLong_FromLong(pool_threads()); }
