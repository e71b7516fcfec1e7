/* Helpers every kernel uses: views of the buffers Python passes, and lock.py's mutex tried once. */
#include "native.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>

/* whether buffer format f is `want` (a native format of one item, as numpy gives an aligned array
 * of the column's dtype): numpy gives an unaligned native array (a field of a packed record) the
 * same item with standard size and native order, "=f" for "f" ("=q" for "l"); the copies are
 * memcpy, which does not care about alignment */
int same_format(const char *f, const char *want) {
    if (strcmp(f, want) == 0) return 1;
    const union { uint16_t u; char c[2]; } probe = {1};
    char order = probe.c[0] ? '<' : '>';
    if ((f[0] != '=' && f[0] != order) || !f[1] || f[2] || !want[0] || want[1]) return 0;
    char a = f[1], b = want[0];
    if (a == b) return strchr("?bBhHiIqQfd", a) != NULL; /* standard and native sizes agree */
    return (a == 'q' && b == 'l' && sizeof(long) == 8) || (a == 'Q' && b == 'L' && sizeof(long) == 8) ||
           (a == 'i' && b == 'l' && sizeof(long) == 4) || (a == 'I' && b == 'L' && sizeof(long) == 4);
}

/* a C-contiguous view of obj (writable if asked) of items of `itemsize` bytes (0: any); -1 with a
 * TypeError naming `what` */
int get_buf(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize, const char *what) {
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

/* the lanes of a (lanes, LANE_WORDS) int64 _lanes view, lanes >= 1 dividing capacity (0: error set) */
Py_ssize_t lanes_of(const Py_buffer *cursors, Py_ssize_t capacity, const char *what) {
    Py_ssize_t lanes = cursors->len / (LANE_WORDS * 8);
    if (lanes <= 0 || cursors->len % (LANE_WORDS * 8) || capacity <= 0 || capacity % lanes) {
        PyErr_Format(PyExc_ValueError, "%s: expected a (lanes, %d) int64 cursor array with lanes dividing the capacity",
                     what, LANE_WORDS);
        return 0;
    }
    return lanes;
}

/* lock.py's robust mutex, only tried (the C lockers never wait, so no Python code runs under it):
 * 1 held, with no repair owed; 0 not taken: busy (or held by this thread), a repair owed, or its
 * holder died inside its critical section, whose repairs are Python's (ring.py): then they are
 * owed to the next locker (the repair word at LOCK_REPAIR), which lock.py makes run them first */
int lock_try(void *lock) {
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
