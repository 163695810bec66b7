/* The flag table of pd-prefill, pd-decode and pd-scheduler, and the parser and --help printer
 * that read it (see flags.h). */
#include "util/flags.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "util/args.h"
#include "util/log.h"
#include "util/status.h"

typedef struct {
    const char *name; /* "--x"; NULL for an environment-only setting */
    pd_flag_kind kind;
    unsigned roles;      /* where it has an effect (0: nowhere, a vLLM flag accepted and logged) */
    const char *metavar; /* the value in --help */
    double lo, hi;       /* INT, NUMBER */
    bool lo_open;        /* NUMBER: (lo, hi] */
    bool clamp_hi;       /* INT: values above hi become hi instead of being refused */
    const char *unit;    /* NUMBER's range message: "seconds", "GiB"; NULL: "a number" */
    const char *const *choices; /* CHOICE: the values, NULL-terminated; "alias=value" entries
                                   are other spellings of a value listed before them */
    const char *why;            /* CHOICE: why a value not listed is refused (in the message) */
    const char *env;            /* the environment variable read when the flag is not given */
    bool negatable;             /* SWITCH: --no-<name> */
    const char *help;
} flag_def;

#define I64_MAX      9223372036854775807.0
#define CHOICES(...) ((const char *const[]){__VA_ARGS__, NULL})

/* clang-format off */
static const flag_def TABLE[] = {
    /* every role */
    {"--model", PD_FLAG_STRING, PD_ROLE_ALL, "DIR", .help = "Hugging Face model directory (required)"},
    {"--tokenizer", PD_FLAG_STRING, PD_ROLE_ALL, "DIR",
     .help = "tokenizer directory (tokenizer.json, tokenizer_config.json, chat template)"},
    {"--served-model-name", PD_FLAG_NAMES, PD_ROLE_ALL, "N [N...]", .help = "model names"},
    {"--host", PD_FLAG_STRING, PD_ROLE_ALL, "ADDR", .help = "bind address"},
    {"--port", PD_FLAG_INT, PD_ROLE_ALL, "PORT", 0, 65535, .help = "port"},
    {"--max-model-len", PD_FLAG_INT, PD_ROLE_ALL, "N", 1, 1 << 30, .help = "context length"},
    {"--shutdown-timeout", PD_FLAG_NUMBER, PD_ROLE_ALL, "S", 0, 86400, .unit = "seconds",
     .help = "drain time after SIGTERM before aborting"},
    {"--log-level", PD_FLAG_STRING, PD_ROLE_ALL, "L",
     .help = "debug, info, warn, error (else PD_LOG_LEVEL)"},
    /* the instances (pd-prefill, pd-decode) */
    {"--tensor-parallel-size", PD_FLAG_INT, PD_ROLE_NODES, "N", 1, 1024,
     .help = "times --pipeline-parallel-size must equal the instance's device count"},
    {"--pipeline-parallel-size", PD_FLAG_INT, PD_ROLE_NODES, "N", 1, 16,
     .help = "pipeline stages: the layers split into N stages of --tensor-parallel-size "
             "devices each (the instance's devices stage by stage)"},
    {"--max-num-seqs", PD_FLAG_INT, PD_ROLE_NODES, "N", 1, 1 << 20, .help = "sequences per step"},
    {"--max-num-batched-tokens", PD_FLAG_INT, PD_ROLE_NODES, "N", 1, 1 << 30,
     .help = "tokens per step; >= max-model-len unless --enable-chunked-prefill"},
    {"--enable-chunked-prefill", PD_FLAG_SWITCH, PD_ROLE_NODES, .negatable = true,
     .help = "--max-num-batched-tokens may be below --max-model-len (default 512 then): long "
             "prompts prefill over several steps"},
    {"--block-size", PD_FLAG_INT, PD_ROLE_NODES, "N", 1, 4096, .help = "tokens per KV block"},
    {"--kv-cache-bytes", PD_FLAG_INT, PD_ROLE_NODES, "N", 1, 1125899906842624.0,
     .help = "KV budget per rank"},
    {"--enable-prefix-caching", PD_FLAG_SWITCH, PD_ROLE_NODES, .negatable = true,
     .help = "reuse the cached KV of a prompt's longest cached prefix of full blocks"},
    {"--seed", PD_FLAG_INT, PD_ROLE_NODES, "N", -1, 4611686018427387904.0,
     .help = "base seed of requests without one"},
    {"--cpu-threads", PD_FLAG_INT, PD_ROLE_NODES, "N", 0, 4096, .help = "CPU threads"},
    {"--device", PD_FLAG_CHOICE, PD_ROLE_NODES, NULL, .choices = CHOICES("cpu", "cuda"),
     .help = "backend of the engine; cuda: one GPU per rank"},
    {"--dtype", PD_FLAG_CHOICE, PD_ROLE_NODES, NULL, .choices = CHOICES("auto", "float32", "bfloat16", "float16", "half=float16", "float=float32"),
     .help = "compute dtype (auto: bfloat16 on CUDA, float32 on the CPU; the CPU backend takes "
             "auto, float32 or bfloat16: bf16 matmuls, f32 accumulation)"},
    {"--quantization", PD_FLAG_CHOICE, PD_ROLE_NODES, NULL,
     .choices = CHOICES("none", "awq", "awq_marlin", "gptq", "gptq_marlin", "fp8",
                        "compressed-tensors", "smoothquant"),
     .help = "the checkpoint's quantization method (config.json quantization_config), checked "
             "at start-up; none or absent: whatever the checkpoint is. awq_marlin and "
             "gptq_marlin mean awq and gptq; smoothquant: an int8 W8A8 compressed-tensors "
             "checkpoint"},
    {"--kv-cache-dtype", PD_FLAG_CHOICE, PD_ROLE_NODES, NULL,
     .choices = CHOICES("auto", "fp8", "fp8_e4m3"),
     .why = "pdserve stores an fp8 KV cache as e4m3 (CPU backend)",
     .help = "KV cache dtype: auto = the activation dtype; fp8 (= fp8_e4m3) stores K and V as "
             "float8 e4m3 scaled by the checkpoint's k_scale / v_scale (1.0 when absent): a "
             "quarter of the CPU's float32 bytes, in the pool and on the KV transfer; prefill "
             "and decode instances must agree"},
    {"--gpu-memory-utilization", PD_FLAG_NUMBER, PD_ROLE_NODES, "F", 0, 1, .lo_open = true,
     .help = "CUDA: share of GPU memory for weights + KV"},
    {"--kv-transport", PD_FLAG_CHOICE, PD_ROLE_NODES, NULL, .choices = CHOICES("auto", "tcp", "nccl", "cuda_ipc"),
     .help = "KV data plane: cuda_ipc copies device to device (prefill and decode on one "
             "host); nccl sends device to device over NCCL (other GPUs or hosts); both need "
             "--device cuda; tcp stages through host memory; auto = on CUDA cuda_ipc, else "
             "nccl, else tcp per decode rank (what it accepts), tcp on the CPU"},
    {"--kv-lease-seconds", PD_FLAG_INT, PD_ROLE_NODES, "S", 1, 86400,
     .help = "prefill: KV held at most S s for the decode side"},
    {"--speculative-model", PD_FLAG_STRING, PD_ROLE_DECODE, "[ngram]",
     .help = "speculative decoding: drafts by n-gram prompt lookup (needs "
             "--num-speculative-tokens and --ngram-prompt-lookup-max)"},
    {"--num-speculative-tokens", PD_FLAG_INT, PD_ROLE_DECODE, "K", 1, 16,
     .help = "drafts a sequence verifies per step"},
    {"--ngram-prompt-lookup-max", PD_FLAG_INT, PD_ROLE_DECODE, "N", 1, 1 << 20,
     .help = "longest suffix n-gram looked up"},
    {"--ngram-prompt-lookup-min", PD_FLAG_INT, PD_ROLE_DECODE, "N", 0, 1 << 20,
     .help = "shortest suffix n-gram looked up"},
    {"--speculative-config", PD_FLAG_STRING, PD_ROLE_DECODE, "JSON",
     .help = "'{\"method\":\"ngram\",\"num_speculative_tokens\":K,\"prompt_lookup_max\":N,"
             "\"prompt_lookup_min\":N}' instead of the flags above"},
    {"--speculative-disable-by-batch-size", PD_FLAG_INT, PD_ROLE_DECODE, "N", 1, 1 << 20,
     .help = "no drafts while N sequences or more run"},
    {"--enforce-eager", PD_FLAG_SWITCH, PD_ROLE_NODES,
     .help = "vLLM's: no CUDA graphs (sets PD_CUDA_GRAPHS=0)"},
    /* the api-server (pd-scheduler) */
    {"--api-key", PD_FLAG_STRING, PD_ROLE_SCHEDULER, "KEY", .env = "VLLM_API_KEY",
     .help = "require 'Authorization: Bearer KEY'"},
    {"--max-concurrent-requests", PD_FLAG_INT, PD_ROLE_SCHEDULER, "N", 0, I64_MAX,
     .help = "requests admitted at once, 0 = no limit"},
    {"--max-request-body-bytes", PD_FLAG_INT, PD_ROLE_SCHEDULER, "N", 1, I64_MAX,
     .help = "largest request body"},
    {"--max-body-bytes-in-flight", PD_FLAG_INT, PD_ROLE_SCHEDULER, "N", 1, I64_MAX,
     .help = "request-body bytes being received at once over all connections; a request that "
             "would pass it gets 503 with Retry-After: 1 (at least --max-request-body-bytes)"},
    {"--queue-timeout", PD_FLAG_NUMBER, PD_ROLE_SCHEDULER, "S", 0, 1e6, .lo_open = true,
     .unit = "seconds", .help = "longest wait for decode KV capacity, then 503"},
    {"--max-local-prefill-length", PD_FLAG_INT, PD_ROLE_SCHEDULER, "N", 0, I64_MAX,
     .help = "conditional disaggregation: a prompt whose tokens not in the decode instance's "
             "prefix cache are at most N is prefilled there, not moved; 0 = never"},
    {"--prefill-timeout", PD_FLAG_NUMBER, PD_ROLE_SCHEDULER, "S", 0, 1e6, .lo_open = true,
     .unit = "seconds",
     .help = "deadline of one prefill (a prefill instance's queue included) and the life of its "
             "decode KV reservation"},
    {"--timeout-keep-alive", PD_FLAG_NUMBER, PD_ROLE_SCHEDULER, "S", 0, 1e6, .lo_open = true,
     .unit = "seconds", .help = "close an idle keep-alive connection"},
    {"--header-timeout", PD_FLAG_NUMBER, PD_ROLE_SCHEDULER, "S", 0, 1e6, .lo_open = true,
     .unit = "seconds", .help = "a request's headers must arrive within S"},
    {"--body-timeout", PD_FLAG_NUMBER, PD_ROLE_SCHEDULER, "S", 0, 1e6, .lo_open = true,
     .unit = "seconds", .help = "a request's body must arrive within S"},
    {"--chat-template", PD_FLAG_STRING, PD_ROLE_SCHEDULER, "FILE|STRING",
     .help = "override the model's chat template"},
    {"--trust-request-chat-template", PD_FLAG_SWITCH, PD_ROLE_SCHEDULER,
     .help = "allow a request's own chat_template"},
    {"--enable-prompt-tokens-details", PD_FLAG_SWITCH, PD_ROLE_SCHEDULER,
     .help = "usage.prompt_tokens_details.cached_tokens: prompt tokens found in the prefix "
             "cache"},
    {"--default-chat-template-kwargs", PD_FLAG_STRING, PD_ROLE_SCHEDULER, "JSON",
     .help = "extra template variables (an object)"},
    {"--generation-config", PD_FLAG_CHOICE, PD_ROLE_SCHEDULER, NULL,
     .choices = CHOICES("auto", "vllm"),
     .help = "auto: the model's generation_config.json gives the sampling defaults; vllm: "
             "vLLM's built-in ones"},
    {"--response-role", PD_FLAG_STRING, PD_ROLE_SCHEDULER, "ROLE",
     .help = "role of chat completion messages"},
    {"--max-logprobs", PD_FLAG_INT, PD_ROLE_SCHEDULER, "N", 0, 1000000, .clamp_hi = true,
     .help = "largest logprobs / top_logprobs a request may ask for"},
    {"--heartbeat-ms", PD_FLAG_INT, PD_ROLE_SCHEDULER, "N", 10, 3600000,
     .help = "instance heartbeat period and deadline"},
    {"--enable-auto-tool-choice", PD_FLAG_SWITCH, PD_ROLE_SCHEDULER,
     .help = "chat requests with tools and tool_choice auto: tool calls parsed out of the "
             "generated text into tool_calls (needs --tool-call-parser)"},
    {"--tool-call-parser", PD_FLAG_CHOICE, PD_ROLE_SCHEDULER, NULL,
     .choices = CHOICES("hermes", "llama3_json", "mistral"),
     .why = "the vLLM tool parsers pdserve implements",
     .help = "how tool calls are written in the generated text: hermes (<tool_call> tags: "
             "Qwen2.5, Hermes), llama3_json (JSON objects: Llama 3.x), mistral ([TOOL_CALLS]: "
             "Mistral v0.3)"},
    {"--tool-parser-plugin", PD_FLAG_STRING, PD_ROLE_SCHEDULER, "FILE",
     .help = "vLLM's Python parser plugins: refused, pdserve's parsers are built in"},
    /* environment only */
    {NULL, PD_FLAG_STRING, PD_ROLE_ALL, .env = "GLOBAL_RANK_TABLE_FILE_PATH",
     .help = "the global ranktable (required)"},
    {NULL, PD_FLAG_STRING, PD_ROLE_ALL, .env = "RANK_TABLE_FILE_PATH",
     .help = "this instance's local ranktable (the scheduler: the _host table, optional)"},
    {NULL, PD_FLAG_STRING, PD_ROLE_SCHEDULER, .env = "NODE_PORTS",
     .help = "one port per prefill then per decode instance (required)"},
    {NULL, PD_FLAG_CHOICE, PD_ROLE_SCHEDULER, .choices = CHOICES("0", "1"), .env = "USE_OPENAI",
     .help = "1 (default): the OpenAI routes; 0: vLLM's legacy /generate"},
    {NULL, PD_FLAG_STRING, PD_ROLE_ALL, .env = "PD_LOG_LEVEL",
     .help = "log level when --log-level is not given (info)"},
    {NULL, PD_FLAG_NUMBER, PD_ROLE_NODES, "GiB", 0, 1048576, .unit = "GiB",
     .env = "VLLM_CPU_KVCACHE_SPACE",
     .help = "CPU backend: KV budget per rank in GiB when --kv-cache-bytes is not given (vLLM's; "
             "unset or 0: 4), cut to what max-num-seqs sequences of max-model-len tokens hold"},
    {NULL, PD_FLAG_STRING, PD_ROLE_NODES, "LISTS", .env = "VLLM_CPU_OMP_THREADS_BIND",
     .help = "CPU backend: the cores each tensor-parallel rank's threads are pinned to (vLLM's: "
             "0-3, or 0-3|4-7 for two ranks; all, auto or unset: unpinned, sharing the host's "
             "cores through PD_CPU_BUDGET)"},
    {NULL, PD_FLAG_STRING, PD_ROLE_NODES, "host|off|NAME", .env = "PD_CPU_BUDGET",
     .help = "CPU backend: the core budget an instance's threads share with the other pdserve "
             "processes of the host, so that busy instances together run about one thread per "
             "core and an instance alone uses them all (host: the default; off: none; NAME: a "
             "budget of that name)"},
    /* vLLM's, with no effect in pdserve: accepted so the guide's command lines run, logged */
    {"--swap-space", PD_FLAG_NUMBER, 0, "GiB", 0, I64_MAX, .unit = "GiB"},
    {"--disable-log-requests", PD_FLAG_SWITCH, .roles = 0},
    {"--disable-log-stats", PD_FLAG_SWITCH, .roles = 0},
    {"--trust-remote-code", PD_FLAG_SWITCH, .roles = 0},
    {"--revision", PD_FLAG_STRING, 0, "REV", .help = "the model is read from a local directory"},
    {"--load-format", PD_FLAG_CHOICE, 0, NULL, .choices = CHOICES("auto", "safetensors"),
     .why = "pdserve reads safetensors checkpoints"},
    {"--tokenizer-mode", PD_FLAG_CHOICE, 0, NULL, .choices = CHOICES("auto", "slow", "hf"),
     .why = "pdserve has one tokenizer, of tokenizer.json"},
    {"--use-v2-block-manager", PD_FLAG_SWITCH, .roles = 0},
    {"--distributed-executor-backend", PD_FLAG_CHOICE, 0, NULL, .choices = CHOICES("mp", "uni"),
     .why = "an instance runs its tensor-parallel ranks as threads of one process"},
    {"--disable-custom-all-reduce", PD_FLAG_SWITCH, .roles = 0,
     .help = "the all-reduce is NCCL's on CUDA, the host's on the CPU"},
};
/* clang-format on */

#define N_TABLE (sizeof TABLE / sizeof TABLE[0])

/* The entry of flag name (underscores read as dashes), *negated for --no-<name>. */
static const flag_def *find_flag(const char *name, bool *negated)
{
    char norm[64];
    size_t n = strlen(name);
    if (n >= sizeof norm) return NULL;
    for (size_t i = 0; i <= n; i++) norm[i] = name[i] == '_' ? '-' : name[i];
    *negated = false;
    for (size_t i = 0; i < N_TABLE; i++)
        if (TABLE[i].name && strcmp(TABLE[i].name, norm) == 0) return &TABLE[i];
    if (strncmp(norm, "--no-", 5) == 0)
        for (size_t i = 0; i < N_TABLE; i++)
            if (TABLE[i].name && TABLE[i].negatable && strcmp(TABLE[i].name + 2, norm + 5) == 0) {
                *negated = true;
                return &TABLE[i];
            }
    return NULL;
}

static const pd_flag_bind *find_bind(const flag_def *d, const pd_flag_bind *binds, size_t n)
{
    const char *key = d->name ? d->name : d->env;
    for (size_t i = 0; i < n; i++)
        if (strcmp(binds[i].name, key) == 0) return &binds[i];
    return NULL;
}

/* The label of d in messages: its flag, else its variable. */
static const char *label(const flag_def *d)
{
    return d->name ? d->name : d->env;
}

/* Index of v among d's choices (an alias: of the value it spells), or a refusal listing
 * them ("expected a, b or c"). */
static int choice_index(const flag_def *d, const char *v, int *index)
{
    int n = 0;
    while (d->choices[n] && !strchr(d->choices[n], '=')) n++; /* the values; aliases follow */
    for (int i = 0; d->choices[i]; i++) {
        const char *c = d->choices[i], *eq = strchr(c, '=');
        size_t len = eq ? (size_t)(eq - c) : strlen(c);
        if (strlen(v) != len || strncmp(v, c, len) != 0) continue;
        for (int k = 0; eq && k < n; k++)
            if (strcmp(d->choices[k], eq + 1) == 0) i = k;
        *index = i;
        return PD_OK;
    }
    char list[256];
    size_t o = 0;
    for (int i = 0; i < n && o < sizeof list; i++)
        o += (size_t)snprintf(list + o, sizeof list - o, "%s%s",
                              i == 0       ? ""
                              : i == n - 1 ? " or "
                                           : ", ",
                              d->choices[i]);
    return pd_error(PD_EINVAL, "%s: expected %s, got '%s'%s%s%s", label(d), list, v,
                    d->why ? " (" : "", d->why ? d->why : "", d->why ? ")" : "");
}

/* Checks value v of d (NULL for a switch); the parsed number in *num, the choice in *index. */
static int check_value(const flag_def *d, const char *v, double *num, int *index)
{
    const char *name = label(d);
    if (d->kind == PD_FLAG_INT) {
        int64_t x;
        int64_t hi = d->hi >= I64_MAX ? INT64_MAX : (int64_t)d->hi;
        PD_CHECK(pd_arg_i64(name, v, (int64_t)d->lo, d->clamp_hi ? INT64_MAX : hi, &x));
        *num = (double)(x > hi ? hi : x);
    } else if (d->kind == PD_FLAG_NUMBER) {
        PD_CHECK(pd_arg_f64(name, v, num));
        bool low = d->lo_open ? !(*num > d->lo) : !(*num >= d->lo);
        if (low || *num > d->hi) {
            const char *unit = d->unit ? d->unit : "a number";
            if (d->hi >= I64_MAX)
                return pd_error(PD_EINVAL, "%s: expected %s %s %g, got \"%s\"", name, unit,
                                d->lo_open ? ">" : ">=", d->lo, v);
            return pd_error(PD_EINVAL, "%s: expected %s in %c%g, %g], got \"%s\"", name, unit,
                            d->lo_open ? '(' : '[', d->lo, d->hi, v);
        }
    } else if (d->kind == PD_FLAG_CHOICE) {
        PD_CHECK(choice_index(d, v, index));
    }
    return PD_OK;
}

/* Stores a checked value into the bound field. values (NAMES): every value given; again: the
 * flag was given before on this command line (a list then grows). */
static int store(const flag_def *d, const pd_flag_bind *b, void *params, const char *v,
                 const char *const *values, int n_values, bool again, bool on, double num,
                 int index)
{
    char *f = (char *)params + b->off;
    switch (b->type) {
    case PD_BIND_STR: *(const char **)f = d->kind == PD_FLAG_CHOICE ? d->choices[index] : v; break;
    case PD_BIND_STRV: {
        int *count = (int *)((char *)params + b->count_off), at = again ? *count : 0;
        if (at + n_values > b->max)
            return pd_error(PD_EINVAL, "%s: at most %d names", label(d), b->max);
        const char **dst = (const char **)f;
        for (int i = 0; i < n_values; i++) dst[at + i] = values[i];
        *count = at + n_values;
        break;
    }
    case PD_BIND_BOOL: *(bool *)f = d->kind == PD_FLAG_CHOICE ? index != 0 : on; break;
    case PD_BIND_INT: *(int *)f = (int)ceil(num); break;
    case PD_BIND_I64: *(int64_t *)f = (int64_t)num; break;
    case PD_BIND_SIZE: *(size_t *)f = (size_t)num; break;
    case PD_BIND_F64: *(double *)f = num; break;
    case PD_BIND_FUNC:
        return b->fn(params, label(d), d->kind == PD_FLAG_SWITCH ? (on ? "1" : NULL) : v);
    case PD_BIND_NONE: break;
    }
    return PD_OK;
}

int pd_flags_parse(unsigned role, const pd_flag_bind *binds, size_t n_binds, int argc, char **argv,
                   void *params, bool *help)
{
    *help = false;
    bool given[N_TABLE] = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            *help = true;
            return PD_OK;
        }
        if (strncmp(a, "--", 2) != 0) return pd_error(PD_EINVAL, "unexpected argument '%s'", a);
        char name[64];
        const char *eq = strchr(a, '=');
        size_t nl = eq ? (size_t)(eq - a) : strlen(a);
        if (nl >= sizeof name) return pd_error(PD_EINVAL, "unknown flag '%s' (see --help)", a);
        memcpy(name, a, nl);
        name[nl] = '\0';
        bool negated;
        const flag_def *d = find_flag(name, &negated);
        if (!d) return pd_error(PD_EINVAL, "unknown flag '%s' (see --help)", name);
        const char *v = NULL;
        const char *values[64];
        int n_values = 0;
        if (d->kind == PD_FLAG_SWITCH) {
            if (eq) return pd_error(PD_EINVAL, "%s takes no value", name);
        } else {
            v = eq ? eq + 1 : i + 1 < argc ? argv[++i] : NULL;
            if (!v) return pd_error(PD_EINVAL, "%s: missing value", d->name);
            values[n_values++] = v;
            /* N [N...]: further values up to the next flag */
            while (d->kind == PD_FLAG_NAMES && !eq && i + 1 < argc &&
                   strncmp(argv[i + 1], "--", 2) != 0 && n_values < 64)
                values[n_values++] = argv[++i];
        }
        double num = 0;
        int index = 0;
        PD_CHECK(check_value(d, v, &num, &index));
        bool again = given[d - TABLE];
        given[d - TABLE] = true;
        if (d->roles == 0) {
            PD_INFO(NULL, "%s%s%s%s: a vLLM flag with no effect in pdserve%s%s; ignored",
                    negated ? "--no-" : "--", d->name + 2, v ? " " : "", v ? v : "",
                    d->help ? ": " : "", d->help ? d->help : "");
            continue;
        }
        const pd_flag_bind *b = (d->roles & role) ? find_bind(d, binds, n_binds) : NULL;
        if (b) PD_CHECK(store(d, b, params, v, values, n_values, again, !negated, num, index));
    }
    /* the environment, for what the command line did not set */
    for (size_t k = 0; k < N_TABLE; k++) {
        const flag_def *d = &TABLE[k];
        const char *e = d->env ? getenv(d->env) : NULL;
        const pd_flag_bind *b = (d->roles & role) ? find_bind(d, binds, n_binds) : NULL;
        if (given[k] || !e || !*e || !b) continue;
        double num = 0;
        int index = 0;
        PD_CHECK(check_value(d, e, &num, &index));
        PD_CHECK(store(d, b, params, e, &e, 1, false, true, num, index));
    }
    return PD_OK;
}

/* The default of b as --help says it, from defaults; "" when there is none to say. */
static const char *default_text(const flag_def *d, const pd_flag_bind *b, const void *defaults,
                                char *buf, size_t n)
{
    if (b->dflt) return b->dflt;
    const char *f = (const char *)defaults + b->off;
    buf[0] = '\0';
    switch (b->type) {
    case PD_BIND_STR:
        snprintf(buf, n, "%s", *(const char *const *)f ? *(const char *const *)f : "");
        break;
    case PD_BIND_BOOL:
        if (d->kind == PD_FLAG_CHOICE)
            snprintf(buf, n, "%s", d->choices[*(const bool *)f ? 1 : 0]);
        else if (d->negatable) {
            snprintf(buf, n, "%s", *(const bool *)f ? "on" : "off");
        }
        break;
    case PD_BIND_INT: snprintf(buf, n, "%d", *(const int *)f); break;
    case PD_BIND_I64: snprintf(buf, n, "%lld", (long long)*(const int64_t *)f); break;
    case PD_BIND_SIZE: snprintf(buf, n, "%zu", *(const size_t *)f); break;
    case PD_BIND_F64: snprintf(buf, n, "%g", *(const double *)f); break;
    default: break;
    }
    return buf;
}

/* Writes the words of text from column col on, wrapped at 96 columns with continuation lines
 * indented to column indent. */
static void put_words(FILE *out, const char *text, size_t col, size_t indent)
{
    size_t start = col;
    for (const char *w = text; *w;) {
        while (*w == ' ') w++;
        size_t len = strcspn(w, " ");
        if (!len) break;
        if (col > start && col + 1 + len > 96) {
            fprintf(out, "\n%*s", (int)indent, "");
            col = start = indent;
        } else if (col > start) {
            fputc(' ', out);
            col++;
        }
        fprintf(out, "%.*s", (int)len, w);
        col += len;
        w += len;
    }
    fputc('\n', out);
}

/* One --help row: the flag column (30 wide), then its help. */
static void print_help(FILE *out, const char *left, const char *help)
{
    if (strlen(left) > 30)
        fprintf(out, "  %s\n%33s", left, "");
    else
        fprintf(out, "  %-30s ", left);
    put_words(out, help, 33, 33);
}

void pd_flags_usage(FILE *out, unsigned role, const char *synopsis, const char *intro,
                    const pd_flag_bind *binds, size_t n_binds, const void *defaults)
{
    fprintf(out, "usage: %s\n%s\n", synopsis, intro ? intro : "");
    for (size_t k = 0; k < N_TABLE; k++) {
        const flag_def *d = &TABLE[k];
        const pd_flag_bind *b = (d->roles & role) ? find_bind(d, binds, n_binds) : NULL;
        if (!d->name || !b) continue;
        char left[128], dbuf[64], help[640], choices[128] = "";
        for (int i = 0, o = 0; d->kind == PD_FLAG_CHOICE && d->choices[i] && o < 120; i++)
            if (!strchr(d->choices[i], '='))
                o += snprintf(choices + o, sizeof choices - (size_t)o, "%s%s", i ? "|" : "",
                              d->choices[i]);
        const char *mv = d->metavar ? d->metavar : choices[0] ? choices : NULL;
        snprintf(left, sizeof left, "%s%s%s%s", d->negatable ? "--[no-]" : d->name,
                 d->negatable ? d->name + 2 : "", mv ? " " : "", mv ? mv : "");
        const char *dt = default_text(d, b, defaults, dbuf, sizeof dbuf);
        snprintf(help, sizeof help, "%s%s%s%s%s%s", b->help ? b->help : d->help,
                 *dt ? " (default: " : "", dt, *dt ? ")" : "", d->env ? "; else " : "",
                 d->env ? d->env : "");
        print_help(out, left, help);
    }
    fprintf(out, "environment:\n");
    for (size_t k = 0; k < N_TABLE; k++) {
        const flag_def *d = &TABLE[k];
        if (!d->name && (d->roles & role)) print_help(out, d->env, d->help);
    }
    char list[2048];
    size_t o = 0;
    for (size_t k = 0; k < N_TABLE && o < sizeof list - 64; k++) {
        const flag_def *d = &TABLE[k];
        if (d->name && d->roles && !(d->roles & role))
            o += (size_t)snprintf(list + o, sizeof list - o, " %s", d->name);
    }
    fprintf(out, "flags of the other roles (accepted and checked, not used here, so one command "
                 "line serves\nevery role):\n  ");
    put_words(out, list, 2, 2);
    o = 0;
    for (size_t k = 0; k < N_TABLE && o < sizeof list - 64; k++)
        if (TABLE[k].name && !TABLE[k].roles)
            o += (size_t)snprintf(list + o, sizeof list - o, " %s%s%s", TABLE[k].name,
                                  TABLE[k].metavar ? " " : "",
                                  TABLE[k].metavar ? TABLE[k].metavar : "");
    fprintf(out, "vLLM flags accepted with no effect (logged):\n  ");
    put_words(out, list, 2, 2);
}

void pd_flags_early_log_level(int argc, char **argv)
{
    const char *level = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if ((strcmp(a, "--log-level") == 0 || strcmp(a, "--log_level") == 0) && i + 1 < argc)
            level = argv[++i];
        else if (strncmp(a, "--log-level=", 12) == 0 || strncmp(a, "--log_level=", 12) == 0)
            level = a + 12;
    }
    pd_log_level lv;
    if (level && pd_log_parse_level(level, &lv) == PD_OK) pd_log_set_level(lv);
}
