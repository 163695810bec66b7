/* Command line of pd-prefill / pd-decode: vLLM's flag names (as the Ascend guide's launch
 * commands use them) plus pdserve's own; --flag value and --flag=value both work. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "node/node.h"
#include "util/args.h"
#include "util/log.h"
#include "util/signals.h"
#include "util/status.h"

void pd_node_usage(const char *prog, rt_role role)
{
    fprintf(
        stderr,
        "usage: %s --model DIR --port PORT [options]\n"
        "Serves the %s role of a pdserve cluster. The instance is found by matching the\n"
        "local ranktable (RANK_TABLE_FILE_PATH) inside the global one\n"
        "(GLOBAL_RANK_TABLE_FILE_PATH).\n\n"
        "  --model DIR                    Hugging Face model directory (required)\n"
        "  --served-model-name N [N...]   the first is reported to the scheduler (default:\n"
        "                                 --model)\n"
        "  --port PORT                    gRPC port (required; NODE_PORTS lists it)\n"
        "  --host ADDR                    gRPC bind address (default: the instance's server_ip)\n"
        "  --tensor-parallel-size N       must equal the instance's device count (default: it)\n"
        "  --max-model-len N              context length (default: the model's)\n"
        "  --max-num-seqs N               sequences per step (256)\n"
        "  --max-num-batched-tokens N     tokens per step; >= max-model-len\n"
        "  --block-size N                 tokens per KV block (16)\n"
        "  --kv-cache-bytes N             KV budget per rank (default: 40%% of free memory)\n"
        "  --[no-]enable-prefix-caching   reuse the cached KV of a prompt's longest cached\n"
        "                                 prefix of full blocks (on)\n"
        "  --seed N                       base seed of requests without one (default: random)\n"
        "  --cpu-threads N                CPU threads (default: all cores)\n"
        "  --device cpu|cuda              backend of the engine (cpu); cuda: one GPU per rank\n"
        "  --dtype auto|float32|bfloat16|float16  CUDA compute dtype (auto: bfloat16); the CPU\n"
        "                                 backend computes in float32 (auto or float32)\n"
        "  --quantization none            weight quantization (none is supported)\n"
        "  --gpu-memory-utilization F     CUDA: share of GPU memory for weights + KV (0.9)\n"
        "  --kv-transport auto|tcp|cuda_ipc|nccl  KV data plane: cuda_ipc copies device to\n"
        "                                 device (prefill and decode on one host); nccl sends\n"
        "                                 device to device over NCCL (other GPUs or hosts);\n"
        "                                 both need --device cuda; tcp stages through host\n"
        "                                 memory; auto = on CUDA cuda_ipc, else nccl, else tcp\n"
        "                                 per decode rank (what it accepts), tcp on the CPU\n"
        "  --kv-lease-seconds S           prefill: KV held at most S s for the decode side (30)\n"
        "  --shutdown-timeout S           drain time after SIGTERM before aborting (30; rounded\n"
        "                                 up to whole seconds)\n"
        "  --enforce-eager                vLLM's: no CUDA graphs (sets PD_CUDA_GRAPHS=0)\n"
        "  --log-level L                  debug, info, warn, error (or PD_LOG_LEVEL)\n"
        "pd-scheduler's flags (--api-key, --chat-template, ...) are accepted and not used, so\n"
        "one command line serves every role. vLLM's --swap-space N, --disable-log-requests,\n"
        "--disable-log-stats and --trust-remote-code are accepted and have no effect (logged).\n",
        prog, rt_role_name(role));
}

/* Flags of pd-scheduler that take a value. */
static bool is_scheduler_flag(const char *flag)
{
    static const char *const names[] = {
        "--api-key",
        "--max-concurrent-requests",
        "--max-request-body-bytes",
        "--chat-template",
        "--default-chat-template-kwargs",
        "--generation-config",
        "--response-role",
        "--max-logprobs",
        "--queue-timeout",
        "--timeout-keep-alive",
        "--header-timeout",
        "--body-timeout",
        "--heartbeat-ms",
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcmp(flag, names[i]) == 0) return true;
    return false;
}

int pd_node_parse_args(int argc, char **argv, rt_role role, pd_node_params *p)
{
    *p = pd_node_default_params();
    p->role = role;
    p->global_ranktable = getenv("GLOBAL_RANK_TABLE_FILE_PATH");
    p->local_ranktable = getenv("RANK_TABLE_FILE_PATH");
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            pd_node_usage(argv[0], role);
            return 1;
        }
        if (strncmp(a, "--", 2) != 0) return pd_error(PD_EINVAL, "unexpected argument '%s'", a);
        char name[64];
        const char *eq = strchr(a, '=');
        size_t nl = eq ? (size_t)(eq - a) : strlen(a);
        if (nl >= sizeof name) return pd_error(PD_EINVAL, "unknown flag '%s'", a);
        memcpy(name, a, nl);
        name[nl] = '\0';
        /* The value is taken (NEED) only once the name is known, so an unknown flag is reported
         * as unknown rather than as missing its value. */
        const char *v = eq ? eq + 1 : i + 1 < argc ? argv[i + 1] : NULL;
#define NEED()                                                                                     \
    do {                                                                                           \
        if (!v) return pd_error(PD_EINVAL, "%s: missing value", name);                             \
        if (!eq) i++;                                                                              \
    } while (0)
#define NO_VALUE()                                                                                 \
    do {                                                                                           \
        if (eq) return pd_error(PD_EINVAL, "%s takes no value", name);                             \
    } while (0)
        int64_t x;
        int noop;
        if (strcmp(name, "--enable-prefix-caching") == 0 ||
            strcmp(name, "--no-enable-prefix-caching") == 0) {
            NO_VALUE();
            p->enable_prefix_caching = name[2] == 'e';
        } else if (strcmp(name, "--trust-request-chat-template") == 0 ||
                   strcmp(name, "--enable-prompt-tokens-details") == 0) {
            NO_VALUE(); /* scheduler flags */
        } else if (strcmp(name, "--enforce-eager") == 0) {
            /* vLLM's "no CUDA graphs": the CUDA backend reads PD_CUDA_GRAPHS when it is created,
             * after parsing (process-wide, like --log-level below) */
            NO_VALUE();
            if (setenv("PD_CUDA_GRAPHS", "0", 1) != 0)
                return pd_error(PD_ENOMEM, "--enforce-eager: setenv: %s", strerror(errno));
            PD_INFO(NULL, "--enforce-eager: CUDA graphs off (PD_CUDA_GRAPHS=0)");
        } else if ((noop = pd_arg_vllm_noop(name)) > 0) {
            if (noop > 1)
                NEED();
            else
                NO_VALUE();
            PD_CHECK(pd_arg_vllm_noop_take(name, noop > 1 ? v : NULL));
        } else if (strcmp(name, "--model") == 0) {
            NEED();
            p->model_dir = v;
        } else if (strcmp(name, "--served-model-name") == 0) {
            NEED();
            p->served_model_name = v;
            /* pd-scheduler's N [N...]: the node reports the first (the name of responses) */
            while (!eq && i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) i++;
        } else if (strcmp(name, "--host") == 0) {
            NEED();
            p->host = v;
        } else if (strcmp(name, "--port") == 0) {
            NEED();
            PD_CHECK(pd_arg_i64(name, v, 1, 65535, &x));
            p->port = (int)x;
        } else if (strcmp(name, "--tensor-parallel-size") == 0) {
            NEED();
            PD_CHECK(pd_arg_i64(name, v, 1, 1024, &x));
            p->tensor_parallel_size = (int)x;
        } else if (strcmp(name, "--max-model-len") == 0) {
            NEED();
            PD_CHECK(pd_arg_i64(name, v, 1, 1LL << 30, &x));
            p->max_model_len = (size_t)x;
        } else if (strcmp(name, "--max-num-seqs") == 0) {
            NEED();
            PD_CHECK(pd_arg_i64(name, v, 1, 1 << 20, &x));
            p->max_num_seqs = (size_t)x;
        } else if (strcmp(name, "--max-num-batched-tokens") == 0) {
            NEED();
            PD_CHECK(pd_arg_i64(name, v, 1, 1LL << 30, &x));
            p->max_num_batched_tokens = (size_t)x;
        } else if (strcmp(name, "--block-size") == 0) {
            NEED();
            PD_CHECK(pd_arg_i64(name, v, 1, 4096, &x));
            p->block_size = (size_t)x;
        } else if (strcmp(name, "--kv-cache-bytes") == 0) {
            NEED();
            PD_CHECK(pd_arg_i64(name, v, 1, 1LL << 50, &x));
            p->kv_cache_bytes = (size_t)x;
        } else if (strcmp(name, "--seed") == 0) {
            NEED();
            PD_CHECK(pd_arg_i64(name, v, -1, 1LL << 62, &x));
            p->seed = x;
        } else if (strcmp(name, "--cpu-threads") == 0) {
            NEED();
            PD_CHECK(pd_arg_i64(name, v, 0, 4096, &x));
            p->cpu_threads = (int)x;
        } else if (strcmp(name, "--shutdown-timeout") == 0) {
            NEED(); /* fractions, as pd-scheduler takes them, are rounded up to whole seconds */
            double s;
            PD_CHECK(pd_arg_f64(name, v, &s));
            if (s < 0 || s > 86400)
                return pd_error(PD_EINVAL, "%s: expected seconds in [0, 86400], got \"%s\"", name,
                                v);
            p->shutdown_timeout_s = (int)s + ((int)s < s);
        } else if (strcmp(name, "--kv-lease-seconds") == 0) {
            NEED();
            PD_CHECK(pd_arg_i64(name, v, 1, 86400, &x));
            p->kv_lease_s = (int)x;
        } else if (strcmp(name, "--kv-transport") == 0) {
            NEED();
            if (strcmp(v, "auto") && strcmp(v, "tcp") && strcmp(v, "nccl") && strcmp(v, "cuda_ipc"))
                return pd_error(PD_EINVAL,
                                "--kv-transport: expected auto, tcp, nccl or cuda_ipc, "
                                "got '%s'",
                                v);
            p->kv_transport = v;
        } else if (strcmp(name, "--device") == 0) {
            NEED();
            if (strcmp(v, "cpu") && strcmp(v, "cuda"))
                return pd_error(PD_EINVAL, "--device: expected cpu or cuda, got '%s'", v);
            p->device = v;
        } else if (strcmp(name, "--dtype") == 0) {
            NEED();
            if (strcmp(v, "auto") && strcmp(v, "float32") && strcmp(v, "bfloat16") &&
                strcmp(v, "float16"))
                return pd_error(
                    PD_EINVAL, "--dtype: expected auto, float32, bfloat16 or float16, got '%s'", v);
            p->dtype = v;
        } else if (strcmp(name, "--quantization") == 0) {
            NEED();
            if (strcmp(v, "none") != 0)
                return pd_error(PD_EINVAL, "--quantization %s: not supported (none)", v);
        } else if (strcmp(name, "--gpu-memory-utilization") == 0) {
            NEED();
            char *end = NULL;
            double f = strtod(v, &end);
            if (!end || *end || !(f > 0 && f <= 1))
                return pd_error(PD_EINVAL,
                                "--gpu-memory-utilization: expected a number in "
                                "(0, 1], got '%s'",
                                v);
            p->gpu_memory_utilization = f;
        } else if (strcmp(name, "--log-level") == 0) {
            NEED();
            pd_log_level lv;
            PD_CHECK(pd_log_parse_level(v, &lv));
            pd_log_set_level(lv);
        } else if (is_scheduler_flag(name)) {
            /* one command line serves every role (start_servers.sh): the scheduler's flags
             * are accepted and not used here */
            NEED();
        } else {
            return pd_error(PD_EINVAL, "unknown flag '%s' (see --help)", name);
        }
#undef NO_VALUE
#undef NEED
    }
    return PD_OK;
}

int pd_node_main(int argc, char **argv, rt_role role)
{
    pd_log_init(rt_role_name(role));
    pd_arg_early_log_level(argc, argv);
    pd_node_params p;
    int rc = pd_node_parse_args(argc, argv, role, &p);
    if (rc == 1) return 0;
    if (rc < 0) {
        fprintf(stderr, "%s: %s\n", argv[0], pd_last_error());
        return 2;
    }
    if (pd_signals_install() < 0) {
        fprintf(stderr, "%s: %s\n", argv[0], pd_last_error());
        return 1;
    }
    pd_node *n = NULL;
    if (pd_node_create(&p, &n) < 0) {
        PD_ERROR(NULL, "%s", pd_last_error());
        return 1;
    }
    pd_node_run(n);
    pd_node_destroy(n);
    PD_INFO(NULL, "stopped");
    return 0;
}
