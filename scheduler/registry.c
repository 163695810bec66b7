/* Instance registry and heartbeat (see registry.h); routing decisions are balancer.h's. */
#include "registry.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "balancer.h"
#include "rpc/pd_msg.h"
#include "util/clock.h"
#include "util/fmt.h"
#include "util/hash.h"
#include "util/log.h"
#include "util/status.h"

#define REG_MAX_RANKS 64

/* Prefix affinity (pd_reg_pick_cached): per instance, the block keys of the prompts this
 * scheduler sent it, direct-mapped (a newer key takes an older one's slot). */
#define PFX_SLOTS      (1u << 15)
#define PFX_MAX_BLOCKS 512 /* a prompt's first blocks that count */
/* A prefill rate is read from at least RATE_MIN_NS of busy time; older time weighs half once
 * the busy time passes RATE_WINDOW_NS. */
#define RATE_MIN_NS    20000000ll
#define RATE_WINDOW_NS 30000000000ll

typedef struct {
    const rt_instance *inst; /* borrowed from the global table */
    char name[300];          /* "<server_ip>:<port>" */
    int port;
    pd_rpc_channel *ch;
    /* under r->mu */
    bool verified;           /* Info matched the ranktable */
    bool up;                 /* verified and the last Stats answered */
    char reason[256];        /* why it is out (logged once per change) */
    int64_t load_tokens;     /* from Stats: queued (P) or running + reserved (D) */
    int64_t inflight_tokens; /* what this scheduler has in flight on it */
    /* a prefill instance's measured rate (pd_reg_prefill_done): the tokens it finished over the
       time it had work in flight, both halved as the time passes RATE_WINDOW_NS */
    int64_t busy_ns, busy_mark_ns;
    double done_tokens;
    int64_t kv_total, kv_free, preemptions;
    int64_t cache_queries, cache_hits; /* prefix cache, cumulative */
    int64_t running, waiting, held;    /* from Stats: the engine's queues */
    int64_t stats_ns;                  /* when the last Stats answered (pd_now_ns), 0 = never */
    int64_t steps[PD_ENGINE_STEP_BINS], steps_sum; /* from Stats: cumulative, this process's */
    double stage_s[PD_ENGINE_MAX_PP];              /* from Stats: each stage's compute seconds */
    int n_stages;
    pd_reg_spec spec;                              /* from Stats: cumulative */
    int max_num_seqs;
    char transport[16]; /* from Info */
    uint64_t epoch;     /* from Info: Stats with another one means the process restarted */
    int block_size;     /* from Info */
    char kv_dtype[16];  /* from Info */
    bool caches;        /* from Info: it runs with prefix caching */
    uint64_t *pfx;      /* (PFX_SLOTS) block keys sent to it, 0 = empty */
    size_t n_ranks;
    Pd__DecodeTarget targets[REG_MAX_RANKS]; /* host strings in target_hosts */
    char target_hosts[REG_MAX_RANKS][64];
} reg_node;

struct pd_reg {
    rt_global *g;
    pd_rpc_client *client;
    int n;
    reg_node *nodes; /* (n,) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_rwlock_t ch_lock; /* read: starting a call; write: closing the channels */
    bool closed;              /* under ch_lock */
    bool stop, running;
    int rounds;
    int first[RT_ROLE_COUNT]; /* the role's instances: nodes [first, first + count), as the */
    int count[RT_ROLE_COUNT]; /* global table orders them (prefill first, then decode) */
    pd_balancer *bal[RT_ROLE_COUNT]; /* the routing policy of each role */
    pd_balancer_target *cand;        /* (n,) scratch of a pick, under mu */
    bool *tried;                     /* (n,) scratch of a pick, under mu */
    pthread_t thread;
    int period_ms, timeout_ms;
    int64_t max_model_len; /* the scheduler's L; 0 = not checked (set before the heartbeat) */
    /* engine steps over every instance, cumulative across their restarts (each Stats adds what
       its process counted since the previous one) */
    int64_t steps[PD_ENGINE_STEP_BINS], steps_sum;
    pd_reg_change_fn on_change;
    void *on_change_arg;
};

int pd_reg_create(const char *global_file, const char *node_ports, pd_rpc_client *client,
                  pd_reg **out)
{
    *out = NULL;
    if (!global_file || !*global_file)
        return pd_error(PD_EINVAL, "GLOBAL_RANK_TABLE_FILE_PATH is not set");
    if (!node_ports || !*node_ports) return pd_error(PD_EINVAL, "NODE_PORTS is not set");
    pd_reg *r = calloc(1, sizeof *r);
    if (!r) return pd_error(PD_ENOMEM, "registry: out of memory");
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    pthread_rwlock_init(&r->ch_lock, NULL);
    r->client = client;
    int rc = rt_global_load_file(global_file, 0, NULL, &r->g);
    if (rc < 0) goto fail;
    r->n = (int)rt_global_node_count(r->g);
    if (r->n == 0) {
        rc = pd_error(PD_EINVAL, "%s: no prefill or decode instance", global_file);
        goto fail;
    }
    r->nodes = calloc((size_t)r->n, sizeof *r->nodes);
    r->cand = calloc((size_t)r->n, sizeof *r->cand);
    r->tried = calloc((size_t)r->n, sizeof *r->tried);
    bool ok = r->nodes && r->cand && r->tried;
    for (int role = 0; role < RT_ROLE_COUNT; role++)
        ok = (r->bal[role] = pd_balancer_least_load_create()) != NULL && ok;
    if (!ok) {
        rc = pd_error(PD_ENOMEM, "registry: out of memory");
        goto fail;
    }
    /* NODE_PORTS: comma-separated decimal ports, one per instance in global order */
    int k = 0;
    const char *s = node_ports;
    while (*s) {
        char *end;
        errno = 0;
        long port = strtol(s, &end, 10);
        if (end == s || errno || port < 1 || port > 65535 || (*end && *end != ',')) {
            rc = pd_error(PD_EINVAL, "NODE_PORTS: '%s': entry %d is not a port (1..65535)",
                          node_ports, k + 1);
            goto fail;
        }
        if (k < r->n) r->nodes[k].port = (int)port;
        k++;
        s = *end ? end + 1 : end;
    }
    if (k != r->n) {
        rc = pd_error(PD_EINVAL,
                      "NODE_PORTS: %d port(s) given but %s lists %zu prefill + %zu decode "
                      "instance(s); give one port per prefill then per decode instance",
                      k, global_file, rt_global_instance_count(r->g, RT_ROLE_PREFILL),
                      rt_global_instance_count(r->g, RT_ROLE_DECODE));
        goto fail;
    }
    for (int i = 0; i < r->n; i++) {
        reg_node *nd = &r->nodes[i];
        nd->inst = rt_global_node(r->g, (size_t)i);
        if (r->count[nd->inst->role]++ == 0) r->first[nd->inst->role] = i;
        if (!(nd->pfx = calloc(PFX_SLOTS, sizeof *nd->pfx))) {
            rc = pd_error(PD_ENOMEM, "registry: out of memory");
            goto fail;
        }
        snprintf(nd->name, sizeof nd->name, "%s:%d", nd->inst->server_ip, nd->port);
        snprintf(nd->reason, sizeof nd->reason, "not contacted yet");
        for (int j = 0; j < i; j++) {
            if (strcmp(r->nodes[j].name, nd->name) == 0) {
                rc = pd_error(PD_EINVAL,
                              "NODE_PORTS: %s %zu and %s %zu both use %s; every instance on a "
                              "host needs its own port",
                              rt_role_name(r->nodes[j].inst->role), r->nodes[j].inst->index,
                              rt_role_name(nd->inst->role), nd->inst->index, nd->name);
                goto fail;
            }
        }
    }
    for (int i = 0; i < r->n; i++) {
        rc = pd_rpc_channel_create(client, r->nodes[i].name, 0, &r->nodes[i].ch);
        if (rc < 0) goto fail;
    }
    *out = r;
    return PD_OK;
fail:
    pd_reg_free(r);
    return rc;
}

/* Compares an Info reply with the ranktable entry; 0 when it matches, else writes why. */
static int check_identity(const reg_node *nd, const Pd__InfoReply *m, char *why, size_t n)
{
    const rt_instance *in = nd->inst;
    const char *role = rt_role_name(in->role);
    if (strcmp(m->role, role) != 0) {
        snprintf(why, n, "answers as role '%s', the ranktable says '%s'", m->role, role);
        return -1;
    }
    if ((size_t)m->instance_index != in->index) {
        snprintf(why, n, "answers as %s instance %d, the ranktable says %zu", role,
                 m->instance_index, in->index);
        return -1;
    }
    if (strcmp(m->server_id, in->server_id) != 0) {
        snprintf(why, n, "answers with server_id '%s', the ranktable says '%s'", m->server_id,
                 in->server_id);
        return -1;
    }
    if (strcmp(m->server_ip, in->server_ip) != 0) {
        snprintf(why, n, "answers with server_ip '%s', the ranktable says '%s'", m->server_ip,
                 in->server_ip);
        return -1;
    }
    int pp = m->pp_size > 0 ? m->pp_size : 1;
    if (m->n_ranks != in->n_devices || (size_t)m->tp_size * (size_t)pp != in->n_devices) {
        snprintf(why, n,
                 "answers with %zu rank(s) (tp %d x pp %d), the ranktable lists %zu device(s)",
                 m->n_ranks, m->tp_size, pp, in->n_devices);
        return -1;
    }
    if (m->n_ranks > REG_MAX_RANKS) {
        snprintf(why, n, "has %zu ranks, more than the %d supported", m->n_ranks, REG_MAX_RANKS);
        return -1;
    }
    for (size_t i = 0; i < m->n_ranks; i++) {
        const Pd__RankInfo *ri = m->ranks[i];
        if (ri->rank != (int32_t)i || ri->device_id != in->devices[i].ordinal) {
            snprintf(why, n, "rank %zu answers with device %d, the ranktable says device %d", i,
                     ri->device_id, in->devices[i].ordinal);
            return -1;
        }
        if (strlen(ri->device_ip) >= sizeof nd->target_hosts[0]) {
            snprintf(why, n, "rank %zu device_ip is too long", i);
            return -1;
        }
    }
    return 0;
}

/* Checks an Info reply against this scheduler's limits and the instances of the other role
 * verified so far; 0 when the instance can serve every request the scheduler admits, else
 * writes why. */
static int check_limits(pd_reg *r, const Pd__InfoReply *m, char *why, size_t n)
{
    /* a prompt the scheduler admits would be refused there (Reserve: INVALID_ARGUMENT) */
    if (r->max_model_len > 0 && m->max_model_len < r->max_model_len) {
        snprintf(why, n,
                 "its max_model_len %lld is less than the scheduler's --max-model-len %lld; "
                 "start it with --max-model-len %lld or more, or lower the scheduler's",
                 (long long)m->max_model_len, (long long)r->max_model_len,
                 (long long)r->max_model_len);
        return -1;
    }
    /* the KV moves as the pools hold it, block by block: a prefill and a decode instance must
       agree on both */
    int rc = 0;
    pthread_mutex_lock(&r->mu);
    for (int j = 0; j < r->n && rc == 0; j++) {
        const reg_node *o = &r->nodes[j];
        if (!o->verified || strcmp(rt_role_name(o->inst->role), m->role) == 0) continue;
        if (strcmp(o->kv_dtype, m->kv_dtype) != 0)
            snprintf(why, n,
                     "its KV cache holds %s, %s instance %zu's holds %s: start every instance "
                     "with the same --kv-cache-dtype (and --dtype)",
                     m->kv_dtype, rt_role_name(o->inst->role), o->inst->index, o->kv_dtype);
        else if (o->block_size != m->block_size)
            snprintf(why, n,
                     "its KV blocks hold %d tokens, %s instance %zu's hold %d: start every "
                     "instance with the same --block-size",
                     m->block_size, rt_role_name(o->inst->role), o->inst->index, o->block_size);
        else
            continue;
        rc = -1;
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

/* Marks node k out (with reason) or in; calls on_change outside the lock on a change. */
static void set_state(pd_reg *r, int k, bool up, const char *reason)
{
    reg_node *nd = &r->nodes[k];
    pthread_mutex_lock(&r->mu);
    bool changed = nd->up != up || (!up && strcmp(nd->reason, reason) != 0);
    bool up_changed = nd->up != up;
    nd->up = up;
    if (!up) {
        nd->verified = false;
        pd_str_copy(nd->reason, sizeof nd->reason, reason);
    }
    pthread_mutex_unlock(&r->mu);
    if (changed) {
        if (up)
            PD_INFO(NULL, "%s instance %zu at %s joined the routing set",
                    rt_role_name(nd->inst->role), nd->inst->index, nd->name);
        else
            PD_WARN(NULL, "%s instance %zu at %s is out of the routing set: %s",
                    rt_role_name(nd->inst->role), nd->inst->index, nd->name, reason);
    }
    if (up_changed && r->on_change) r->on_change(r->on_change_arg, k, up);
}

/* One heartbeat of node k: Info while it is not verified, then Stats. again: this is the re-read
 * after a restart was noticed (not repeated). */
static void heartbeat_node(pd_reg *r, int k, bool again)
{
    reg_node *nd = &r->nodes[k];
    char why[512];
    pthread_mutex_lock(&r->mu);
    bool verified = nd->verified;
    pthread_mutex_unlock(&r->mu);
    uint8_t *resp = NULL;
    size_t len = 0;
    if (!verified) {
        Pd__InfoRequest q = PD__INFO_REQUEST__INIT;
        uint8_t buf[16];
        size_t qlen = pd__info_request__pack(&q, buf);
        if (pd_rpc_unary(nd->ch, "/pd.PD/Info", buf, qlen, r->timeout_ms, &resp, &len, NULL) < 0) {
            snprintf(why, sizeof why, "Info failed: %s", pd_last_error());
            set_state(r, k, false, why);
            return;
        }
        Pd__InfoReply *m = pd__info_reply__unpack(NULL, len, resp);
        free(resp);
        if (!m) {
            set_state(r, k, false, "Info reply does not parse");
            return;
        }
        const char *refused =
            check_identity(nd, m, why, sizeof why) < 0 ? "identity does not match the ranktable"
            : check_limits(r, m, why, sizeof why) < 0  ? "does not fit this scheduler"
                                                       : NULL;
        if (refused) {
            char msg[700];
            snprintf(msg, sizeof msg, "%s: %s", refused, why);
            pd__info_reply__free_unpacked(m, NULL);
            set_state(r, k, false, msg);
            return;
        }
        pthread_mutex_lock(&r->mu);
        nd->verified = true;
        if (m->instance_epoch != nd->epoch) { /* a new process counts its steps from 0 */
            memset(nd->steps, 0, sizeof nd->steps);
            nd->steps_sum = 0;
        }
        nd->epoch = m->instance_epoch;
        nd->block_size = m->block_size;
        pd_str_copy(nd->kv_dtype, sizeof nd->kv_dtype, m->kv_dtype);
        nd->caches = m->prefix_caching;
        if (nd->pfx) memset(nd->pfx, 0, PFX_SLOTS * sizeof *nd->pfx); /* a new process */
        nd->max_num_seqs = m->max_num_seqs;
        snprintf(nd->transport, sizeof nd->transport, "%s", m->kv_transport);
        nd->n_ranks = m->n_ranks;
        for (size_t i = 0; i < m->n_ranks; i++) {
            Pd__DecodeTarget *t = &nd->targets[i];
            pd__decode_target__init(t);
            snprintf(nd->target_hosts[i], sizeof nd->target_hosts[i], "%s", m->ranks[i]->device_ip);
            t->host = nd->target_hosts[i];
            t->port = m->ranks[i]->data_port;
            t->kv_head0 = m->ranks[i]->kv_head0;
            t->kv_heads = m->ranks[i]->kv_heads;
            t->kv_layer0 = m->ranks[i]->kv_layer0;
            t->kv_layers = m->ranks[i]->kv_layers;
        }
        pthread_mutex_unlock(&r->mu);
        pd__info_reply__free_unpacked(m, NULL);
    }
    Pd__StatsRequest sq = PD__STATS_REQUEST__INIT;
    uint8_t sbuf[16];
    size_t slen = pd__stats_request__pack(&sq, sbuf);
    if (pd_rpc_unary(nd->ch, "/pd.PD/Stats", sbuf, slen, r->timeout_ms, &resp, &len, NULL) < 0) {
        snprintf(why, sizeof why, "Stats failed: %s", pd_last_error());
        set_state(r, k, false, why);
        return;
    }
    Pd__StatsReply *st = pd__stats_reply__unpack(NULL, len, resp);
    free(resp);
    if (!st) {
        set_state(r, k, false, "Stats reply does not parse");
        return;
    }
    bool draining = st->draining;
    pthread_mutex_lock(&r->mu);
    if (st->instance_epoch != nd->epoch) {
        /* restarted on the same port since its Info was read (its data ports, say, changed):
         * read Info again now; its old process's calls have failed already */
        nd->verified = false;
        pthread_mutex_unlock(&r->mu);
        pd__stats_reply__free_unpacked(st, NULL);
        if (!again) {
            PD_INFO(NULL, "%s instance %zu at %s restarted: reading its Info again",
                    rt_role_name(nd->inst->role), nd->inst->index, nd->name);
            heartbeat_node(r, k, true);
        }
        return;
    }
    /* decode: the KV its sequences and reservations hold. A prefill instance's work ahead is what
       this scheduler (the cluster's one) has in flight there: its Stats' queued_tokens are a
       heartbeat old, older than a prefill takes, and would count work already done */
    nd->load_tokens =
        nd->inst->role == RT_ROLE_PREFILL ? 0 : st->running_tokens + st->reserved_tokens;
    nd->kv_total = st->kv_blocks_total;
    nd->kv_free = st->kv_blocks_free;
    nd->preemptions = st->num_preemptions;
    nd->cache_queries = st->prefix_cache_queries;
    nd->cache_hits = st->prefix_cache_hits;
    nd->spec = (pd_reg_spec){.drafts = st->spec_drafts,
                             .draft_tokens = st->spec_draft_tokens,
                             .accepted = st->spec_accepted_tokens};
    for (size_t i = 0; i < st->n_spec_accepted_per_pos && i < PD_ENGINE_SPEC_MAX_TOKENS; i++)
        nd->spec.per_pos[i] = st->spec_accepted_per_pos[i];
    nd->n_stages = 0;
    for (size_t i = 0; i < st->n_stage_seconds && i < PD_ENGINE_MAX_PP; i++)
        nd->stage_s[nd->n_stages++] = st->stage_seconds[i];
    nd->running = st->num_running;
    nd->waiting = st->num_waiting;
    nd->held = st->num_held;
    nd->stats_ns = pd_now_ns();
    for (size_t i = 0; i < st->n_step_tokens && i < PD_ENGINE_STEP_BINS; i++) {
        if (st->step_tokens[i] > nd->steps[i]) r->steps[i] += st->step_tokens[i] - nd->steps[i];
        nd->steps[i] = st->step_tokens[i];
    }
    if (st->step_tokens_sum > nd->steps_sum) r->steps_sum += st->step_tokens_sum - nd->steps_sum;
    nd->steps_sum = st->step_tokens_sum;
    pthread_mutex_unlock(&r->mu);
    pd__stats_reply__free_unpacked(st, NULL);
    if (draining)
        set_state(r, k, false, "draining (shutting down)");
    else
        set_state(r, k, true, "");
}

static void *heartbeat_main(void *arg)
{
    pd_reg *r = arg;
    pd_log_set_role("scheduler");
    for (;;) {
        for (int k = 0; k < r->n; k++) {
            pthread_mutex_lock(&r->mu);
            bool stop = r->stop;
            pthread_mutex_unlock(&r->mu);
            if (stop) return NULL;
            heartbeat_node(r, k, false);
        }
        pthread_mutex_lock(&r->mu);
        r->rounds++;
        pthread_cond_broadcast(&r->cv);
        int64_t until = pd_wall_ns() + (int64_t)r->period_ms * PD_NS_PER_MS;
        struct timespec ts = {.tv_sec = until / PD_NS_PER_S, .tv_nsec = until % PD_NS_PER_S};
        while (!r->stop && pthread_cond_timedwait(&r->cv, &r->mu, &ts) != ETIMEDOUT) {
        }
        bool stop = r->stop;
        pthread_mutex_unlock(&r->mu);
        if (stop) return NULL;
    }
}

void pd_reg_set_max_model_len(pd_reg *r, int64_t max_model_len)
{
    r->max_model_len = max_model_len > 0 ? max_model_len : 0;
}

int pd_reg_start(pd_reg *r, int period_ms, int timeout_ms, pd_reg_change_fn on_change, void *arg)
{
    r->period_ms = period_ms > 0 ? period_ms : 1000;
    r->timeout_ms = timeout_ms > 0 ? timeout_ms : 1000;
    r->on_change = on_change;
    r->on_change_arg = arg;
    if (pthread_create(&r->thread, NULL, heartbeat_main, r) != 0)
        return pd_error(PD_EINTERNAL, "registry: cannot start the heartbeat thread");
    r->running = true;
    return PD_OK;
}

void pd_reg_close(pd_reg *r)
{
    if (r->running) {
        pthread_mutex_lock(&r->mu);
        r->stop = true;
        pthread_cond_broadcast(&r->cv);
        pthread_mutex_unlock(&r->mu);
        pthread_join(r->thread, NULL);
        r->running = false;
    }
    pthread_rwlock_wrlock(&r->ch_lock);
    r->closed = true;
    for (int i = 0; r->nodes && i < r->n; i++) {
        if (r->nodes[i].ch) pd_rpc_channel_free(r->nodes[i].ch);
        r->nodes[i].ch = NULL;
    }
    pthread_rwlock_unlock(&r->ch_lock);
}

void pd_reg_free(pd_reg *r)
{
    if (!r) return;
    pd_reg_close(r);
    for (int i = 0; r->nodes && i < r->n; i++) free(r->nodes[i].pfx);
    free(r->nodes);
    free(r->cand);
    free(r->tried);
    for (int role = 0; role < RT_ROLE_COUNT; role++)
        if (r->bal[role]) r->bal[role]->ops->free(r->bal[role]);
    rt_global_free(r->g);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    pthread_rwlock_destroy(&r->ch_lock);
    free(r);
}

int pd_reg_unary(pd_reg *r, int k, const char *method, const void *req, size_t len, int timeout_ms,
                 pd_rpc_done_fn done, void *arg, uint64_t *id)
{
    pthread_rwlock_rdlock(&r->ch_lock);
    if (r->closed || k < 0 || k >= r->n) {
        pthread_rwlock_unlock(&r->ch_lock);
        if (id) *id = 0;
        done(arg, PD_RPC_CANCELLED, "the scheduler is shutting down", NULL, 0);
        return pd_error(PD_ECLOSED, "registry closed");
    }
    int rc = pd_rpc_unary_async(r->nodes[k].ch, method, req, len, timeout_ms, done, arg, id);
    pthread_rwlock_unlock(&r->ch_lock);
    return rc;
}

int pd_reg_stream(pd_reg *r, int k, const char *method, const void *req, size_t len, int timeout_ms,
                  pd_rpc_msg_fn on_msg, pd_rpc_done_fn done, void *arg, uint64_t *id)
{
    pthread_rwlock_rdlock(&r->ch_lock);
    if (r->closed || k < 0 || k >= r->n) {
        pthread_rwlock_unlock(&r->ch_lock);
        if (id) *id = 0;
        done(arg, PD_RPC_CANCELLED, "the scheduler is shutting down", NULL, 0);
        return pd_error(PD_ECLOSED, "registry closed");
    }
    int rc =
        pd_rpc_stream_async(r->nodes[k].ch, method, req, len, timeout_ms, on_msg, done, arg, id);
    pthread_rwlock_unlock(&r->ch_lock);
    return rc;
}

const rt_global *pd_reg_global(const pd_reg *r)
{
    return r->g;
}

int pd_reg_count(const pd_reg *r)
{
    return r->n;
}

rt_role pd_reg_role(const pd_reg *r, int k)
{
    return r->nodes[k].inst->role;
}

const char *pd_reg_name(const pd_reg *r, int k)
{
    return r->nodes[k].name;
}

bool pd_reg_is_up(pd_reg *r, int k)
{
    pthread_mutex_lock(&r->mu);
    bool up = r->nodes[k].up;
    pthread_mutex_unlock(&r->mu);
    return up;
}

void pd_reg_report_failure(pd_reg *r, int k, const char *why)
{
    if (k < 0 || k >= r->n) return;
    char reason[300];
    snprintf(reason, sizeof reason, "%s", why && *why ? why : "a call failed");
    set_state(r, k, false, reason);
}

int pd_reg_up_count(pd_reg *r, rt_role role)
{
    int n = 0;
    pthread_mutex_lock(&r->mu);
    for (int k = 0; k < r->n; k++) n += r->nodes[k].inst->role == role && r->nodes[k].up;
    pthread_mutex_unlock(&r->mu);
    return n;
}

bool pd_reg_wait_round(pd_reg *r, int timeout_ms)
{
    int64_t until = pd_wall_ns() + (int64_t)timeout_ms * PD_NS_PER_MS;
    struct timespec ts = {.tv_sec = until / PD_NS_PER_S, .tv_nsec = until % PD_NS_PER_S};
    pthread_mutex_lock(&r->mu);
    while (r->rounds == 0 && !r->stop)
        if (pthread_cond_timedwait(&r->cv, &r->mu, &ts) == ETIMEDOUT) break;
    bool ok = r->rounds > 0;
    pthread_mutex_unlock(&r->mu);
    return ok;
}

/* pd_reg_pick_cached without a prompt: nothing counts as cached, nothing is recorded. */
int pd_reg_pick(pd_reg *r, rt_role role, int64_t tokens, int exclude)
{
    return pd_reg_pick_cached(r, role, NULL, 0, tokens, exclude, NULL);
}

/* The keys of the full blocks of ids (at most PFX_MAX_BLOCKS) for role's instances, whose block
 * size (*bs_out, may be NULL) is the first one's (from its Info; 16 until it is read): block b's
 * key chains every token up to its end (a prefix, as the instance's cache keys it; never 0, the
 * empty slot). */
static size_t block_keys(pd_reg *r, rt_role role, const int32_t *ids, size_t n_ids,
                         uint64_t keys[PFX_MAX_BLOCKS], int *bs_out)
{
    pthread_mutex_lock(&r->mu);
    int bs = r->count[role] ? r->nodes[r->first[role]].block_size : 0;
    pthread_mutex_unlock(&r->mu);
    if (bs <= 0) bs = 16;
    if (bs_out) *bs_out = bs;
    size_t nb = n_ids / (size_t)bs;
    if (nb > PFX_MAX_BLOCKS) nb = PFX_MAX_BLOCKS;
    uint64_t h = 0x9e3779b97f4a7c15ull;
    for (size_t b = 0; b < nb; b++) {
        for (int t = 0; t < bs; t++) h = pd_mix64(h ^ (uint32_t)ids[b * (size_t)bs + (size_t)t]);
        keys[b] = h | 1;
    }
    return nb;
}

/* Adds the time since the last change of nd's in-flight tokens to its busy time when it had
 * any; call before each change (under r->mu). */
static void busy_tick(reg_node *nd)
{
    int64_t now = pd_now_ns();
    if (nd->inflight_tokens > 0) nd->busy_ns += now - nd->busy_mark_ns;
    nd->busy_mark_ns = now;
}

/* Whether nd, picked for a prompt that brings it tokens of work, takes it now (room's rule,
 * pd_reg_pick_room; under r->mu). */
static bool has_room(const reg_node *nd, int64_t tokens, const pd_reg_room *room)
{
    int64_t backlog = nd->load_tokens + nd->inflight_tokens + tokens;
    if (!room || backlog <= tokens) return true;
    if (nd->busy_ns < RATE_MIN_NS || nd->done_tokens <= 0) return backlog <= room->unmeasured_max;
    double rate = nd->done_tokens / ((double)nd->busy_ns / 1e9);
    return (double)backlog / rate <= room->horizon_s;
}

static int pick(pd_reg *r, rt_role role, const int32_t *ids, size_t n_ids, int64_t tokens,
                int exclude, const pd_reg_room *room, int64_t *hit_tokens)
{
    uint64_t keys[PFX_MAX_BLOCKS];
    int first = r->first[role], n_role = r->count[role];
    int bs;
    size_t nb = block_keys(r, role, ids, n_ids, keys, &bs);
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < n_role; i++) {
        const reg_node *nd = &r->nodes[first + i];
        size_t hit = 0;
        while (nd->up && hit < nb && nd->pfx[keys[hit] & (PFX_SLOTS - 1)] == keys[hit]) hit++;
        /* its load (prefill: the work ahead of the prompt's first token; decode: the KV its
           sequences take), and what its cache likely holds of the prompt */
        r->cand[i] = (pd_balancer_target){.up = nd->up,
                                          .load = nd->load_tokens + nd->inflight_tokens,
                                          .cached = (int64_t)hit * bs};
        r->tried[i] = first + i == exclude;
    }
    pd_balancer *b = r->bal[role];
    int i = b->ops->select(b, r->cand, (size_t)n_role, r->tried);
    int best = i < 0 ? -1 : first + i;
    int64_t best_hit = i < 0 ? 0 : r->cand[i].cached;
    if (best >= 0 && !has_room(&r->nodes[best], tokens - best_hit, room)) {
        best = PD_REG_BUSY;
        best_hit = 0;
    }
    if (best >= 0) {
        reg_node *nd = &r->nodes[best];
        busy_tick(nd);
        nd->inflight_tokens += tokens - best_hit;
        for (size_t k = 0; k < nb; k++) nd->pfx[keys[k] & (PFX_SLOTS - 1)] = keys[k];
    }
    pthread_mutex_unlock(&r->mu);
    if (hit_tokens) *hit_tokens = best_hit;
    return best;
}

int pd_reg_pick_cached(pd_reg *r, rt_role role, const int32_t *ids, size_t n_ids, int64_t tokens,
                       int exclude, int64_t *hit_tokens)
{
    return pick(r, role, ids, n_ids, tokens, exclude, NULL, hit_tokens);
}

int pd_reg_pick_room(pd_reg *r, rt_role role, const int32_t *ids, size_t n_ids, int64_t tokens,
                     const pd_reg_room *room, int64_t *hit_tokens)
{
    return pick(r, role, ids, n_ids, tokens, -1, room, hit_tokens);
}

void pd_reg_note_cached(pd_reg *r, int k, const int32_t *ids, size_t n_ids)
{
    if (k < 0 || k >= r->n) return;
    uint64_t keys[PFX_MAX_BLOCKS];
    size_t nb = block_keys(r, r->nodes[k].inst->role, ids, n_ids, keys, NULL);
    pthread_mutex_lock(&r->mu);
    reg_node *nd = &r->nodes[k];
    for (size_t b = 0; nd->pfx && b < nb; b++) nd->pfx[keys[b] & (PFX_SLOTS - 1)] = keys[b];
    pthread_mutex_unlock(&r->mu);
}

void pd_reg_release(pd_reg *r, int k, int64_t tokens)
{
    if (k < 0 || k >= r->n) return;
    pthread_mutex_lock(&r->mu);
    busy_tick(&r->nodes[k]);
    r->nodes[k].inflight_tokens -= tokens;
    if (r->nodes[k].inflight_tokens < 0) r->nodes[k].inflight_tokens = 0;
    pthread_mutex_unlock(&r->mu);
}

void pd_reg_prefill_done(pd_reg *r, int k, int64_t tokens)
{
    if (k < 0 || k >= r->n) return;
    pthread_mutex_lock(&r->mu);
    reg_node *nd = &r->nodes[k];
    busy_tick(nd);
    nd->done_tokens += (double)tokens;
    if (nd->busy_ns > RATE_WINDOW_NS) {
        nd->busy_ns /= 2;
        nd->done_tokens /= 2;
    }
    pthread_mutex_unlock(&r->mu);
}

int pd_reg_decode_targets(pd_reg *r, int k, pd_arena *a, Pd__DecodeTarget ***out, size_t *n)
{
    pthread_mutex_lock(&r->mu);
    reg_node *nd = &r->nodes[k];
    if (!nd->verified || nd->n_ranks == 0) {
        pthread_mutex_unlock(&r->mu);
        return pd_error(PD_ENOTFOUND, "decode instance %s is not verified", nd->name);
    }
    Pd__DecodeTarget *t = pd_arena_calloc(a, nd->n_ranks, sizeof *t);
    Pd__DecodeTarget **p = pd_arena_calloc(a, nd->n_ranks, sizeof *p);
    if (!t || !p) {
        pthread_mutex_unlock(&r->mu);
        return pd_error(PD_ENOMEM, "registry: out of memory");
    }
    for (size_t i = 0; i < nd->n_ranks; i++) {
        t[i] = nd->targets[i];
        t[i].host = pd_arena_strdup(a, nd->target_hosts[i]);
        p[i] = &t[i];
    }
    *out = p;
    *n = nd->n_ranks;
    pthread_mutex_unlock(&r->mu);
    return PD_OK;
}

void pd_reg_transport(pd_reg *r, int k, char *buf, size_t n)
{
    pthread_mutex_lock(&r->mu);
    snprintf(buf, n, "%s", r->nodes[k].transport);
    pthread_mutex_unlock(&r->mu);
}

int pd_reg_max_num_seqs(pd_reg *r)
{
    int m = 0;
    pthread_mutex_lock(&r->mu);
    for (int k = 0; k < r->n; k++) {
        reg_node *nd = &r->nodes[k];
        if (nd->inst->role != RT_ROLE_DECODE || !nd->verified || nd->max_num_seqs <= 0) continue;
        if (m == 0 || nd->max_num_seqs < m) m = nd->max_num_seqs;
    }
    pthread_mutex_unlock(&r->mu);
    return m;
}

double pd_reg_kv_usage(pd_reg *r)
{
    int64_t total = 0, used = 0;
    pthread_mutex_lock(&r->mu);
    for (int k = 0; k < r->n; k++) {
        reg_node *nd = &r->nodes[k];
        if (nd->inst->role != RT_ROLE_DECODE) continue;
        total += nd->kv_total;
        used += nd->kv_total - nd->kv_free;
    }
    pthread_mutex_unlock(&r->mu);
    return total > 0 ? (double)used / (double)total : 0.0;
}

int64_t pd_reg_preemptions(pd_reg *r)
{
    int64_t s = 0;
    pthread_mutex_lock(&r->mu);
    for (int k = 0; k < r->n; k++)
        if (r->nodes[k].inst->role == RT_ROLE_DECODE) s += r->nodes[k].preemptions;
    pthread_mutex_unlock(&r->mu);
    return s;
}

int pd_reg_cache_block(pd_reg *r, rt_role role)
{
    pthread_mutex_lock(&r->mu);
    int bs = 0;
    for (int k = r->first[role]; k < r->first[role] + r->count[role] && !bs; k++)
        if (r->nodes[k].up && r->nodes[k].caches) bs = r->nodes[k].block_size;
    pthread_mutex_unlock(&r->mu);
    return bs;
}

void pd_reg_prefix_cache(pd_reg *r, int64_t *queries, int64_t *hits)
{
    *queries = *hits = 0;
    pthread_mutex_lock(&r->mu);
    for (int k = 0; k < r->n; k++) {
        *queries += r->nodes[k].cache_queries;
        *hits += r->nodes[k].cache_hits;
    }
    pthread_mutex_unlock(&r->mu);
}

void pd_reg_spec_totals(pd_reg *r, pd_reg_spec *out)
{
    *out = (pd_reg_spec){0};
    pthread_mutex_lock(&r->mu);
    for (int k = 0; k < r->n; k++) {
        const pd_reg_spec *s = &r->nodes[k].spec;
        out->drafts += s->drafts;
        out->draft_tokens += s->draft_tokens;
        out->accepted += s->accepted;
        for (size_t i = 0; i < PD_ENGINE_SPEC_MAX_TOKENS; i++) out->per_pos[i] += s->per_pos[i];
    }
    pthread_mutex_unlock(&r->mu);
}

void pd_reg_queues(pd_reg *r, int64_t *running, int64_t *waiting)
{
    *running = *waiting = 0;
    pthread_mutex_lock(&r->mu);
    int64_t fresh = pd_now_ns() - 3 * (int64_t)r->period_ms * PD_NS_PER_MS;
    for (int k = 0; k < r->n; k++) {
        const reg_node *nd = &r->nodes[k];
        if (nd->stats_ns == 0 || nd->stats_ns < fresh) continue;
        *running += nd->running;
        /* a prefill instance's held sequences: computed KV on its way to the decode side */
        *waiting += nd->waiting + (nd->inst->role == RT_ROLE_PREFILL ? nd->held : 0);
    }
    pthread_mutex_unlock(&r->mu);
}

void pd_reg_step_tokens(pd_reg *r, int64_t bins[PD_ENGINE_STEP_BINS], int64_t *sum)
{
    pthread_mutex_lock(&r->mu);
    memcpy(bins, r->steps, sizeof r->steps);
    *sum = r->steps_sum;
    pthread_mutex_unlock(&r->mu);
}

int pd_reg_stage_seconds(pd_reg *r, int k, double out[PD_ENGINE_MAX_PP])
{
    pthread_mutex_lock(&r->mu);
    const reg_node *nd = &r->nodes[k];
    int n = nd->n_stages;
    for (int i = 0; i < n; i++) out[i] = nd->stage_s[i];
    pthread_mutex_unlock(&r->mu);
    return n;
}

bool pd_reg_cache_config(pd_reg *r, int k, pd_reg_cache_info *out)
{
    pthread_mutex_lock(&r->mu);
    const reg_node *nd = &r->nodes[k];
    bool known = nd->epoch != 0; /* its Info was read */
    if (known) {
        out->block_size = nd->block_size;
        pd_str_copy(out->kv_dtype, sizeof out->kv_dtype, nd->kv_dtype);
        out->prefix_caching = nd->caches;
        out->num_blocks = nd->kv_total;
    }
    pthread_mutex_unlock(&r->mu);
    return known;
}
