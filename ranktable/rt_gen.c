/* `pd-ranktable --mode gen` as a library call: command-line lists -> the host's tables.
 *
 * Everything the CLI does besides argument splitting lives here so tests drive it
 * directly. The host address is --server-ip or the first non-loopback IPv4 of an interface
 * that is up (the Ascend tool resolved the host name instead, which gives 127.0.1.1 on
 * many Debian hosts: useless to peers). --device-ip-list is indexed by device id, like
 * hccn_tool -i <device_id>: entry k is the KV data-plane address of CUDA device k.
 */
#include "ranktable/ranktable.h"
#include "ranktable/rt_internal.h"

#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include "util/status.h"

rt_gen_params rt_gen_default_params(void)
{
    rt_gen_params p;
    memset(&p, 0, sizeof p);
    return p;
}

int rt_parse_device_list(const char *s, const char *what, int *ordinals, size_t cap, size_t *n)
{
    *n = 0;
    if (!s || !*s)
        return pd_error(PD_EINVAL, "%s: empty device list (expected e.g. \"4,5\")", what);
    const char *p = s;
    for (size_t idx = 0;; idx++) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        char item[16];
        if (len == 0)
            return pd_error(PD_EINVAL, "%s: \"%s\": empty entry %zu (expected e.g. \"4,5\")", what,
                            s, idx);
        if (len >= sizeof item)
            return pd_error(PD_EINVAL, "%s: \"%s\": entry %zu is not a device id", what, s, idx);
        memcpy(item, p, len);
        item[len] = '\0';
        long v;
        int rc = rt_parse_decimal(item, RT_MAX_DEVICES - 1, &v);
        if (rc == PD_ERANGE)
            return pd_error(PD_EINVAL, "%s: \"%s\": device %s is out of range 0..%d", what, s, item,
                            RT_MAX_DEVICES - 1);
        if (rc < 0)
            return pd_error(PD_EINVAL, "%s: \"%s\": \"%s\" is not a device id (a number like 4)",
                            what, s, item);
        if (*n == cap)
            return pd_error(PD_EINVAL, "%s: \"%s\": more than %zu devices", what, s, cap);
        for (size_t k = 0; k < *n; k++)
            if (ordinals[k] == (int)v)
                return pd_error(PD_EINVAL, "%s: \"%s\": device %ld listed twice", what, s, v);
        ordinals[(*n)++] = (int)v;
        if (!end) return PD_OK;
        p = end + 1;
    }
}

int rt_host_ipv4(char *buf, size_t n)
{
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs) != 0)
        return pd_error(PD_EIO, "cannot list network interfaces: %s (pass --server-ip)",
                        strerror(errno));
    int rc =
        pd_error(PD_ENOTFOUND, "no non-loopback IPv4 address on this host: pass --server-ip IP");
    for (struct ifaddrs *i = ifs; i; i = i->ifa_next) {
        if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
        if (!(i->ifa_flags & IFF_UP) || (i->ifa_flags & IFF_LOOPBACK)) continue;
        const struct sockaddr_in *sin = (const struct sockaddr_in *)(const void *)i->ifa_addr;
        if ((ntohl(sin->sin_addr.s_addr) >> 24) == 127) continue;
        if (!inet_ntop(AF_INET, &sin->sin_addr, buf, (socklen_t)n)) {
            rc = pd_error(PD_ERANGE, "host address does not fit the buffer");
            break;
        }
        rc = PD_OK;
        pd_error_clear();
        break;
    }
    freeifaddrs(ifs);
    return rc;
}

/* Splits "a,b,c" into a NULL-free array of n strings (one malloc: pointers then text). */
static int split_ips(const char *s, char ***out, size_t *n)
{
    *out = NULL;
    *n = 0;
    size_t count = 1, len = strlen(s);
    for (const char *q = s; *q; q++) count += *q == ',';
    char **v = malloc(count * sizeof(char *) + len + 1);
    if (!v) return pd_error(PD_ENOMEM, "--device-ip-list: out of memory");
    char *text = (char *)(v + count);
    memcpy(text, s, len + 1);
    for (size_t k = 0; k < count; k++) {
        v[k] = text;
        char *comma = strchr(text, ',');
        if (comma) *comma = '\0';
        const char *why;
        if (rt_check_token(v[k], strlen(v[k]), &why) < 0) {
            free(v);
            return pd_error(PD_EINVAL, "--device-ip-list: entry %zu (device %zu) %s", k, k, why);
        }
        text = comma ? comma + 1 : text + strlen(text);
    }
    *out = v;
    *n = count;
    return PD_OK;
}

static int add_list(rt_global *g, rt_role role, const char *opt, const char *const *lists, size_t n,
                    const char *ip, char **ips, size_t n_ips)
{
    int ords[RT_MAX_DEVICES];
    const char *dev_ips[RT_MAX_DEVICES];
    for (size_t i = 0; i < n; i++) {
        char what[64];
        snprintf(what, sizeof what, "%s[%zu]", opt, i);
        size_t nd;
        PD_CHECK(rt_parse_device_list(lists[i], what, ords, RT_MAX_DEVICES, &nd));
        for (size_t k = 0; k < nd; k++) {
            dev_ips[k] = NULL;
            if (!ips) continue;
            if ((size_t)ords[k] >= n_ips)
                return pd_error(PD_EINVAL,
                                "%s: device %d has no address in --device-ip-list (%zu entries, "
                                "devices 0..%zu; entry k is the address of device k)",
                                what, ords[k], n_ips, n_ips - 1);
            dev_ips[k] = ips[ords[k]];
        }
        PD_CHECK(rt_global_add_instance(g, role, ip, ip, nd, ords, dev_ips, NULL));
    }
    return PD_OK;
}

int rt_gen(const rt_gen_params *p, rt_global **out)
{
    *out = NULL;
    if (!p->api_server && p->n_prefill == 0 && p->n_decode == 0)
        return pd_error(PD_EINVAL, "gen: nothing to generate: give --prefill-server-list, "
                                   "--decode-server-list and/or --api-server");
    char host[64];
    const char *ip = p->server_ip;
    if (!ip) {
        PD_CHECK(rt_host_ipv4(host, sizeof host));
        ip = host;
    } else {
        const char *why;
        if (rt_check_token(ip, strlen(ip), &why) < 0)
            return pd_error(PD_EINVAL, "--server-ip \"%s\": %s", ip, why);
    }
    char **ips = NULL;
    size_t n_ips = 0;
    if (p->device_ip_list) PD_CHECK(split_ips(p->device_ip_list, &ips, &n_ips));

    rt_global *g = rt_global_create();
    int rc = g ? PD_OK : pd_error(PD_ENOMEM, "gen: out of memory");
    if (rc == PD_OK && p->api_server) rc = rt_global_set_scheduler(g, ip, ip);
    if (rc == PD_OK)
        rc = add_list(g, RT_ROLE_PREFILL, "--prefill-server-list", p->prefill, p->n_prefill, ip,
                      ips, n_ips);
    if (rc == PD_OK)
        rc = add_list(g, RT_ROLE_DECODE, "--decode-server-list", p->decode, p->n_decode, ip, ips,
                      n_ips);
    free(ips);
    if (rc == PD_OK) {
        char name[512];
        rc = rt_global_file_name(name, sizeof name, ip);
        if (rc == PD_OK) {
            char *w = strdup(name);
            if (!w) {
                rc = pd_error(PD_ENOMEM, "gen: out of memory");
            } else {
                free(g->what);
                g->what = w;
            }
        }
    }
    /* The table of one host: a fragment unless it also has the scheduler and both roles. */
    if (rc == PD_OK) rc = rt_global_validate(g, NULL, RT_LOAD_FRAGMENT | p->flags, NULL);
    if (rc < 0) {
        rt_global_free(g);
        return rc;
    }
    *out = g;
    return PD_OK;
}

static int join(char *buf, size_t n, const char *dir, const char *name)
{
    int w = snprintf(buf, n, "%s/%s", dir, name);
    if (w < 0 || (size_t)w >= n) return pd_error(PD_ERANGE, "%s/%s: path too long", dir, name);
    return PD_OK;
}

int rt_write_tables(const rt_global *g, const char *ip, const char *save_dir,
                    void (*on_file)(const char *path, void *arg), void *arg)
{
    if (mkdir(save_dir, 0755) != 0 && errno != EEXIST)
        return pd_error(PD_EIO, "--save-dir %s: %s", save_dir, strerror(errno));
    char name[1024], path[4096];
    PD_CHECK(rt_global_file_name(name, sizeof name, ip));
    PD_CHECK(join(path, sizeof path, save_dir, name));
    PD_CHECK(rt_global_save(g, path));
    if (on_file) on_file(path, arg);
    for (int r = RT_ROLE_PREFILL; r <= RT_ROLE_DECODE + 1; r++) {
        /* Instances first (prefill, decode), then the host table, as the Ascend tool does. */
        rt_role role = r <= RT_ROLE_DECODE ? (rt_role)r : RT_ROLE_SCHEDULER;
        for (size_t i = 0; i < rt_global_instance_count(g, role); i++) {
            rt_local *l = NULL;
            PD_CHECK(rt_local_from_global(g, role, i, &l));
            int rc = rt_local_file_name(name, sizeof name, ip, rt_global_instance(g, role, i));
            if (rc == PD_OK) rc = join(path, sizeof path, save_dir, name);
            if (rc == PD_OK) rc = rt_local_save(l, path);
            rt_local_free(l);
            PD_CHECK(rc);
            if (on_file) on_file(path, arg);
        }
    }
    return PD_OK;
}
