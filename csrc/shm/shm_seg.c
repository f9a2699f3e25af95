/* shm_seg.c: life cycle of the shm control segment and regions (create/attach/unlink/close), and the
 * synchronisation primitives (arrive / wait with spin-then-futex, deadlines, peer liveness, abort).
 * Not for: the collectives themselves (shm_coll.c) or the reduction math (shm_reduce.c).
 *
 * Waiting: spin for the option shm_spin_us (options.h, taken when the group opens; default 50 us; between the
 * phases of one collective, when the peer is known to be mid-call, shm_inner_spin_us, default 1000 us)
 * re-reading the peer's phase word (pause for
 * ~2 us, then sched_yield between reads so a peer sharing this core can run), then
 * sleep in a process-shared FUTEX_WAIT on it in slices of <= 50 ms, so a waiting rank gives its core
 * back to the peer's compute (2-core boxes). The waker only pays the FUTEX_WAKE syscall when the
 * peer's sleeper count is non-zero (seq_cst store/load pair on both sides: no lost wake-up).
 * Between slices the waiter checks the deadline, the shared abort flag and whether missing peers are
 * still alive (kill(pid, 0) and /proc/<pid>/stat for zombies). */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "options.h"
#include "shm_internal.h"

#define DEFAULT_SMALL (64u << 10)
#define DEFAULT_CHUNK (1u << 20) /* staging per rank per buffer: small enough to stay in L2/L3 */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static inline int reached(uint32_t have, uint32_t want) { return (int32_t)(have - want) >= 0; }

static size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* 1 when the process is gone (or a zombie). */
int shm_pid_dead(int32_t pid) {
    if (pid <= 0) return 0;
    if (kill(pid, 0) < 0 && errno == ESRCH) return 1;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    return p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}

void shm_abort(acc_shm_group *g, const char *msg) {
    g->broken = 1;
    uint32_t expected = 0;
    if (atomic_compare_exchange_strong(&g->hdr->abort_flag, &expected, 1u)) {
        g->hdr->abort_rank = g->rank;
        snprintf(g->hdr->abort_msg, sizeof g->hdr->abort_msg, "%s", msg);
        atomic_thread_fence(memory_order_seq_cst);
        atomic_store(&g->hdr->abort_flag, 2u); /* message complete */
    }
    for (int q = 0; q < g->nranks; q++)
        syscall(SYS_futex, &g->slots[q].phase, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

void shm_arrive(acc_shm_group *g) {
    shm_slot *me = &g->slots[g->rank];
    g->phase++;
    atomic_store(&me->phase, g->phase); /* seq_cst: orders the data writes and the sleeper check */
    if (atomic_load(&me->sleepers) > 0) syscall(SYS_futex, &me->phase, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static acc_status aborted(acc_shm_group *g, const char *opname) {
    g->broken = 1;
    for (int i = 0; i < 1000 && atomic_load(&g->hdr->abort_flag) != 2u; i++) cpu_relax();
    acc_set_error("%s aborted on rank %d: rank %d reported: %s", opname, g->rank, g->hdr->abort_rank,
                  g->hdr->abort_msg);
    return ACC_ERR_PEER;
}

/* Lists peers that have not reached `want` into buf. */
static void missing_list(acc_shm_group *g, uint32_t want, char *buf, size_t cap, int with_pid) {
    size_t len = 0;
    buf[0] = 0;
    for (int q = 0; q < g->nranks && len + 32 < cap; q++) {
        if (q == g->rank || reached(atomic_load(&g->slots[q].phase), want)) continue;
        int32_t pid = atomic_load(&g->slots[q].pid);
        if (with_pid && !shm_pid_dead(pid)) continue;
        len += (size_t)snprintf(buf + len, cap - len, "%s%d (pid %d)", len ? ", " : "", q, (int)pid);
    }
}

acc_status shm_wait_all(acc_shm_group *g, const char *opname, long spin_ns) {
    const uint32_t want = g->phase;
    const double t0 = now_s();
    double next_check = t0 + 0.1;
    if (atomic_load_explicit(&g->hdr->abort_flag, memory_order_relaxed)) return aborted(g, opname);
    for (int q = 0; q < g->nranks; q++) {
        if (q == g->rank) continue;
        shm_slot *s = &g->slots[q];
        if (reached(atomic_load_explicit(&s->phase, memory_order_acquire), want)) continue;
        /* pause-spin ~2 us, then yield-spin: when the peer shares our core (oversubscribed box) a
         * pause-spin only burns the time slice the peer needs; sched_yield hands it over at once. */
        long t_start = now_ns(), spin_end = t_start + spin_ns, t;
        int spun = 0;
        while (!reached(atomic_load_explicit(&s->phase, memory_order_acquire), want)) {
            if ((++spun & 7) == 0) {
                t = now_ns();
                if (t > spin_end) break;
                if (t - t_start > 2000) sched_yield();
            }
            for (int i = 0; i < 16; i++) cpu_relax();
        }
        for (;;) {
            if (atomic_load(&g->hdr->abort_flag)) return aborted(g, opname);
            atomic_fetch_add(&s->sleepers, 1);
            uint32_t v = atomic_load(&s->phase);
            if (reached(v, want)) {
                atomic_fetch_sub(&s->sleepers, 1);
                break;
            }
            struct timespec ts = {0, 50 * 1000 * 1000};
            syscall(SYS_futex, &s->phase, FUTEX_WAIT, v, &ts, NULL, 0);
            atomic_fetch_sub(&s->sleepers, 1);
            if (reached(atomic_load(&s->phase), want)) break;
            double t = now_s();
            if (atomic_load(&g->hdr->abort_flag)) return aborted(g, opname);
            if (t >= next_check) {
                next_check = t + 0.1;
                char dead[256];
                missing_list(g, want, dead, sizeof dead, 1);
                if (dead[0]) {
                    char msg[400];
                    snprintf(msg, sizeof msg, "shm %s (call %u): peer rank(s) %s died before arriving", opname,
                             g->ncalls - 1, dead);
                    shm_abort(g, msg);
                    acc_set_error("%s", msg);
                    return ACC_ERR_PEER;
                }
            }
            if (t - t0 > g->timeout_s) {
                char miss[256], msg[400];
                missing_list(g, want, miss, sizeof miss, 0);
                snprintf(msg, sizeof msg, "shm %s (call %u): timed out after %.1f s waiting for rank(s) %s", opname,
                         g->ncalls - 1, g->timeout_s, miss);
                shm_abort(g, msg);
                acc_set_error("%s", msg);
                return ACC_ERR_TIMEOUT;
            }
        }
    }
    atomic_thread_fence(memory_order_acquire);
    return ACC_OK;
}

/* ---- segment life cycle ------------------------------------------------------------------------- */

static acc_status check_name(const char *name) {
    size_t n = strlen(name);
    if (n < 2 || n > 200 || name[0] != '/' || strchr(name + 1, '/')) {
        acc_set_error("bad shm name '%s' (want '/<name>' of at most 200 characters)", name);
        return ACC_ERR_ARG;
    }
    return ACC_OK;
}

/* Sizes a new segment and reserves its pages (posix_fallocate): on a tmpfs too small for it (e.g. a
 * container's default 64 MB /dev/shm) this fails now with ENOSPC, where ftruncate alone would succeed and
 * the first touch of a missing page later would kill the process with SIGBUS. */
static acc_status size_segment(int fd, const char *what, const char *name, size_t bytes) {
    if (fchmod(fd, 0600) < 0 || ftruncate(fd, (off_t)bytes) < 0) {
        acc_set_error("sizing shm %s %s to %zu bytes: %s", what, name, bytes, strerror(errno));
        return ACC_ERR_OS;
    }
    int rc = posix_fallocate(fd, 0, (off_t)bytes);
    if (rc == ENOSPC || rc == ENOMEM) {
        acc_set_error("shm %s %s: no room for %zu bytes in /dev/shm (%s); enlarge it (e.g. docker --shm-size) or "
                      "set ACCELERATE_C_COMM=torch", what, name, bytes, strerror(rc));
        return ACC_ERR_OS;
    }
    /* other errors (EOPNOTSUPP, EINVAL on exotic file systems): keep the sparse file, as before */
    return ACC_OK;
}

void acc_shm_group_spin_us(const acc_shm_group *g, long *spin_us, long *inner_spin_us) {
    *spin_us = g->spin_ns / 1000L;
    *inner_spin_us = g->inner_spin_ns / 1000L;
}

acc_status acc_shm_group_open(const char *name, int create, int rank, int nranks, size_t small_bytes,
                              size_t chunk_bytes, double timeout_s, acc_shm_group **out) {
    *out = NULL;
    acc_status st = check_name(name);
    if (st) return st;
    if (nranks < 1 || nranks > SHM_MAX_RANKS || rank < 0 || rank >= nranks) {
        acc_set_error("rank %d / size %d out of range (at most %d local ranks)", rank, nranks, SHM_MAX_RANKS);
        return ACC_ERR_ARG;
    }
    small_bytes = round_up(small_bytes ? small_bytes : DEFAULT_SMALL, 4096);
    chunk_bytes = round_up(chunk_bytes ? chunk_bytes : DEFAULT_CHUNK, 4096 * (size_t)nranks);
    acc_shm_group *g = calloc(1, sizeof *g);
    if (!g) return ACC_ERR_NOMEM;
    snprintf(g->name, sizeof g->name, "%s", name);
    g->rank = rank;
    g->nranks = nranks;
    g->owner_pid = (int)getpid();
    g->timeout_s = timeout_s > 0 ? timeout_s : 1800.0;
    acc_options opt; /* the spin budgets current now (options.h) */
    acc_options_get(&opt);
    g->spin_ns = opt.shm_spin_us * 1000L;
    g->inner_spin_ns = opt.shm_inner_spin_us * 1000L;
    int fd;
    size_t data_off = 4096 + round_up(sizeof(shm_slot) * (size_t)nranks, 4096);
    size_t stride = 2 * small_bytes + 2 * chunk_bytes;
    if (create) {
        fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd < 0) {
            acc_set_error("shm_open(%s, O_CREAT|O_EXCL): %s", name, strerror(errno));
            free(g);
            return ACC_ERR_OS;
        }
        g->created = 1;
        g->map_bytes = data_off + stride * (size_t)nranks;
        if (size_segment(fd, "segment", name, g->map_bytes)) {
            close(fd);
            shm_unlink(name);
            free(g);
            return ACC_ERR_OS;
        }
    } else {
        fd = shm_open(name, O_RDWR, 0);
        struct stat sb;
        if (fd < 0 || fstat(fd, &sb) < 0) {
            acc_set_error("attaching shm segment %s: %s", name, strerror(errno));
            if (fd >= 0) close(fd);
            free(g);
            return ACC_ERR_OS;
        }
        g->map_bytes = (size_t)sb.st_size;
    }
    void *p = mmap(NULL, g->map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int map_errno = errno;
    close(fd);
    if (p == MAP_FAILED) {
        acc_set_error("mmap of shm segment %s (%zu bytes): %s", name, g->map_bytes, strerror(map_errno));
        if (create) shm_unlink(name);
        free(g);
        return ACC_ERR_OS;
    }
    g->map = p;
    g->hdr = (shm_hdr *)p;
    g->slots = (shm_slot *)(g->map + 4096);
    if (create) {
        g->hdr->version = 1;
        g->hdr->nranks = (uint32_t)nranks;
        g->hdr->total_bytes = g->map_bytes;
        g->hdr->small_bytes = small_bytes;
        g->hdr->chunk_bytes = chunk_bytes;
        g->hdr->data_off = data_off;
        g->hdr->data_stride = stride;
        atomic_store(&g->hdr->magic, SHM_MAGIC);
    } else if (g->map_bytes < 4096 || atomic_load(&g->hdr->magic) != SHM_MAGIC || g->hdr->nranks != (uint32_t)nranks ||
               g->hdr->total_bytes != g->map_bytes) {
        acc_set_error("shm segment %s is not an accelerate_c group of %d ranks", name, nranks);
        munmap(p, g->map_bytes);
        free(g);
        return ACC_ERR_STATE;
    }
    g->small_bytes = g->hdr->small_bytes;
    g->chunk_bytes = g->hdr->chunk_bytes;
    int32_t zero = 0;
    if (!atomic_compare_exchange_strong(&g->slots[rank].pid, &zero, (int32_t)getpid())) {
        acc_set_error("rank %d of shm segment %s is already attached (pid %d)", rank, name,
                      (int)atomic_load(&g->slots[rank].pid));
        munmap(p, g->map_bytes);
        free(g);
        return ACC_ERR_STATE;
    }
    if (atomic_fetch_add(&g->hdr->attached, 1u) + 1u == (uint32_t)nranks) {
        shm_unlink(name); /* everyone is in: the name is no longer needed, nothing can leak */
        g->all_attached = 1;
    }
    *out = g;
    return ACC_OK;
}

acc_status acc_shm_group_wait_attached(acc_shm_group *g) {
    double t0 = now_s();
    while (atomic_load(&g->hdr->attached) < (uint32_t)g->nranks) {
        if (now_s() - t0 > g->timeout_s) {
            shm_unlink(g->name);
            char miss[256];
            size_t len = 0;
            miss[0] = 0;
            for (int q = 0; q < g->nranks && len + 16 < sizeof miss; q++)
                if (!atomic_load(&g->slots[q].pid)) len += (size_t)snprintf(miss + len, sizeof miss - len, "%s%d", len ? ", " : "", q);
            acc_set_error("shm group creation: timed out after %.1f s waiting for rank(s) %s to attach %s",
                          g->timeout_s, miss, g->name);
            shm_abort(g, "group creation timed out");
            return ACC_ERR_TIMEOUT;
        }
        struct timespec ts = {0, 200 * 1000};
        nanosleep(&ts, NULL);
    }
    g->all_attached = 1;
    return ACC_OK;
}

void acc_shm_group_close(acc_shm_group *g) {
    if (!g) return;
    if (g->owner_pid != (int)getpid()) { /* inherited through fork(): only drop the mapping */
        munmap(g->map, g->map_bytes);
        free(g);
        return;
    }
    acc_shm_async_stop(g);
    if (g->created && atomic_load(&g->hdr->attached) < (uint32_t)g->nranks) shm_unlink(g->name);
    munmap(g->map, g->map_bytes);
    free(g);
}

int acc_shm_group_rank(const acc_shm_group *g) { return g->rank; }
int acc_shm_group_size(const acc_shm_group *g) { return g->nranks; }
void acc_shm_group_set_timeout(acc_shm_group *g, double timeout_s) {
    if (timeout_s > 0) g->timeout_s = timeout_s;
}

/* ---- regions ------------------------------------------------------------------------------------ */

acc_status acc_shm_region_fd(const char *name, int create, size_t total_bytes, int *fd_out) {
    acc_status st = check_name(name);
    if (st) return st;
    int fd = create ? shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600) : shm_open(name, O_RDWR, 0);
    if (fd < 0) {
        acc_set_error("shm_open(%s): %s", name, strerror(errno));
        return ACC_ERR_OS;
    }
    if (create && size_segment(fd, "region", name, total_bytes)) {
        close(fd);
        shm_unlink(name);
        return ACC_ERR_OS;
    }
    *fd_out = fd;
    return ACC_OK;
}

acc_status acc_shm_unlink(const char *name) {
    if (shm_unlink(name) < 0 && errno != ENOENT) {
        acc_set_error("shm_unlink(%s): %s", name, strerror(errno));
        return ACC_ERR_OS;
    }
    return ACC_OK;
}

acc_status acc_shm_region_register(acc_shm_group *g, void *base, size_t part_bytes) {
    if (g->nregions >= SHM_MAX_REGIONS) {
        acc_set_error("too many shm regions (at most %d per group)", SHM_MAX_REGIONS);
        return ACC_ERR_STATE;
    }
    g->regions[g->nregions].base = base;
    g->regions[g->nregions].part_bytes = part_bytes;
    g->nregions++;
    return ACC_OK;
}

void acc_shm_region_unregister(acc_shm_group *g, void *base) {
    for (int i = 0; i < g->nregions; i++)
        if (g->regions[i].base == base) {
            g->regions[i] = g->regions[--g->nregions];
            return;
        }
}
