/* Command line of pd-prefill / pd-decode: the flags of the one table (util/flags.h) that the
 * instances use, bound to pd_node_params. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "node/node.h"
#include "util/flags.h"
#include "util/log.h"
#include "util/signals.h"
#include "util/status.h"

/* --enforce-eager: vLLM's "no CUDA graphs". The CUDA backend reads PD_CUDA_GRAPHS when it is
 * created, after parsing (process-wide, like --log-level). */
static int apply_enforce_eager(void *params, const char *flag, const char *value)
{
    (void)params, (void)value;
    if (setenv("PD_CUDA_GRAPHS", "0", 1) != 0)
        return pd_error(PD_ENOMEM, "%s: setenv: %s", flag, strerror(errno));
    PD_INFO(NULL, "%s: CUDA graphs off (PD_CUDA_GRAPHS=0)", flag);
    return PD_OK;
}

/* --gpu-memory-utilization: the CUDA backend's KV sizing; noted as given, so that the CPU
 * backend says it has no effect there (its pool is --kv-cache-bytes). */
static int apply_gpu_memory_utilization(void *params, const char *flag, const char *value)
{
    pd_node_params *p = params;
    (void)flag;
    p->engine.gpu_memory_utilization = strtod(value, NULL); /* checked by the table */
    p->gpu_memory_utilization_set = true;
    return PD_OK;
}

static int apply_log_level(void *params, const char *flag, const char *value)
{
    (void)params;
    pd_log_level lv;
    if (pd_log_parse_level(value, &lv) < 0) return pd_error_prefix(PD_EINVAL, "%s", flag);
    pd_log_set_level(lv);
    return PD_OK;
}

#define B(flag, type, field) PD_BIND(pd_node_params, flag, type, field)
static const pd_flag_bind BINDS[] = {
    B("--model", PD_BIND_STR, engine.model_dir),
    {.name = "--tokenizer",
     .type = PD_BIND_STR,
     .off = offsetof(pd_node_params, engine.tokenizer_dir),
     .dflt = "--model"},
    {.name = "--served-model-name",
     .type = PD_BIND_STR,
     .off = offsetof(pd_node_params, served_model_name),
     .help = "the first is reported to the scheduler",
     .dflt = "--model"},
    {.name = "--host",
     .type = PD_BIND_STR,
     .off = offsetof(pd_node_params, host),
     .help = "gRPC bind address",
     .dflt = "the instance's server_ip"},
    {.name = "--port",
     .type = PD_BIND_INT,
     .off = offsetof(pd_node_params, port),
     .help = "gRPC port (required; NODE_PORTS lists it)",
     .dflt = ""},
    {.name = "--tensor-parallel-size",
     .type = PD_BIND_INT,
     .off = offsetof(pd_node_params, tensor_parallel_size),
     .dflt = "the device count / --pipeline-parallel-size"},
    {.name = "--pipeline-parallel-size",
     .type = PD_BIND_INT,
     .off = offsetof(pd_node_params, pipeline_parallel_size),
     .dflt = "1"},
    {.name = "--max-model-len",
     .type = PD_BIND_SIZE,
     .off = offsetof(pd_node_params, engine.max_model_len),
     .dflt = "the model's"},
    B("--max-num-seqs", PD_BIND_SIZE, engine.max_num_seqs),
    {.name = "--max-num-batched-tokens",
     .type = PD_BIND_SIZE,
     .off = offsetof(pd_node_params, engine.max_num_batched_tokens),
     .dflt = "max(max-model-len, 2048); 512 with --enable-chunked-prefill"},
    B("--enable-chunked-prefill", PD_BIND_BOOL, engine.enable_chunked_prefill),
    B("--block-size", PD_BIND_SIZE, engine.block_size),
    {.name = "--kv-cache-bytes",
     .type = PD_BIND_SIZE,
     .off = offsetof(pd_node_params, engine.kv_cache_bytes),
     .help = "KV budget per rank (CPU backend; on CUDA instead of --gpu-memory-utilization)",
     .dflt = "VLLM_CPU_KVCACHE_SPACE"},
    B("--enable-prefix-caching", PD_BIND_BOOL, engine.enable_prefix_caching),
    {.name = "--seed",
     .type = PD_BIND_I64,
     .off = offsetof(pd_node_params, engine.seed),
     .dflt = "random"},
    {.name = "--cpu-threads",
     .type = PD_BIND_INT,
     .off = offsetof(pd_node_params, engine.n_threads),
     .dflt = "all cores"},
    B("--device", PD_BIND_STR, device),
    B("--dtype", PD_BIND_STR, dtype),
    {.name = "--quantization",
     .type = PD_BIND_STR,
     .off = offsetof(pd_node_params, engine.quantization),
     .dflt = "the checkpoint's quantization_config"},
    {.name = "--kv-cache-dtype",
     .type = PD_BIND_STR,
     .off = offsetof(pd_node_params, engine.kv_cache_dtype),
     .dflt = "auto"},
    {.name = "--gpu-memory-utilization",
     .type = PD_BIND_FUNC,
     .fn = apply_gpu_memory_utilization,
     .dflt = "0.9"},
    B("--kv-transport", PD_BIND_STR, kv_transport),
    {.name = "--speculative-model",
     .type = PD_BIND_STR,
     .off = offsetof(pd_node_params, spec.model),
     .dflt = "none"},
    {.name = "--num-speculative-tokens",
     .type = PD_BIND_I64,
     .off = offsetof(pd_node_params, spec.num_tokens),
     .dflt = "none"},
    {.name = "--ngram-prompt-lookup-max",
     .type = PD_BIND_I64,
     .off = offsetof(pd_node_params, spec.ngram_max),
     .dflt = "none"},
    {.name = "--ngram-prompt-lookup-min",
     .type = PD_BIND_I64,
     .off = offsetof(pd_node_params, spec.ngram_min),
     .dflt = "1"},
    {.name = "--speculative-config",
     .type = PD_BIND_STR,
     .off = offsetof(pd_node_params, spec.config_json),
     .dflt = "none"},
    {.name = "--speculative-disable-by-batch-size",
     .type = PD_BIND_I64,
     .off = offsetof(pd_node_params, spec.disable_batch),
     .dflt = "none"},
    B("--kv-lease-seconds", PD_BIND_INT, kv_lease_s),
    {.name = "--shutdown-timeout",
     .type = PD_BIND_INT,
     .off = offsetof(pd_node_params, shutdown_timeout_s),
     .help = "drain time after SIGTERM before aborting (rounded up to whole seconds)"},
    {.name = "--enforce-eager", .type = PD_BIND_FUNC, .fn = apply_enforce_eager, .dflt = ""},
    {.name = "--log-level", .type = PD_BIND_FUNC, .fn = apply_log_level, .dflt = "info"},
    B("GLOBAL_RANK_TABLE_FILE_PATH", PD_BIND_STR, global_ranktable),
    B("RANK_TABLE_FILE_PATH", PD_BIND_STR, local_ranktable),
    B("VLLM_CPU_KVCACHE_SPACE", PD_BIND_F64, engine.cpu_kvcache_space_gib),
    B("VLLM_CPU_OMP_THREADS_BIND", PD_BIND_STR, engine.cpu_threads_bind),
    B("PD_CPU_BUDGET", PD_BIND_STR, engine.cpu_budget),
};
#undef B

static unsigned role_bit(rt_role role)
{
    return role == RT_ROLE_DECODE ? PD_ROLE_DECODE : PD_ROLE_PREFILL;
}

void pd_node_usage(const char *prog, rt_role role)
{
    char synopsis[256], intro[320];
    snprintf(synopsis, sizeof synopsis, "%s --model DIR --port PORT [options]", prog);
    snprintf(intro, sizeof intro,
             "Serves the %s role of a pdserve cluster. The instance is found by matching the\n"
             "local ranktable (RANK_TABLE_FILE_PATH) inside the global one\n"
             "(GLOBAL_RANK_TABLE_FILE_PATH).\n",
             rt_role_name(role));
    pd_node_params d = pd_node_default_params();
    pd_flags_usage(stderr, role_bit(role), synopsis, intro, BINDS, sizeof BINDS / sizeof *BINDS,
                   &d);
}

int pd_node_parse_args(int argc, char **argv, rt_role role, pd_node_params *p)
{
    *p = pd_node_default_params();
    p->role = role;
    bool help;
    PD_CHECK(
        pd_flags_parse(role_bit(role), BINDS, sizeof BINDS / sizeof *BINDS, argc, argv, p, &help));
    if (help) {
        pd_node_usage(argv[0], role);
        return 1;
    }
    return pd_spec_configure(&p->spec, &p->engine);
}

int pd_node_main(int argc, char **argv, rt_role role)
{
    pd_log_init(rt_role_name(role));
    pd_flags_early_log_level(argc, argv);
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
    pd_node_free(n);
    PD_INFO(NULL, "stopped");
    return 0;
}
