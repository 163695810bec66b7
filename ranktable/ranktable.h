/* Ranktables: who each process is and who its peers are (prefix rt_).
 *
 * The wire format is the Ascend PD-separation tooling's (pd_ranktable_tools.py) and stays
 * byte-compatible with it: a global table lists the scheduler (group "0"), the prefill
 * instances (group "1") and the decode instances (group "2"); a local table holds the one
 * instance a process runs (or the scheduler host: a server without "device"). Every count
 * and id is a JSON string. Serialization matches Python json.dump(obj, f, indent=4): 4-space
 * indentation, separators "," and ": ", \uXXXX escapes for non-ASCII, no trailing
 * newline. docs/ranktable.md describes the format and every rule.
 *
 * Design: a table keeps its parsed JSON document (so unknown fields survive merge and
 * save) plus an index of instances built by the validating walk; lookups return views
 * (rt_instance, rt_device) that borrow strings from the table and stay valid until the
 * table is freed or modified. Validation collects every problem into an optional
 * rt_report ("<file>: <json path>: <problem>") and returns the first one as the status
 * and pd_last_error() message, so a CLI can print them all and a server can fail fast.
 */
#ifndef PD_RANKTABLE_RANKTABLE_H
#define PD_RANKTABLE_RANKTABLE_H

#include <stdbool.h>
#include <stddef.h>

/* Role = group index = group_id of the global table. Values are part of the format. */
typedef enum {
    RT_ROLE_SCHEDULER = 0, /* group "0": the api-server, one server, no devices */
    RT_ROLE_PREFILL = 1,   /* group "1" */
    RT_ROLE_DECODE = 2,    /* group "2" */
} rt_role;
#define RT_ROLE_COUNT 3

/* "scheduler", "prefill", "decode" ("unknown" otherwise). */
const char *rt_role_name(rt_role role);

/* Limits enforced by validation (bad or hostile files are rejected, never trusted). */
#define RT_MAX_INSTANCES 4096 /* per group */
#define RT_MAX_DEVICES   1024 /* per instance; also the bound on device_id */
#define RT_MAX_STRING    255  /* server_id, server_ip, device_ip length in bytes */

/* One device of an instance. Strings borrowed from the table. */
typedef struct {
    const char *device_id; /* as written: decimal string, e.g. "4" */
    const char *device_ip; /* address the KV data plane of this device uses */
    const char *rank_id;   /* decimal string, equals the index in the instance */
    int ordinal;           /* device_id parsed: the CUDA ordinal, 0..RT_MAX_DEVICES-1 */
    int rank;              /* rank_id parsed: 0..n_devices-1 */
} rt_device;

/* One server_list entry: a scheduler host or a prefill/decode instance. Borrowed view. */
typedef struct {
    rt_role role;
    size_t index; /* position within its group (global order) */
    const char *server_id;
    const char *server_ip;
    size_t n_devices;         /* = tensor-parallel size; 0 for the scheduler */
    const rt_device *devices; /* n_devices entries in rank order; NULL when n_devices == 0 */
} rt_instance;

/* ---- problem reports ------------------------------------------------------------------ */

/* Collects every problem found while loading/validating (at most 1000 kept; the count
 * goes on). Pass NULL where only the first problem matters. */
typedef struct rt_report rt_report;

/* NULL when out of memory. */
rt_report *rt_report_create(void);
void rt_report_free(rt_report *r);
/* Number of problems recorded (including any past the kept limit). */
size_t rt_report_count(const rt_report *r);
/* Message i (0-based, i < kept count), or NULL. "<what>: <json path>: <problem>". */
const char *rt_report_message(const rt_report *r, size_t i);
/* Forgets all messages. */
void rt_report_clear(rt_report *r);

/* ---- loading and validation ----------------------------------------------------------- */

enum {
    /* Global tables only: accept a fragment made by `gen` on one host (group "0" absent
     * without --api-server, or a group with no instances absent). The groups present
     * must still be in order "0","1","2" and each valid. Used for merge inputs. */
    RT_LOAD_FRAGMENT = 1u << 0,
    /* Allow one device to serve two instances on one host (P and D sharing a GPU, the
     * CUDA IPC test setup). Off by default: the rule is "no device twice on one host". */
    RT_ALLOW_SHARED_DEVICES = 1u << 1,
};

typedef struct rt_global rt_global;
typedef struct rt_local rt_local;

/* Parse + validate a global table. what names the source in messages (a file name).
 * On success *out is a new table; on failure *out is NULL, the status is that of the first
 * problem (PD_EPARSE for malformed JSON with line and column, PD_EINVAL for a broken
 * rule, PD_EUNSUPPORTED for an unknown version, PD_ENOTFOUND/PD_EIO for a missing or
 * unreadable file) and every problem found is appended to report (may be NULL). */
int rt_global_load_file(const char *file, unsigned flags, rt_report *report, rt_global **out);
int rt_global_load_string(const char *text, size_t len, const char *what, unsigned flags,
                          rt_report *report, rt_global **out);

/* Same for a local table (flags: none defined yet, pass 0). */
int rt_local_load_file(const char *file, unsigned flags, rt_report *report, rt_local **out);
int rt_local_load_string(const char *text, size_t len, const char *what, unsigned flags,
                         rt_report *report, rt_local **out);

void rt_global_free(rt_global *g);
void rt_local_free(rt_local *l);

/* Re-runs every rule on g (e.g. after building it), as a complete table unless flags has
 * RT_LOAD_FRAGMENT. Same status/report contract as loading. */
int rt_global_validate(const rt_global *g, const char *what, unsigned flags, rt_report *report);

/* The name given when loading ("(built)" for a table built in memory). */
const char *rt_global_what(const rt_global *g);
const char *rt_local_what(const rt_local *l);

/* ---- lookups ---------------------------------------------------------------------------- */

/* True when all three groups are present (a table a cluster can run from). */
bool rt_global_is_complete(const rt_global *g);

/* Instances of a role, in global order (scheduler: 0 or 1). */
size_t rt_global_instance_count(const rt_global *g, rt_role role);
/* Instance i of a role, or NULL when out of range. */
const rt_instance *rt_global_instance(const rt_global *g, rt_role role, size_t i);
/* The scheduler host, or NULL when the table has no group "0". */
const rt_instance *rt_global_scheduler(const rt_global *g);

/* Prefill then decode instances, the order NODE_PORTS follows: node k of
 * rt_global_node_count(g). NULL when out of range. */
size_t rt_global_node_count(const rt_global *g);
const rt_instance *rt_global_node(const rt_global *g, size_t k);

/* Tensor-parallel size of a role (device count of its instances; 0 when the role has
 * no instances or is the scheduler). */
int rt_global_tp_size(const rt_global *g, rt_role role);

/* The local table's single server (scheduler host or instance); its role field is
 * RT_ROLE_SCHEDULER for a host table and RT_ROLE_PREFILL otherwise (unknown until matched:
 * use rt_find_instance), index 0. Never NULL for a loaded table. */
const rt_instance *rt_local_instance(const rt_local *l);
/* True for a *_host.json table (a server without "device", or with an empty one). */
bool rt_local_is_host(const rt_local *l);

/* Finds where local sits inside global: the scheduler (host table whose server_id and
 * server_ip equal the scheduler's), or the prefill/decode instance with the same
 * server_id, server_ip and device list (device_id, device_ip, rank_id, in order).
 * Returns PD_OK with *role and *index set (either may be NULL), PD_ENOTFOUND when
 * nothing matches, PD_EINVAL when more than one instance matches; the message names both
 * tables. */
int rt_find_instance(const rt_global *g, const rt_local *l, rt_role *role, size_t *index);

/* ---- building ----------------------------------------------------------------------------- */

/* An empty table (version "1.0", status "completed", no groups). NULL when out of memory. */
rt_global *rt_global_create(void);

/* Sets the scheduler host (group "0", one server, no devices); replaces an earlier one. */
int rt_global_set_scheduler(rt_global *g, const char *server_id, const char *server_ip);

/* Appends a prefill or decode instance: n_devices devices with the given CUDA ordinals;
 * device_ips[k] is the data-plane address of device k (NULL, or a NULL entry: server_ip).
 * rank_id is assigned 0..n_devices-1. Per-call checks only (non-empty strings, ordinals in
 * range); cross-instance rules are checked by rt_global_validate. *index (may be NULL)
 * receives its position in the group. */
int rt_global_add_instance(rt_global *g, rt_role role, const char *server_id, const char *server_ip,
                           size_t n_devices, const int *ordinals, const char *const *device_ips,
                           size_t *index);

/* The local table of instance i of role (the scheduler: the host table). */
int rt_local_from_global(const rt_global *g, rt_role role, size_t i, rt_local **out);

/* Merges fragments in input order: exactly one scheduler over all inputs, prefill and
 * decode instances concatenated, server_count updated, unknown fields kept (instance and
 * device objects as they are; top-level and group fields from the first input that has
 * them). names[i] names inputs[i] in messages. The result is validated as a complete
 * table; *out is NULL on failure. */
int rt_global_merge(const rt_global *const *inputs, const char *const *names, size_t n,
                    unsigned flags, rt_global **out);

/* ---- serialization and files ------------------------------------------------------------ */

/* Python json.dump(indent=4) text of the table, without trailing newline. Caller frees
 * with free(). NULL when out of memory. */
char *rt_global_dumps(const rt_global *g);
char *rt_local_dumps(const rt_local *l);
/* Writes that text to file atomically (temporary file + rename), mode 0600 like the
 * Ascend tool. */
int rt_global_save(const rt_global *g, const char *file);
int rt_local_save(const rt_local *l, const char *file);

/* File names of `gen`/`merge`: "global_ranktable_<ip>.json",
 * "local_ranktable_<ip>_<device ids concatenated>.json" (inst NULL or the scheduler:
 * "local_ranktable_<ip>_host.json"), "global_ranktable_merge.json" (RT_MERGE_FILE_NAME).
 * PD_ERANGE when buf is too small. */
#define RT_MERGE_FILE_NAME "global_ranktable_merge.json"
int rt_global_file_name(char *buf, size_t n, const char *ip);
int rt_local_file_name(char *buf, size_t n, const char *ip, const rt_instance *inst);

/* ---- gen ---------------------------------------------------------------------------------- */

/* Inputs of `pd-ranktable --mode gen`; start from rt_gen_default_params(). */
typedef struct {
    const char *server_ip;      /* host address: server_id and server_ip of every entry;
                                   NULL = rt_host_ipv4() */
    const char *device_ip_list; /* "IP,IP,...": entry k is the address of device k;
                                   NULL = server_ip for every device */
    bool api_server;            /* add group "0" and the _host local table */
    const char *const *prefill; /* n_prefill device lists, each "4,5" */
    size_t n_prefill;
    const char *const *decode; /* n_decode device lists */
    size_t n_decode;
    unsigned flags; /* RT_ALLOW_SHARED_DEVICES */
} rt_gen_params;

rt_gen_params rt_gen_default_params(void);

/* Builds the host's global table (a fragment without api_server or without one role) and
 * validates it as a fragment. Bad lists name the option ("--prefill-server-list[1]: ..."). */
int rt_gen(const rt_gen_params *p, rt_global **out);

/* Writes the global table and every local table of g into save_dir (created if missing,
 * one level): global_ranktable_<ip>.json, one local per instance, and the _host table
 * when g has a scheduler. ip is the name used in file names. on_file (may be NULL) is
 * called with each path written. */
int rt_write_tables(const rt_global *g, const char *ip, const char *save_dir,
                    void (*on_file)(const char *path, void *arg), void *arg);

/* Parses a device list "4,5" into ordinals (cap entries at most); what names it in
 * messages. Empty entries, non-digits, values >= RT_MAX_DEVICES, more than cap: PD_EINVAL. */
int rt_parse_device_list(const char *s, const char *what, int *ordinals, size_t cap, size_t *n);

/* First non-loopback IPv4 address of an interface that is up, as dotted text.
 * PD_ENOTFOUND (with a hint to pass --server-ip) when there is none. */
int rt_host_ipv4(char *buf, size_t n);

#endif
