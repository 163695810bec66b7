/* Request parsing and validation for pd-scheduler's OpenAI endpoints (docs/api.md §2, §5-§8,
 * §13.5): JSON body -> a typed request with its prompts tokenized and its sampling parameters
 * ready to send.
 *
 * Design: pure functions with no I/O and no globals, so unit tests drive every rule directly.
 * Checks run in the contract's processing order (JSON -> types of known fields -> model ->
 * §8.1 -> §8.2/§8.3 -> §8.4 -> template + tokenization -> §8.5 -> min_tokens) and the first
 * failure wins. A failure returns a negative status with pd_last_error() holding exactly the
 * contract's message and *http_status the status to answer (400 or 404). Everything a request
 * owns lives in the caller's arena (the HTTP exchange's), so it is freed in one place.
 */
#ifndef PD_SCHEDULER_API_H
#define PD_SCHEDULER_API_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/sampler.h"
#include "grammar/grammar.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/tool_parser.h"
#include "util/arena.h"

#define PD_API_GRAMMAR_CACHE 64 /* structured-output specs the api-server keeps compiled */

/* COMPLETIONS: /v1/completions; CHAT: /v1/chat/completions; GENERATE: legacy /generate (§14);
 * TOKENIZE: /tokenize (§15: a completions-style `prompt` or a chat-style `messages` body,
 * parsed and tokenized as those are, with no sampling and no context check). */
typedef enum {
    PD_API_COMPLETIONS = 0,
    PD_API_CHAT = 1,
    PD_API_GENERATE = 2,
    PD_API_TOKENIZE = 3
} pd_api_kind;

/* What the server knows that validation needs. Borrowed. */
typedef struct {
    const char *const *served_names; /* (n_served_names,) */
    int n_served_names;
    int64_t max_model_len;       /* L */
    int32_t vocab;               /* V */
    int max_logprobs;            /* --max-logprobs */
    int max_n;                   /* smallest --max-num-seqs of decode instances; 0 = unknown */
    pd_sampling_params defaults; /* built-in or generation-config defaults (§7.1) */
    int64_t max_new_tokens;      /* generation_config max_new_tokens, -1 when none */
    const char *response_role;   /* --response-role */
    const pd_tok *tok;
    const pd_chat_template *chat_template;       /* NULL: the model has none */
    const pd_chat_template *chat_template_tools; /* for requests with tools: the model's
                                                    'tool_use' template, or NULL (the default) */
    const json_t *chat_config_vars; /* pd_chat_config_vars of tokenizer_config.json, or NULL */
    bool trust_request_template;    /* --trust-request-chat-template */
    const json_t *default_kwargs;   /* --default-chat-template-kwargs object, or NULL */
    bool auto_tools;                /* --enable-auto-tool-choice (with a parser) */
    pd_tool_kind tool_parser;       /* --tool-call-parser, when auto_tools */
    pd_gcache *grammars;            /* structured output: compiled specs (validation); NULL
                                       without a tokenizer */
} pd_api_limits;

/* One prompt after tokenization. */
typedef struct {
    int32_t *ids; /* (n_ids,) token ids, in the arena */
    size_t n_ids;
    const char *text;   /* the prompt text (for echo; detokenized for id prompts), in the arena */
    int64_t max_tokens; /* effective limit (§7.2) for this prompt */
} pd_api_prompt;

typedef struct {
    pd_api_kind kind;
    pd_sampling_params sp; /* arrays and strings in the arena; n = choices per prompt */
    int32_t best_of;       /* sequences sampled per prompt (>= n): the n of the highest
                              cumulative logprob are returned */
    bool stream;           /* false when best_of > n: the answer is sent whole */
    bool include_usage;    /* stream_options.include_usage (given or defaulted) */
    bool continuous_usage; /* stream_options.continuous_usage_stats */
    bool echo;
    int64_t max_tokens; /* the request's own limit M, -1 when none (§8.5) */
    int64_t truncate;   /* truncate_prompt_tokens, -1 when none */
    bool add_special_tokens;
    bool tokens_as_ids; /* return_tokens_as_token_ids: logprob tokens as "token_id:{id}" */
    bool token_strs;    /* tokenize: return_token_strs */
    /* logprobs: sp.logprobs >= 0 when requested (completions `logprobs`, chat top_logprobs);
     * sp.prompt_logprobs >= 0 when the prefill computes prompt logprobs (prompt_logprobs, or
     * completions echo with logprobs, as vLLM): the body's "prompt_logprobs" are not null */
    const char *role;       /* chat: the response role */
    const char *echo_text;  /* chat echo: the last message's content, or NULL */
    bool parse_tools;       /* chat: tool_choice auto with --enable-auto-tool-choice: the
                               generated text goes through the tool parser */
    bool tools_required;    /* chat: tool_choice "required": the answer is a JSON array of
                               {"name", "parameters"} (sp guided by the tools' schema) */
    const char *tool_named; /* chat: tool_choice names this function: the answer is its
                               arguments (sp guided by its parameters), or NULL */
    size_t n_prompts;
    pd_api_prompt *prompts; /* (n_prompts,) */
} pd_api_request;

/* Parses and validates body for kind, renders the chat template and tokenizes. On failure a
 * negative status, the contract's message in pd_last_error() and *http_status (400 / 404). */
int pd_api_parse(const pd_api_limits *lim, pd_api_kind kind, const char *body, size_t len,
                 pd_arena *a, pd_api_request *out, int *http_status);

/* /detokenize (§15): {"model", "tokens": [ids]} -> *text (in the arena), as pd_api_parse
 * reports failures. */
int pd_api_detokenize(const pd_api_limits *lim, const char *body, size_t len, pd_arena *a,
                      const char **text, int *http_status);

#endif
