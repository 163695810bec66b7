/* pd-scheduler command line and environment (docs/api.md §17):
 * the flags of the one table (util/flags.h) that the api-server uses, bound to pd_apiserver_params.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

#include "apiserver.h"
#include "util/flags.h"
#include "util/status.h"

/* --tool-parser-plugin loads Python code into vLLM's server: there is none to load here. */
static int refuse_plugin(void *params, const char *flag, const char *value)
{
    (void)params;
    return pd_error(PD_EINVAL,
                    "%s %s: pdserve cannot load vLLM's Python tool parser plugins; its parsers "
                    "are built in (--tool-call-parser hermes, llama3_json or mistral)",
                    flag, value);
}

#define B(flag, type, field) PD_BIND(pd_apiserver_params, flag, type, field)
static const pd_flag_bind BINDS[] = {
    {.name = "--model",
     .type = PD_BIND_STR,
     .off = offsetof(pd_apiserver_params, model),
     .help = "model directory (tokenizer, chat template, config)"},
    {.name = "--tokenizer",
     .type = PD_BIND_STR,
     .off = offsetof(pd_apiserver_params, tokenizer),
     .dflt = "--model"},
    {.name = "--served-model-name",
     .type = PD_BIND_STRV,
     .off = offsetof(pd_apiserver_params, served_names),
     .count_off = offsetof(pd_apiserver_params, n_served_names),
     .max = PD_APISERVER_MAX_NAMES,
     .help = "accepted model names; the first is used in responses",
     .dflt = "--model"},
    B("--host", PD_BIND_STR, host),
    {.name = "--port",
     .type = PD_BIND_INT,
     .off = offsetof(pd_apiserver_params, port),
     .help = "HTTP port; 0 = any free one"},
    {.name = "--max-model-len",
     .type = PD_BIND_I64,
     .off = offsetof(pd_apiserver_params, max_model_len),
     .dflt = "config.json"},
    {.name = "--api-key",
     .type = PD_BIND_STR,
     .off = offsetof(pd_apiserver_params, api_key),
     .dflt = ""},
    B("--max-concurrent-requests", PD_BIND_I64, max_concurrent_requests),
    B("--max-request-body-bytes", PD_BIND_I64, max_request_body_bytes),
    {.name = "--max-body-bytes-in-flight",
     .type = PD_BIND_I64,
     .off = offsetof(pd_apiserver_params, max_body_bytes_in_flight),
     .dflt = "4 x --max-request-body-bytes"},
    B("--queue-timeout", PD_BIND_F64, queue_timeout_s),
    B("--prefill-timeout", PD_BIND_F64, prefill_timeout_s),
    B("--max-local-prefill-length", PD_BIND_I64, max_local_prefill_length),
    B("--timeout-keep-alive", PD_BIND_F64, keep_alive_s),
    B("--header-timeout", PD_BIND_F64, header_timeout_s),
    B("--body-timeout", PD_BIND_F64, body_timeout_s),
    {.name = "--chat-template",
     .type = PD_BIND_STR,
     .off = offsetof(pd_apiserver_params, chat_template),
     .dflt = "the model's"},
    B("--trust-request-chat-template", PD_BIND_BOOL, trust_request_chat_template),
    B("--enable-prompt-tokens-details", PD_BIND_BOOL, enable_prompt_tokens_details),
    B("--default-chat-template-kwargs", PD_BIND_STR, default_chat_template_kwargs),
    B("--generation-config", PD_BIND_BOOL, generation_config_vllm),
    B("--response-role", PD_BIND_STR, response_role),
    B("--max-logprobs", PD_BIND_INT, max_logprobs),
    B("--enable-auto-tool-choice", PD_BIND_BOOL, enable_auto_tool_choice),
    {.name = "--tool-call-parser",
     .type = PD_BIND_STR,
     .off = offsetof(pd_apiserver_params, tool_call_parser),
     .dflt = "none"},
    {.name = "--tool-parser-plugin", .type = PD_BIND_FUNC, .fn = refuse_plugin},
    B("--log-level", PD_BIND_STR, log_level),
    B("--heartbeat-ms", PD_BIND_INT, heartbeat_ms),
    B("--shutdown-timeout", PD_BIND_F64, shutdown_timeout_s),
    B("GLOBAL_RANK_TABLE_FILE_PATH", PD_BIND_STR, global_ranktable),
    B("RANK_TABLE_FILE_PATH", PD_BIND_STR, local_ranktable),
    B("NODE_PORTS", PD_BIND_STR, node_ports),
    B("USE_OPENAI", PD_BIND_BOOL, use_openai),
};
#undef B

void pd_apiserver_usage(FILE *out)
{
    pd_apiserver_params d = pd_apiserver_default_params();
    pd_flags_usage(out, PD_ROLE_SCHEDULER, "pd-scheduler --model DIR [options]",
                   "Serves the OpenAI-compatible HTTP API of a pdserve cluster (the api-server).\n",
                   BINDS, sizeof BINDS / sizeof *BINDS, &d);
}

int pd_apiserver_parse_args(int argc, char **argv, pd_apiserver_params *p, bool *help)
{
    return pd_flags_parse(PD_ROLE_SCHEDULER, BINDS, sizeof BINDS / sizeof *BINDS, argc, argv, p,
                          help);
}
