/* Host core budget and core lists (see cores.h). The segment is a POSIX shared-memory object;
 * a slot's owner is whoever holds the OFD write lock on byte `slot` of it, so ownership ends
 * with the process (or the pool's close) without any cleanup code running. */
#define _GNU_SOURCE
#include "util/cores.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "util/clock.h"
#include "util/status.h"

#define SEG_MAGIC        0x70646370u /* "pdcp" */
#define SEG_INIT         1u
#define RECLAIM_EVERY_NS PD_NS_PER_S

typedef struct {
    _Atomic uint32_t state; /* 0, SEG_INIT while the first opener writes it, then SEG_MAGIC */
    int32_t n_cores;
    _Atomic int32_t free;                     /* n_cores minus the cores taken */
    _Atomic int32_t held[PD_CORES_MAX_SLOTS]; /* what each slot's pool has taken */
} seg;

struct pd_cores {
    int fd;
    seg *s;
    int slot;
    char name[80];
    int64_t last_reclaim_ns;
};

static int lock_byte(int fd, int i, short type)
{
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = i, .l_len = 1};
    return fcntl(fd, F_OFD_SETLK, &fl);
}

/* Returns the cores of slots whose owner is gone. Holding a slot's lock proves nobody owns it,
 * and its count can then be moved back to free without a race. */
static void reclaim_dead(pd_cores *c)
{
    c->last_reclaim_ns = pd_now_ns();
    for (int i = 0; i < PD_CORES_MAX_SLOTS; i++) {
        if (i == c->slot || atomic_load(&c->s->held[i]) == 0) continue;
        if (lock_byte(c->fd, i, F_WRLCK) != 0) continue; /* alive */
        int32_t n = atomic_exchange(&c->s->held[i], 0);
        if (n) atomic_fetch_add(&c->s->free, n);
        lock_byte(c->fd, i, F_UNLCK);
    }
}

static int online_cores(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static bool name_ok(const char *name)
{
    size_t n = strlen(name);
    if (n == 0 || n > 64) return false;
    for (size_t i = 0; i < n; i++) {
        char ch = name[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
              ch == '_' || ch == '.' || ch == '-'))
            return false;
    }
    return true;
}

static int map_segment(pd_cores *c)
{
    c->fd = shm_open(c->name, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (c->fd < 0) return pd_error(PD_EIO, "cpu budget %s: shm_open: %s", c->name, strerror(errno));
    struct stat st;
    if (fstat(c->fd, &st) != 0)
        return pd_error(PD_EIO, "cpu budget %s: fstat: %s", c->name, strerror(errno));
    if ((size_t)st.st_size < sizeof(seg) && ftruncate(c->fd, sizeof(seg)) != 0)
        return pd_error(PD_EIO, "cpu budget %s: ftruncate: %s", c->name, strerror(errno));
    void *m = mmap(NULL, sizeof(seg), PROT_READ | PROT_WRITE, MAP_SHARED, c->fd, 0);
    if (m == MAP_FAILED)
        return pd_error(PD_EIO, "cpu budget %s: mmap: %s", c->name, strerror(errno));
    c->s = m;
    return PD_OK;
}

/* The first opener writes the count; the others wait (2 s at most) until it has. */
static int init_segment(pd_cores *c, int n_cores)
{
    uint32_t zero = 0;
    if (atomic_compare_exchange_strong(&c->s->state, &zero, SEG_INIT)) {
        c->s->n_cores = n_cores;
        for (int i = 0; i < PD_CORES_MAX_SLOTS; i++) atomic_store(&c->s->held[i], 0);
        atomic_store(&c->s->free, n_cores);
        atomic_store(&c->s->state, SEG_MAGIC);
        return PD_OK;
    }
    for (int i = 0; i < 2000 && atomic_load(&c->s->state) == SEG_INIT; i++)
        pd_sleep_ns(PD_NS_PER_MS);
    uint32_t st = atomic_load(&c->s->state);
    if (st != SEG_MAGIC || c->s->n_cores <= 0)
        return pd_error(PD_EIO,
                        "cpu budget %s: the segment is not a pdserve budget (state %#x); remove "
                        "/dev/shm%s",
                        c->name, st, c->name);
    return PD_OK;
}

static int take_slot(pd_cores *c)
{
    for (int i = 0; i < PD_CORES_MAX_SLOTS; i++) {
        if (lock_byte(c->fd, i, F_WRLCK) != 0) continue;
        c->slot = i;
        int32_t n = atomic_exchange(&c->s->held[i], 0); /* a dead owner's, if any */
        if (n) atomic_fetch_add(&c->s->free, n);
        return PD_OK;
    }
    return pd_error(PD_EBUSY, "cpu budget %s: all %d slots are taken", c->name, PD_CORES_MAX_SLOTS);
}

int pd_cores_open(const char *name, int n_cores, pd_cores **out)
{
    *out = NULL;
    if (!name || !name_ok(name))
        return pd_error(PD_EINVAL, "cpu budget: name '%s' must be 1-64 of [A-Za-z0-9_.-]",
                        name ? name : "");
    pd_cores *c = calloc(1, sizeof *c);
    if (!c) return pd_error(PD_ENOMEM, "cpu budget: out of memory");
    c->fd = -1;
    c->slot = -1;
    snprintf(c->name, sizeof c->name, "/pdserve-cpu-%s", name);
    int rc = map_segment(c);
    if (rc == PD_OK) rc = init_segment(c, n_cores > 0 ? n_cores : online_cores());
    if (rc == PD_OK) rc = take_slot(c);
    if (rc != PD_OK) {
        pd_cores_free(c);
        return rc;
    }
    reclaim_dead(c);
    *out = c;
    return PD_OK;
}

void pd_cores_free(pd_cores *c)
{
    if (!c) return;
    if (c->s && c->slot >= 0) {
        int32_t n = atomic_exchange(&c->s->held[c->slot], 0);
        if (n) atomic_fetch_add(&c->s->free, n);
    }
    if (c->s) munmap(c->s, sizeof(seg));
    if (c->fd >= 0) close(c->fd); /* drops the slot's lock */
    free(c);
}

int pd_cores_take(pd_cores *c, int want, int sure)
{
    seg *s = c->s;
    if (sure > want) sure = want;
    if (sure < 0) sure = 0;
    /* free first, then held: a process killed in between leaks its cores rather than granting
       cores twice */
    atomic_fetch_sub(&s->free, 1 + sure);
    int got = 0;
    want -= sure;
    int32_t f = atomic_load_explicit(&s->free, memory_order_relaxed);
    while (want > 0 && f > 0) {
        int t = f < want ? (int)f : want;
        if (atomic_compare_exchange_weak(&s->free, &f, f - t)) {
            got = t;
            break;
        }
    }
    atomic_fetch_add_explicit(&s->held[c->slot], 1 + sure + got, memory_order_relaxed);
    if (got < want && pd_now_ns() - c->last_reclaim_ns > RECLAIM_EVERY_NS) reclaim_dead(c);
    return sure + got;
}

void pd_cores_give(pd_cores *c, int n)
{
    atomic_fetch_sub_explicit(&c->s->held[c->slot], n, memory_order_relaxed);
    atomic_fetch_add(&c->s->free, n);
}

int pd_cores_total(const pd_cores *c)
{
    return c->s->n_cores;
}

int pd_cores_free_now(const pd_cores *c)
{
    return atomic_load(&c->s->free);
}

int pd_cores_budget_name(const char *v, const char **out)
{
    *out = NULL;
    if (!v || !*v || strcmp(v, "host") == 0) {
        *out = "host";
        return PD_OK;
    }
    if (strcmp(v, "off") == 0) return PD_OK;
    if (!name_ok(v))
        return pd_error(PD_EINVAL,
                        "PD_CPU_BUDGET: '%s' is not host, off or a name of 1-64 [A-Za-z0-9_.-]", v);
    *out = v;
    return PD_OK;
}

/* One '|'-free list "a,b-c,..." of [s, e) into cpus; errors name the variable. */
static int parse_list(const char *s, const char *e, int *cpus, int max, int *n)
{
    *n = 0;
    const char *p = s;
    while (p < e) {
        char *end;
        errno = 0;
        long a = strtol(p, &end, 10), b = a;
        if (end == p || errno || a < 0 || a >= PD_CORES_MAX_CPUS) goto bad;
        p = end;
        if (p < e && *p == '-') {
            b = strtol(p + 1, &end, 10);
            if (end == p + 1 || errno || b < a || b >= PD_CORES_MAX_CPUS) goto bad;
            p = end;
        }
        if (p < e && (*p != ',' || ++p == e)) goto bad; /* a ',' needs a core after it */
        for (long cpu = a; cpu <= b; cpu++) {
            for (int i = 0; i < *n; i++)
                if (cpus[i] == cpu)
                    return pd_error(PD_EINVAL,
                                    "VLLM_CPU_OMP_THREADS_BIND: core %ld listed twice in "
                                    "'%.*s'",
                                    cpu, (int)(e - s), s);
            if (*n >= max)
                return pd_error(PD_EINVAL,
                                "VLLM_CPU_OMP_THREADS_BIND: '%.*s' lists more than %d "
                                "cores",
                                (int)(e - s), s, max);
            cpus[(*n)++] = (int)cpu;
        }
    }
    if (*n == 0) goto bad;
    return PD_OK;
bad:
    return pd_error(PD_EINVAL,
                    "VLLM_CPU_OMP_THREADS_BIND: '%.*s' is not a core list (e.g. 0-3 or 0,2,4-5)",
                    (int)(e - s), s);
}

int pd_cores_parse_bind(const char *spec, int rank, int n_ranks, int *cpus, int max, int *n)
{
    *n = 0;
    if (!spec || !*spec || strcmp(spec, "all") == 0 || strcmp(spec, "auto") == 0) return PD_OK;
    int lists = 1;
    for (const char *p = spec; *p; p++) lists += *p == '|';
    if (lists != n_ranks)
        return pd_error(PD_EINVAL,
                        "VLLM_CPU_OMP_THREADS_BIND: %d core list%s for %d tensor-parallel rank%s "
                        "(one per rank, separated by '|')",
                        lists, lists == 1 ? "" : "s", n_ranks, n_ranks == 1 ? "" : "s");
    const char *s = spec;
    for (int r = 0; r < rank; r++) s = strchr(s, '|') + 1;
    const char *e = strchr(s, '|');
    return parse_list(s, e ? e : s + strlen(s), cpus, max, n);
}

int pd_cores_pin_self(int cpu)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    int rc = pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    if (rc != 0)
        return pd_error(PD_EINVAL, "VLLM_CPU_OMP_THREADS_BIND: cannot run on core %d: %s", cpu,
                        strerror(rc));
    return PD_OK;
}
