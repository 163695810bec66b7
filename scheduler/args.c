/* pd-scheduler command line and environment (api_contract.md §17, DESIGN.md launch contract).
 * Flags take vLLM's names; "--flag value" and "--flag=value" are both accepted. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "apiserver.h"
#include "util/args.h"
#include "util/status.h"

static const char USAGE[] =
    "usage: pd-scheduler --model DIR [options]\n"
    "  --model DIR                   model directory (tokenizer, chat template, config)\n"
    "  --served-model-name N [N...]  accepted model names; the first is used in responses\n"
    "  --host ADDR                   bind address (default 0.0.0.0)\n"
    "  --port N                      HTTP port (default 8000)\n"
    "  --api-key KEY                 require 'Authorization: Bearer KEY' (else VLLM_API_KEY)\n"
    "  --max-model-len N             context length L (default: config.json)\n"
    "  --max-concurrent-requests N   default 4096, 0 = no limit\n"
    "  --max-request-body-bytes N    default 16777216\n"
    "  --queue-timeout S             longest wait for decode KV capacity, then 503 (default 600)\n"
    "  --timeout-keep-alive S        close an idle keep-alive connection (default 5)\n"
    "  --header-timeout S            a request's headers must arrive within S (default 10)\n"
    "  --body-timeout S              a request's body must arrive within S (default 60)\n"
    "  --chat-template FILE|STRING   override the model's chat template\n"
    "  --trust-request-chat-template allow a request's own chat_template\n"
    "  --enable-prompt-tokens-details usage.prompt_tokens_details.cached_tokens: prompt\n"
    "                               tokens found in the prefix cache\n"
    "  --default-chat-template-kwargs JSON  extra template variables (an object)\n"
    "  --generation-config auto|vllm default auto\n"
    "  --response-role ROLE          default assistant\n"
    "  --max-logprobs N              default 20\n"
    "  --log-level LEVEL             debug, info, warn, error\n"
    "  --heartbeat-ms N              instance heartbeat period and deadline (default 1000)\n"
    "  --shutdown-timeout S          drain time after SIGTERM before aborting (default 30)\n"
    "flags of pd-prefill/pd-decode (--tensor-parallel-size, --max-num-seqs, --device, ...) are\n"
    "accepted and not used, so one command line serves every role; vLLM's --swap-space N,\n"
    "--disable-log-requests, --disable-log-stats and --trust-remote-code are accepted and have\n"
    "no effect (logged)\n"
    "environment: GLOBAL_RANK_TABLE_FILE_PATH (required), RANK_TABLE_FILE_PATH (the _host\n"
    "table, optional), NODE_PORTS (required: one port per prefill then decode instance),\n"
    "USE_OPENAI (default 1), VLLM_API_KEY, PD_LOG_LEVEL\n";

const char *pd_apiserver_usage(void)
{
    return USAGE;
}

/* Flags of pd-prefill / pd-decode that take a value. */
static bool is_instance_flag(const char *flag)
{
    static const char *const names[] = {
        "--tensor-parallel-size",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--block-size",
        "--kv-cache-bytes",
        "--seed",
        "--cpu-threads",
        "--dtype",
        "--quantization",
        "--gpu-memory-utilization",
        "--kv-transport",
        "--kv-lease-seconds",
        "--device",
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcmp(flag, names[i]) == 0) return true;
    return false;
}

/* A positive duration in seconds (fractions allowed). */
static int arg_seconds(const char *flag, const char *val, double *out)
{
    PD_CHECK(pd_arg_f64(flag, val, out));
    if (*out <= 0 || *out > 1e6)
        return pd_error(PD_EINVAL, "%s: expected seconds in (0, 1e6], got \"%s\"", flag, val);
    return PD_OK;
}

int pd_apiserver_parse_args(int argc, char **argv, pd_apiserver_params *p, bool *help)
{
    *help = false;
    const char *e;
    if ((e = getenv("GLOBAL_RANK_TABLE_FILE_PATH"))) p->global_ranktable = e;
    if ((e = getenv("RANK_TABLE_FILE_PATH"))) p->local_ranktable = e;
    if ((e = getenv("NODE_PORTS"))) p->node_ports = e;
    if ((e = getenv("VLLM_API_KEY")) && *e) p->api_key = e;
    if ((e = getenv("USE_OPENAI"))) {
        if (strcmp(e, "1") == 0)
            p->use_openai = true;
        else if (strcmp(e, "0") == 0)
            p->use_openai = false;
        else
            return pd_error(PD_EINVAL, "USE_OPENAI: '%s' must be 0 or 1", e);
    }
    bool names_given = false;
    for (int i = 1; i < argc; i++) {
        char flag[64];
        const char *arg = argv[i], *val = NULL;
        int noop;
        if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
            *help = true;
            return PD_OK;
        }
        if (strncmp(arg, "--", 2) != 0) return pd_error(PD_EINVAL, "unexpected argument '%s'", arg);
        const char *eq = strchr(arg, '=');
        size_t fl = eq ? (size_t)(eq - arg) : strlen(arg);
        if (fl >= sizeof flag) return pd_error(PD_EINVAL, "unknown flag '%s'", arg);
        memcpy(flag, arg, fl);
        flag[fl] = '\0';
        if (eq)
            val = eq + 1;
        else if (i + 1 < argc)
            val = argv[i + 1];
        bool consumed = !eq;
#define NEED()                                                                                     \
    do {                                                                                           \
        if (!val) return pd_error(PD_EINVAL, "%s needs a value", flag);                            \
        if (consumed) i++;                                                                         \
    } while (0)
        int64_t x;
        if (strcmp(flag, "--model") == 0) {
            NEED();
            p->model = val;
        } else if (strcmp(flag, "--served-model-name") == 0) {
            NEED();
            if (!names_given) p->n_served_names = 0;
            names_given = true;
            if (p->n_served_names >= PD_APISERVER_MAX_NAMES)
                return pd_error(PD_EINVAL, "--served-model-name: at most %d names",
                                PD_APISERVER_MAX_NAMES);
            p->served_names[p->n_served_names++] = val;
            /* further names up to the next flag */
            while (!eq && i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) {
                if (p->n_served_names >= PD_APISERVER_MAX_NAMES)
                    return pd_error(PD_EINVAL, "--served-model-name: at most %d names",
                                    PD_APISERVER_MAX_NAMES);
                p->served_names[p->n_served_names++] = argv[++i];
            }
        } else if (strcmp(flag, "--host") == 0) {
            NEED();
            p->host = val;
        } else if (strcmp(flag, "--port") == 0) {
            NEED();
            PD_CHECK(pd_arg_i64(flag, val, 0, INT64_MAX, &x));
            if (x > 65535) return pd_error(PD_EINVAL, "--port: %lld is not a port", (long long)x);
            p->port = (int)x;
        } else if (strcmp(flag, "--api-key") == 0) {
            NEED();
            p->api_key = val;
        } else if (strcmp(flag, "--max-model-len") == 0) {
            NEED();
            PD_CHECK(pd_arg_i64(flag, val, 1, INT64_MAX, &p->max_model_len));
        } else if (strcmp(flag, "--max-concurrent-requests") == 0) {
            NEED();
            PD_CHECK(pd_arg_i64(flag, val, 0, INT64_MAX, &p->max_concurrent_requests));
        } else if (strcmp(flag, "--max-request-body-bytes") == 0) {
            NEED();
            PD_CHECK(pd_arg_i64(flag, val, 1, INT64_MAX, &p->max_request_body_bytes));
        } else if (strcmp(flag, "--queue-timeout") == 0) {
            NEED();
            PD_CHECK(arg_seconds(flag, val, &p->queue_timeout_s));
        } else if (strcmp(flag, "--timeout-keep-alive") == 0) {
            NEED();
            PD_CHECK(arg_seconds(flag, val, &p->keep_alive_s));
        } else if (strcmp(flag, "--header-timeout") == 0) {
            NEED();
            PD_CHECK(arg_seconds(flag, val, &p->header_timeout_s));
        } else if (strcmp(flag, "--body-timeout") == 0) {
            NEED();
            PD_CHECK(arg_seconds(flag, val, &p->body_timeout_s));
        } else if (strcmp(flag, "--chat-template") == 0) {
            NEED();
            p->chat_template = val;
        } else if (strcmp(flag, "--trust-request-chat-template") == 0) {
            if (eq) return pd_error(PD_EINVAL, "%s takes no value", flag);
            p->trust_request_chat_template = true;
        } else if (strcmp(flag, "--enable-prompt-tokens-details") == 0) {
            if (eq) return pd_error(PD_EINVAL, "%s takes no value", flag);
            p->enable_prompt_tokens_details = true;
        } else if (strcmp(flag, "--default-chat-template-kwargs") == 0) {
            NEED();
            p->default_chat_template_kwargs = val;
        } else if (strcmp(flag, "--generation-config") == 0) {
            NEED();
            if (strcmp(val, "auto") == 0)
                p->generation_config_vllm = false;
            else if (strcmp(val, "vllm") == 0)
                p->generation_config_vllm = true;
            else
                return pd_error(PD_EINVAL, "--generation-config: '%s' must be auto or vllm", val);
        } else if (strcmp(flag, "--response-role") == 0) {
            NEED();
            p->response_role = val;
        } else if (strcmp(flag, "--max-logprobs") == 0) {
            NEED();
            PD_CHECK(pd_arg_i64(flag, val, 0, INT64_MAX, &x));
            p->max_logprobs = x > 1000000 ? 1000000 : (int)x;
        } else if (strcmp(flag, "--heartbeat-ms") == 0) {
            NEED();
            PD_CHECK(pd_arg_i64(flag, val, 10, 3600000, &x));
            p->heartbeat_ms = (int)x;
        } else if (strcmp(flag, "--log-level") == 0) {
            NEED();
            p->log_level = val;
        } else if (strcmp(flag, "--shutdown-timeout") == 0) {
            NEED();
            PD_CHECK(pd_arg_f64(flag, val, &p->shutdown_timeout_s));
            if (p->shutdown_timeout_s < 0 || p->shutdown_timeout_s > 86400)
                return pd_error(PD_EINVAL, "%s: expected seconds in [0, 86400], got \"%s\"", flag,
                                val);
        } else if ((noop = pd_arg_vllm_noop(flag)) > 0) {
            if (noop > 1)
                NEED();
            else if (eq)
                return pd_error(PD_EINVAL, "%s takes no value", flag);
            PD_CHECK(pd_arg_vllm_noop_take(flag, noop > 1 ? val : NULL));
        } else if (is_instance_flag(flag)) {
            /* One command line serves every role (start_servers.sh, as in the Ascend guide):
             * flags meant for the prefill/decode instances are accepted and not used here. */
            NEED();
        } else if (strcmp(flag, "--enable-prefix-caching") == 0 ||
                   strcmp(flag, "--no-enable-prefix-caching") == 0 ||
                   strcmp(flag, "--enforce-eager") == 0) {
            if (eq) return pd_error(PD_EINVAL, "%s takes no value", flag); /* an instance flag */
        } else {
            return pd_error(PD_EINVAL, "unknown flag '%s' (see --help)", flag);
        }
#undef NEED
    }
    return PD_OK;
}
