/* The block's layout and the commit protocol's row arithmetic, as the C files use them.
 *
 * The Python modules are the reference: shmbuffer/protocol/layout.py (the columns, Lane, Counter,
 * WRITERS), shmbuffer/shm/lock.py (the mutex column), shmbuffer/frames.py (the _kind bits),
 * shmbuffer/sampling/sumtree.py (FANOUT), shmbuffer/protocol/ring.py (INVALID) and
 * shmbuffer/protocol/rows.py (the arithmetic). tests/test_native.py reads every #define below and
 * compares it with its Python counterpart, and compiles the functions below to compare their
 * results with rows.py's on sample values: a change on one side alone fails there.
 *
 * Only <stdint.h>: this header must compile without Python.h (the test compiles it alone). Every
 * #define here is a plain integer (the test evaluates them); helpers of the C files go in native.h.
 */
#ifndef SHMBUFFER_LAYOUT_H
#define SHMBUFFER_LAYOUT_H

#include <stdint.h>

/* -- the columns ------------------------------------------------------------------------------- */
/* _lanes: (lanes, LANE_WORDS) int64, one cache line per lane; the words of lane l's row */
#define LANE_WORDS 8
#define LANE_CURSOR 0 /* layout.Lane.CURSOR: rows ever reserved in the lane */
#define LANE_BASE 1   /* layout.Lane.BASE: the first row number that counts after a clear() */

/* _stats: STATS_WORDS int64 counters; the ones the C push reads or moves (layout.Counter) */
#define STATS_WORDS 16
#define COUNTER_UPDATES 2   /* Counter.UPDATES: row updates begun (ReplayBuffer.update) */
#define COUNTER_DELETES 3   /* Counter.DELETES: row deletes (ReplayBuffer.delete) */
#define COUNTER_DEVICE_ROWS 4 /* Counter.DEVICE_ROWS: INSERTED as a device copy's last refresh began */
#define COUNTER_DEVICE_AT 5   /* Counter.DEVICE_AT: when it began, CLOCK_MONOTONIC ns */
#define COUNTER_INSERTED 10 /* Counter.INSERTED: rows ever reserved, all lanes */
#define COUNTER_FROZEN 11   /* Counter.FROZEN: 1 once the buffer is read-only */
#define COUNTER_REMOVED 13  /* Counter.REMOVED: 1 once a row was deleted or used up (max_use) */
#define COUNTER_EDITS 14    /* Counter.EDITS: slots of in-place changes ever logged in _edits */
#define COUNTER_EDITS_BEGUN 15 /* Counter.EDITS_BEGUN: EDITS once the edit being logged counts, stored before its entries */

#define WRITERS 1024 /* layout.WRITERS: entries of the writer table (_writer_pid, int64) */

/* _mutex: lock.py's robust mutex column */
#define LOCK_SIZE 64   /* lock.SIZE: bytes of the column */
#define LOCK_REPAIR 56 /* lock.REPAIR: byte offset of the repair word (int64) in it */

/* _kind: what each row is (frames.py) */
#define KIND_END 1   /* frames.END: the row holds an episode's final observation */
#define KIND_START 2 /* frames.START: the row is its episode's first */
#define KIND_ZERO 4  /* frames.ZERO: with START, stacks are padded with zeros */
#define KIND_LEAD 8  /* frames.LEAD: the row holds an older frame of a resumed episode, not a transition */

#define FANOUT 16 /* sumtree.FANOUT: children per node of the priority tree */

#define INVALID_ID (-((int64_t)1 << 62)) /* ring.INVALID: an id no slot ever holds */

/* -- the row arithmetic (rows.py) -------------------------------------------------------------
 * Row number n of lane l lives in slot l * lc + n % lc (lc: the slots of a lane) and has the id
 * n * lanes + l. A slot's stamp is 0 (empty), 2n + 1 while row n is written there, 2n + 2 once it
 * is committed. Python's // and % round toward minus infinity, and numpy's int64 arithmetic
 * wraps: these functions do the same, so that ids of any value (a reader's ids come from
 * anywhere) give the numbers the Python path gives. */

/* Python's a // b and a % b (b != 0, and not INT64_MIN // -1) */
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

/* a * b + c, wrapping as numpy's int64 does */
static inline int64_t wrap_madd(int64_t a, int64_t b, int64_t c) {
    return (int64_t)((uint64_t)a * (uint64_t)b + (uint64_t)c);
}

/* rows.slot: the slot of row number n of lane `lane` */
static inline int64_t slot_of(int64_t lane, int64_t n, int64_t lc) { return lane * lc + floormod(n, lc); }

/* rows.row_id: the id of row number n of lane `lane` */
static inline int64_t row_id(int64_t n, int64_t lane, int64_t lanes) { return wrap_madd(n, lanes, lane); }

/* rows.lane_of and rows.number_of: an id's lane and its row number within the lane */
static inline int64_t lane_of_id(int64_t id, int64_t lanes) { return lanes == 1 ? 0 : floormod(id, lanes); }
static inline int64_t number_of_id(int64_t id, int64_t lanes) { return lanes == 1 ? id : floordiv(id, lanes); }

/* rows.slot_of_id: the slot an id's row lives in */
static inline int64_t slot_of_id(int64_t id, int64_t lanes, int64_t lc) {
    return slot_of(lane_of_id(id, lanes), number_of_id(id, lanes), lc);
}

/* rows.writing and rows.committed: row n's stamp while it is written (odd), once committed (even) */
static inline int64_t writing_stamp(int64_t n) { return wrap_madd(n, 2, 1); }
static inline int64_t committed_stamp(int64_t n) { return wrap_madd(n, 2, 2); }

/* a commit: the stamp a row's writing stamp becomes (ring.py adds 1) */
static inline int64_t commit_stamp(int64_t writing) { return wrap_madd(writing, 1, 1); }

/* rows.committed_of_id: the stamp an id's slot shows while its row is there, whole */
static inline int64_t committed_stamp_of_id(int64_t id, int64_t lanes) { return committed_stamp(number_of_id(id, lanes)); }

/* rows.number_of_stamp: the row number a committed or being-written stamp names (-1: empty) */
static inline int64_t number_of_stamp(int64_t stamp) { return floordiv(wrap_madd(stamp, 1, -1), 2); }

/* rows.is_committed: the stamp says a row is there, whole */
static inline int is_committed(int64_t stamp) { return stamp > 0 && !(stamp & 1); }

/* rows.is_writing: the stamp says its row is being written (odd) */
static inline int is_writing(int64_t stamp) { return (stamp & 1) != 0; }

/* rows.intact: a row copied between two loads of its stamp is whole and the one expected */
static inline int intact(int64_t before, int64_t after, int64_t expected) { return before == expected && after == expected; }

/* rows.bounds' first row of a lane: min(max(base, cursor - lc), cursor) */
static inline int64_t first_row(int64_t cursor, int64_t base, int64_t lc) {
    int64_t s = wrap_madd(lc, -1, cursor);
    if (base > s) s = base;
    return s < cursor ? s : cursor;
}

/* ring.py's reservation: a lane's next row number, max(cursor, base) (a clear() moves the base
 * past the cursor) */
static inline int64_t next_row(int64_t cursor, int64_t base) { return cursor > base ? cursor : base; }

#endif
