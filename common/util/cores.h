/* The cores of one host, shared by the thread pools of every pdserve process on it.
 *
 * A budget is a small shared-memory segment (/dev/shm/pdserve-cpu-NAME) holding the host's core
 * count and how many of them are free. A pool takes one core for its calling thread before each
 * run (always granted, even when that makes the count negative: an instance never waits for
 * another) and as many more for its workers as are free, and gives them back when the run ends.
 * So an instance alone on the box runs on every core, two busy instances settle at a share each,
 * and the threads that run at once stay near the core count instead of twice it.
 *
 * Each pool of each process owns a slot of the segment (an OFD lock on one byte of it, released
 * by the kernel when the process dies) recording what it holds; a slot whose lock is free but
 * whose count is not zero belongs to a process that died mid-run, and its cores are returned by
 * the next pool that looks (at open, and while a pool finds nothing free).
 *
 * Pinning, as vLLM's CPU backend: VLLM_CPU_OMP_THREADS_BIND lists the cores of each
 * tensor-parallel rank ("0-3", "0-3|4-7", "0,2,4-5"); "all" or "auto" (no NUMA binding here) or
 * unset leave the threads unpinned. A pinned pool owns its cores and does not join a budget.
 */
#ifndef PD_UTIL_CORES_H
#define PD_UTIL_CORES_H

#include <stdbool.h>

#define PD_CORES_MAX_SLOTS 64
#define PD_CORES_MAX_CPUS  1024

typedef struct pd_cores pd_cores;

/* Opens (creating if needed) the budget NAME ([A-Za-z0-9_.-], at most 64 bytes) of n_cores
 * cores; n_cores <= 0 means the cores this process may run on. The first opener's count holds
 * for everyone. A budget is used by one pool (one slot); a process may open several. */
int pd_cores_open(const char *name, int n_cores, pd_cores **out);
void pd_cores_free(pd_cores *c);

/* Takes the caller's core and up to want more: the first `sure` of them whether free or not (an
 * instance's own share, --cpu-threads), the others only while free; returns how many more it got
 * (0..want). Every take is followed by a pd_cores_give of 1 + that number. */
int pd_cores_take(pd_cores *c, int want, int sure);
void pd_cores_give(pd_cores *c, int n);

/* The budget's core count and its free cores now (may be negative). */
int pd_cores_total(const pd_cores *c);
int pd_cores_free_now(const pd_cores *c);

/* The budget PD_CPU_BUDGET names: "host" or unset -> "host" (every pdserve process of this user
 * on this host; containers share it when they share /dev/shm, e.g. docker --ipc=host), "off" ->
 * NULL (no budget), anything else -> that name. Fails on a malformed name, naming the variable. */
int pd_cores_budget_name(const char *env_value, const char **out);

/* The cores of rank (0-based) out of n_ranks in a VLLM_CPU_OMP_THREADS_BIND spec. *n = 0 when
 * the spec leaves threads unpinned (NULL, "", "all", "auto"). A spec with several '|' lists must
 * have one per rank. Errors name the variable and the bad part. */
int pd_cores_parse_bind(const char *spec, int rank, int n_ranks, int *cpus, int max, int *n);

/* Pins the calling thread to cpu (error with the CPU named if the kernel refuses). */
int pd_cores_pin_self(int cpu);

#endif
