/* The machine's floor for one sample's gather: 256 random rows of 168 bytes (MuJoCo-like) out of
 * 1,000,000, copied by plain C with every line prefetched first, from /dev/shm (4 KiB pages, as a
 * buffer's block) or from the heap (madvise(MADV_HUGEPAGE), as an in-process numpy ring's arrays
 * may get), without or with a stamp loaded before and after each row (the commit protocol's
 * reads). No Python, no random numbers worth counting (xorshift), no allocation: what is left is
 * the memory system. Issue 24 measured it to show where "3x the numpy ring" lies.
 *
 *   gcc -O2 -o /tmp/gather_floor benchmarks/gather_floor.c -lrt
 *   /tmp/gather_floor shm 1; /tmp/gather_floor shm 0; /tmp/gather_floor heap 1; /tmp/gather_floor heap 0
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint64_t state = 88172645463325252ull;
static inline uint64_t xorshift(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s shm|heap 0|1 (stamps)\n", argv[0]);
        return 2;
    }
    const size_t cap = 1000000, w = 168, n = 256, bytes = cap * w + cap * 8;
    int stamps = atoi(argv[2]);
    char *mem;
    if (!strcmp(argv[1], "shm")) {
        int fd = shm_open("/shmbuffer-gather-floor", O_CREAT | O_RDWR, 0600);
        if (fd < 0 || ftruncate(fd, (off_t)bytes)) return 1;
        mem = mmap(0, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        shm_unlink("/shmbuffer-gather-floor");
    } else {
        mem = mmap(0, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        madvise(mem, bytes, MADV_HUGEPAGE);
    }
    if (mem == MAP_FAILED) return 1;
    memset(mem, 1, bytes);
    int64_t *stamp = (int64_t *)(mem + cap * w);
    static char out[256 * 168];
    int64_t slot[256], first[256];
    volatile int64_t sink = 0;
    double best = 1e9;
    for (int round = 0; round < 7; round++) {
        double t0 = now();
        for (int it = 0; it < 5000; it++) {
            for (size_t i = 0; i < n; i++) {
                slot[i] = (int64_t)(xorshift() % cap);
                if (stamps) first[i] = __atomic_load_n(&stamp[slot[i]], __ATOMIC_ACQUIRE);
                const char *row = mem + slot[i] * w;
                __builtin_prefetch(row);
                __builtin_prefetch(row + 64);
                __builtin_prefetch(row + 128);
                __builtin_prefetch(row + w - 1);
            }
            for (size_t i = 0; i < n; i++) memcpy(out + i * w, mem + slot[i] * w, w);
            if (stamps)
                for (size_t i = 0; i < n; i++) sink += stamp[slot[i]] == first[i];
            sink += out[it % 1000];
        }
        double per = (now() - t0) / 5000;
        if (per < best) best = per;
    }
    printf("%s, stamps %d: %.2f us per 256 rows (%.0f batches/s)\n", argv[1], stamps, best * 1e6, 1 / best);
    return 0;
}
