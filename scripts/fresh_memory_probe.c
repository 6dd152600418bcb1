/* What a loader that copies a model file into memory of its own pays the kernel for that memory
 * (docs/benchmarks.md 1.6, "Load of Q8_0"): maps FILE (from the page cache), touches a byte a page,
 * then copies the whole file into a fresh anonymous mapping, timing each part.
 *
 *   cc -O2 -o /tmp/fresh_memory_probe scripts/fresh_memory_probe.c
 *   for m in 0 1 2 3 6 7; do /usr/bin/time -f "  wall %e sys %S" /tmp/fresh_memory_probe FILE $m; done
 *
 * MODE is a sum of: 1 map the file with MAP_POPULATE; 2 advise the copy's memory as huge pages
 * (MADV_HUGEPAGE); 4 populate it before copying (MADV_POPULATE_WRITE, Linux 5.14+). Linux only. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s FILE MODE\n", argv[0]);
        return 2;
    }
    const int mode = atoi(argv[2]);
    const int fd = open(argv[1], O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        perror(argv[1]);
        return 1;
    }
    const size_t n = (size_t)st.st_size, huge = 2u << 20;
    const double t0 = now();
    const unsigned char *p = mmap(NULL, n, PROT_READ, MAP_SHARED | ((mode & 1) ? MAP_POPULATE : 0), fd, 0);
    const double t1 = now();
    unsigned long sum = 0;
    for (size_t i = 0; i < n; i += 4096) sum += p[i];
    const double t2 = now();
    unsigned char *q = mmap(NULL, n + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED || q == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    if (mode & 2) madvise(q, n + huge, MADV_HUGEPAGE);
    if (mode & 4) madvise(q, n + huge, MADV_POPULATE_WRITE);
    const double t3 = now();
    memcpy(q, p, n);
    const double t4 = now();
    printf("mode %d: map %.2f s, touch %.2f s, prepare copy %.2f s, copy %.2f s (%.2f GB; %lu)\n", mode, t1 - t0,
           t2 - t1, t3 - t2, t4 - t3, n / 1e9, sum);
    return 0;
}
