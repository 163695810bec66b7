/* Unit tests of pd_api_parse (scheduler/api.h): the contract's processing order, type errors,
 * §8 messages, §7 defaults, §8.5 context length and §13.5 tokenization, against the real
 * Llama-3 tokenizer and chat template of the npm cache (tests/npm_cache.sh). */
#include "harness.h"

#include <stdlib.h>
#include <unistd.h>

#include "api.h"
#include "model/config.h"

static pd_tok *g_tok;
static pd_chat_template *g_tmpl;
static json_t *g_vars;
static pd_gvocab *g_vocab;
static pd_gcache *g_grammars;
static bool g_tried;

/* The Llama-3 tokenizer directory of the npm cache, or NULL. */
static const char *llama3_dir(void)
{
    static char dir[1024];
    return pdt_npm_tokenizer_dir("llama3", dir, sizeof dir);
}

static bool setup(void)
{
    if (g_tried) return g_tok != NULL;
    g_tried = true;
    const char *dir = llama3_dir();
    if (!dir) return false;
    if (pd_tok_load(dir, &g_tok) < 0) {
        printf("    pd_tok_load: %s\n", pd_last_error());
        return false;
    }
    char *src = NULL, *what = NULL;
    if (pd_chat_select(dir, NULL, false, &src, &what) < 0 || !src ||
        pd_chat_compile(src, what, &g_tmpl) < 0 ||
        pd_chat_config_vars(pd_tok_config(g_tok), &g_vars) < 0) {
        printf("    chat template: %s\n", pd_last_error());
        free(src);
        free(what);
        pd_tok_free(g_tok);
        g_tok = NULL;
        return false;
    }
    free(src);
    free(what);
    if (pd_gvocab_from_tok(g_tok, NULL, 0, &g_vocab) < 0 ||
        !(g_grammars = pd_gcache_create(g_vocab, 16))) {
        printf("    grammar vocabulary: %s\n", pd_last_error());
        return false;
    }
    return true;
}

static const char *const NAMES[] = {"llama-3", "alias"};

static pd_api_limits limits(void)
{
    pd_api_limits l;
    memset(&l, 0, sizeof l);
    l.served_names = NAMES;
    l.n_served_names = 2;
    l.max_model_len = 64;
    l.vocab = pd_tok_vocab_size(g_tok);
    l.max_logprobs = 20;
    l.max_n = 8;
    l.defaults = pd_sampling_default_params();
    l.max_new_tokens = -1;
    l.response_role = "assistant";
    l.tok = g_tok;
    l.chat_template = g_tmpl;
    l.chat_config_vars = g_vars;
    l.grammars = g_grammars;
    return l;
}

#define SETUP()                                                                                    \
    do {                                                                                           \
        if (!setup()) SKIP("Llama-3 tokenizer not in the npm cache (run tests/npm_cache.sh)");     \
    } while (0)

/* Parses body; returns the status and leaves the message in pd_last_error(). */
static int parse(const pd_api_limits *l, pd_api_kind kind, const char *body, pd_arena *a,
                 pd_api_request *r, int *http)
{
    return pd_api_parse(l, kind, body, strlen(body), a, r, http);
}

typedef struct {
    pd_api_kind kind;
    const char *body;
    int http;
    const char *message;
} bad_case;

TEST(api_bad_requests_exact_messages)
{
    SETUP();
    pd_api_limits l = limits();
    static const bad_case cases[] = {
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"n\":9}", 400, "n must be at most 8, got 9."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"n\":2,\"best_of\":9}", 400,
         "best_of must be at most 8, got 9."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"n\":2,\"best_of\":1}", 400,
         "best_of must be greater than or equal to n, got n=2 and best_of=1."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"frequency_penalty\":-2.5}", 400,
         "frequency_penalty must be in [-2, 2], got -2.5."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"temperature\":-0.00001}", 400,
         "temperature must be non-negative, got -1e-05."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"top_p\":0}", 400,
         "top_p must be in (0, 1], got 0.0."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"min_tokens\":-1}", 400,
         "min_tokens must be greater than or equal to 0, got -1."},
        {PD_API_COMPLETIONS,
         "{\"prompt\":\"a\",\"logit_bias\":{\"128300\":1,\"5\":2,\"999999\":3}}", 400,
         "token_id(s) [128300, 999999] in logit_bias contain out-of-vocab token ids. Vocabulary "
         "size: 128256"},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"allowed_token_ids\":[1,200000]}", 400,
         "allowed_token_ids contains out-of-vocab token id!"},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"truncate_prompt_tokens\":0}", 400,
         "truncate_prompt_tokens must be at least 1, got 0."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"truncate_prompt_tokens\":65}", 400,
         "truncate_prompt_tokens value (65) is greater than max_model_len (64). Please, select a "
         "smaller truncation size."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"logprobs\":-1}", 400,
         "`logprobs` must be a positive value."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"logprobs\":21}", 400,
         "Requested sample logprobs of 21, which is greater than max allowed: 20"},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"prompt_logprobs\":-1}", 400,
         "`prompt_logprobs` must be a positive value."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"prompt_logprobs\":21}", 400,
         "Requested prompt logprobs of 21, which is greater than max allowed: 20"},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"prompt_logprobs\":1,\"stream\":true}", 400,
         "`prompt_logprobs` are not available when `stream=True`."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"prompt_logprobs\":\"1\"}", 400,
         "The field `prompt_logprobs` must be an integer."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"logprobs\":1,\"echo\":true,\"max_tokens\":0}",
         400,
         "`max_tokens` 0 (the prompt only) is not supported together with prompt logprobs "
         "(`prompt_logprobs`, or `echo` with `logprobs`)."},
        {PD_API_CHAT,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"prompt_logprobs\":30}", 400,
         "Requested prompt logprobs of 30, which is greater than max allowed: 20"},
        /* structured output: one kind, and what cannot be enforced named */
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"guided_json\":{},\"guided_regex\":\"x\"}", 400,
         "You can only use one kind of guided decoding but multiple are specified: `guided_json` "
         "and `guided_regex`."},
        {PD_API_COMPLETIONS,
         "{\"prompt\":\"a\",\"guided_regex\":\"x\",\"response_format\":{\"type\":\"json_object\"}}",
         400,
         "You can only use one kind of guided decoding but multiple are specified: "
         "`guided_regex` and `response_format`."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"response_format\":{\"type\":\"xml\"}}", 400,
         "`response_format` type 'xml' is not supported; use 'text', 'json_object' or "
         "'json_schema'."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"response_format\":{\"type\":\"json_schema\"}}",
         400,
         "The field `response_format.json_schema` must be an object (with `name` and `schema`)."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"guided_choice\":[]}", 400,
         "`guided_choice` must not be empty."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"guided_choice\":[\"a\",1]}", 400,
         "The field `guided_choice` must be an array of strings."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"guided_json\":3}", 400,
         "The field `guided_json` must be an object or a string."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"structural_tag\":\"t\"}", 400,
         "`structural_tag` is not supported."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"logits_processors\":[]}", 400,
         "`logits_processors` is not supported."},
        {PD_API_COMPLETIONS, "{\"prompt_embeds\":\"x\"}", 400, "`prompt_embeds` is not supported."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"max_tokens\":3.5}", 400,
         "The field `max_tokens` must be an integer."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"ignore_eos\":\"yes\"}", 400,
         "The field `ignore_eos` must be a boolean."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"stream_options\":[]}", 400,
         "The field `stream_options` must be an object."},
        {PD_API_COMPLETIONS,
         "{\"prompt\":\"a\",\"stream\":true,\"stream_options\":{\"include_usage\":1}}", 400,
         "The field `stream_options.include_usage` must be a boolean."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"stop_token_ids\":[\"1\"]}", 400,
         "The field `stop_token_ids` must be an array of integers."},
        {PD_API_COMPLETIONS, "{\"prompt\":[[1,2],\"x\"]}", 400,
         "The field `prompt` must be a string, an array of strings, an array of integers, or an "
         "array of arrays of integers."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"model\":7}", 400,
         "The field `model` must be a string."},
        /* types are checked before the model, the model before the rules */
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"model\":\"x\",\"n\":\"1\"}", 400,
         "The field `n` must be an integer."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"model\":\"x\",\"n\":0}", 404,
         "The model `x` does not exist."},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"n\":0,\"top_p\":9}", 400,
         "n must be at least 1, got 0."},
        {PD_API_COMPLETIONS, "{\"prompt\":[128000,128256]}", 400,
         "Token id 128256 is out of vocabulary"},
        {PD_API_COMPLETIONS, "{\"prompt\":\"\",\"add_special_tokens\":false}", 400,
         "The decoder prompt cannot be empty"},
        {PD_API_CHAT, "{\"messages\":\"hi\"}", 400,
         "The field `messages` must be a non-empty array."},
        {PD_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":-1}",
         400, "`top_logprobs` must be a positive value."},
        {PD_API_CHAT,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true,\"top_logprobs\":"
         "30}",
         400, "Requested sample logprobs of 30, which is greater than max allowed: 20"},
        {PD_API_CHAT,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\","
         "\"function\":{\"name\":\"f\"}}],\"tool_choice\":\"sometimes\"}",
         400,
         "Invalid value for `tool_choice`: sometimes! Only named tools, \"none\", \"auto\" or "
         "\"required\" are supported."},
        {PD_API_CHAT,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\","
         "\"function\":{\"name\":\"f\"}}]}",
         400,
         "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to "
         "be set"},
        {PD_API_CHAT,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\","
         "\"function\":{\"name\":\"f\"}}],\"tool_choice\":\"required\",\"guided_regex\":\"a\"}",
         400,
         "You can only either use guided decoding or tools, not both: `tool_choice` \"required\" "
         "constrains the answer itself."},
        {PD_API_CHAT,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\","
         "\"function\":{\"name\":\"f\"}}],\"tool_choice\":{\"type\":\"function\",\"function\":{"
         "\"name\":\"g\"}}}",
         400, "Tool 'g' has not been passed in `tools`."},
        {PD_API_CHAT,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"bad_words\":[\"a\"]}", 400,
         "`bad_words` is not supported."},
        {PD_API_CHAT,
         "{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"name\":\"f\","
         "\"arguments\":\"{oops\"}}]}]}",
         400,
         "The field `messages[0].tool_calls[0].function.arguments` must be a JSON-encoded string."},
        /* §2 for chat: the messages' types with the other fields', their §8.3 rules after the
         * model and §8.1; within §8.3, table order (every role before any part type) */
        {PD_API_CHAT, "{\"model\":\"gpt-4\"}", 404, "The model `gpt-4` does not exist."},
        {PD_API_CHAT,
         "{\"model\":\"gpt-4\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":"
         "\"image_url\"}]}]}",
         404, "The model `gpt-4` does not exist."},
        {PD_API_CHAT, "{\"messages\":[],\"n\":0}", 400, "n must be at least 1, got 0."},
        {PD_API_CHAT,
         "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\"}]}],"
         "\"temperature\":-1}",
         400, "temperature must be non-negative, got -1.0."},
        {PD_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":5}]}", 400,
         "The field `messages[0].content` must be a string, an array of content parts, or null."},
        {PD_API_CHAT,
         "{\"messages\":[{\"role\":5,\"content\":\"x\"},{\"role\":\"user\",\"content\":5}],"
         "\"model\":\"gpt-4\"}",
         400,
         "The field `messages[1].content` must be a string, an array of content parts, or null."},
        {PD_API_CHAT,
         "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\"}]},{\"role\":"
         "7}]}",
         400, "The field `messages[1].role` must be a string."},
        {PD_API_CHAT,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"echo\":true,\"max_tokens\":0}",
         400, "max_tokens must be at least 1, got 0."},
        /* §8.2 in table order: the prompt before logprobs */
        {PD_API_COMPLETIONS, "{\"logprobs\":-1}", 400,
         "At least one of `prompt` or `prompt_embeds` must be set."},
        {PD_API_COMPLETIONS, "{\"prompt\":[[1,2],[200000.0]]}", 400,
         "Token id 200000 is out of vocabulary"},
        /* ids printed as written, also past int32 / int64 */
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"stop_token_ids\":[5,5000000000]}", 400,
         "Token id 5000000000 in stop_token_ids is out of vocabulary."},
        {PD_API_COMPLETIONS,
         "{\"prompt\":\"a\",\"logit_bias\":{\"99999999999999999999\":1,\"-007\":1,\"+5\":1}}", 400,
         "token_id(s) [99999999999999999999, -7] in logit_bias contain out-of-vocab token ids. "
         "Vocabulary size: 128256"},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"response_format\":\"text\"}", 400,
         "The field `response_format` must be an object."},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        pd_arena *a = pd_arena_create(0);
        pd_api_request r;
        int http = 0;
        int rc = parse(&l, cases[i].kind, cases[i].body, a, &r, &http);
        pd_arena_free(a);
        ASSERT_MSG(rc < 0, "case %zu (%s) was accepted", i, cases[i].body);
        ASSERT_MSG(http == cases[i].http, "case %zu: http %d", i, http);
        ASSERT_MSG(strcmp(pd_last_error(), cases[i].message) == 0, "case %zu (%s): \"%s\"", i,
                   cases[i].body, pd_last_error());
    }
}

/* --enable-auto-tool-choice: tool_choice auto (given or implied by tools) sends the text
 * through the parser, "none" does not; mistral keeps its special [TOOL_CALLS] in the text (vLLM's
 * adjust_request); "required" is still refused. */
TEST(api_auto_tool_choice)
{
    SETUP();
    pd_api_limits l = limits();
    l.auto_tools = true;
    l.tool_parser = PD_TOOL_HERMES;
    pd_arena *a = pd_arena_create(0);
    pd_api_request r;
    int http;
    const char *tools = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{"
                        "\"type\":\"function\",\"function\":{\"name\":\"f\"}}]";
    char body[512];
    snprintf(body, sizeof body, "%s}", tools);
    ASSERT_OK(parse(&l, PD_API_CHAT, body, a, &r, &http));
    ASSERT(r.parse_tools && r.sp.skip_special_tokens);
    snprintf(body, sizeof body, "%s,\"tool_choice\":\"none\"}", tools);
    ASSERT_OK(parse(&l, PD_API_CHAT, body, a, &r, &http));
    ASSERT(!r.parse_tools);
    l.tool_parser = PD_TOOL_MISTRAL;
    snprintf(body, sizeof body, "%s,\"tool_choice\":\"auto\"}", tools);
    ASSERT_OK(parse(&l, PD_API_CHAT, body, a, &r, &http));
    ASSERT(r.parse_tools && !r.sp.skip_special_tokens);
    snprintf(body, sizeof body, "%s,\"tool_choice\":\"required\"}", tools);
    ASSERT_OK(parse(&l, PD_API_CHAT, body, a, &r, &http));
    ASSERT(r.tools_required && !r.parse_tools && r.sp.guided_kind == PD_GSPEC_JSON_SCHEMA);
    ASSERT_CONTAINS(r.sp.guided, "\"minItems\":1");
    pd_arena_free(a);
}

/* Structured output: each field becomes the engine's guided spec (objects as compact JSON text),
 * and what the grammar compiler refuses is a 400 naming the field and the keyword's place. */
TEST(api_structured_output_fields)
{
    SETUP();
    pd_api_limits l = limits();
    pd_arena *a = pd_arena_create(0);
    pd_api_request r;
    int http;
    static const struct {
        pd_api_kind kind;
        const char *body;
        int guided_kind;
        const char *text, *ws;
    } ok[] = {
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"guided_json\":{\"type\": \"integer\"}}",
         PD_GSPEC_JSON_SCHEMA, "{\"type\":\"integer\"}", NULL},
        {PD_API_COMPLETIONS,
         "{\"prompt\":\"a\",\"guided_json\":\"{\\\"type\\\":\\\"string\\\"}\","
         "\"guided_whitespace_pattern\":\" ?\",\"guided_decoding_backend\":\"xgrammar\"}",
         PD_GSPEC_JSON_SCHEMA, "{\"type\":\"string\"}", " ?"},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"guided_regex\":\"[0-9]+\"}", PD_GSPEC_REGEX,
         "[0-9]+", NULL},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"guided_choice\":[\"yes\",\"no\"]}",
         PD_GSPEC_CHOICE, "[\"yes\",\"no\"]", NULL},
        {PD_API_COMPLETIONS, "{\"prompt\":\"a\",\"guided_grammar\":\"root ::= \\\"x\\\"\"}",
         PD_GSPEC_GRAMMAR, "root ::= \"x\"", NULL},
        {PD_API_CHAT,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"response_format\":{\"type\":"
         "\"json_object\"}}",
         PD_GSPEC_JSON_OBJECT, "", NULL},
        {PD_API_CHAT,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"response_format\":{\"type\":"
         "\"json_schema\",\"json_schema\":{\"name\":\"n\",\"strict\":true,\"schema\":{\"type\":"
         "\"boolean\"}}}}",
         PD_GSPEC_JSON_SCHEMA, "{\"type\":\"boolean\"}", NULL},
        {PD_API_CHAT,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"response_format\":{\"type\":"
         "\"text\"}}",
         0, NULL, NULL},
        {PD_API_GENERATE, "{\"prompt\":\"a\",\"guided_json\":{\"enum\":[1,2]}}",
         PD_GSPEC_JSON_SCHEMA, "{\"enum\":[1,2]}", NULL},
    };
    for (size_t i = 0; i < sizeof ok / sizeof *ok; i++) {
        ASSERT_MSG(parse(&l, ok[i].kind, ok[i].body, a, &r, &http) == 0, "%s: %s", ok[i].body,
                   pd_last_error());
        ASSERT_EQ_INT(r.sp.guided_kind, ok[i].guided_kind);
        if (ok[i].text) {
            ASSERT_EQ_INT((long long)r.sp.guided_len, (long long)strlen(ok[i].text));
            ASSERT_STR_EQ(r.sp.guided, ok[i].text);
        }
        if (ok[i].ws)
            ASSERT_STR_EQ(r.sp.guided_ws, ok[i].ws);
        else
            ASSERT(r.sp.guided_ws == NULL);
    }
    static const struct {
        const char *body, *want;
    } refused[] = {
        {"{\"prompt\":\"a\",\"guided_json\":{\"properties\":{\"a\":{\"if\":{}}}}}",
         "`guided_json`: json schema: if at /properties/a/if"},
        {"{\"prompt\":\"a\",\"guided_json\":\"{not json\"}", "`guided_json`: "},
        {"{\"prompt\":\"a\",\"guided_regex\":\"(ab\"}", "`guided_regex`: "},
        {"{\"prompt\":\"a\",\"guided_grammar\":\"root ::= missing\"}", "`guided_grammar`: "},
    };
    for (size_t i = 0; i < sizeof refused / sizeof *refused; i++) {
        ASSERT_MSG(parse(&l, PD_API_COMPLETIONS, refused[i].body, a, &r, &http) == PD_EINVAL,
                   "%s accepted", refused[i].body);
        ASSERT_EQ_INT(http, 400);
        ASSERT_MSG(strstr(pd_last_error(), refused[i].want), "%s: %s", refused[i].body,
                   pd_last_error());
    }
    /* tool_choice named: the function's parameters; required: an array of calls */
    const char *tools = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":["
                        "{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":"
                        "{\"type\":\"object\",\"properties\":{\"x\":{\"$ref\":\"#/$defs/X\"}},"
                        "\"$defs\":{\"X\":{\"type\":\"integer\"}}}}},{\"type\":\"function\","
                        "\"function\":{\"name\":\"g\"}}]";
    char body[1024];
    snprintf(body, sizeof body,
             "%s,\"tool_choice\":{\"type\":\"function\",\"function\":{"
             "\"name\":\"g\"}}}",
             tools);
    ASSERT_OK(parse(&l, PD_API_CHAT, body, a, &r, &http));
    ASSERT_STR_EQ(r.tool_named, "g");
    ASSERT_STR_EQ(r.sp.guided, "{\"type\":\"object\",\"properties\":{}}");
    snprintf(body, sizeof body, "%s,\"tool_choice\":\"required\"}", tools);
    ASSERT_OK(parse(&l, PD_API_CHAT, body, a, &r, &http));
    ASSERT(r.tools_required);
    ASSERT_STR_EQ(
        r.sp.guided,
        "{\"type\":\"array\",\"minItems\":1,\"items\":{\"type\":\"object\",\"anyOf\":[{"
        "\"properties\":{\"name\":{\"type\":\"string\",\"enum\":[\"f\"]},\"parameters\":{"
        "\"type\":\"object\",\"properties\":{\"x\":{\"$ref\":\"#/$defs/X\"}}}},\"required\":["
        "\"name\",\"parameters\"]},{\"properties\":{\"name\":{\"type\":\"string\",\"enum\":["
        "\"g\"]},\"parameters\":{\"type\":\"object\",\"properties\":{}}},\"required\":["
        "\"name\",\"parameters\"]}]},\"$defs\":{\"X\":{\"type\":\"integer\"}}}");
    pd_arena_free(a);
}

TEST(api_completions_tokenization_and_limits)
{
    SETUP();
    pd_api_limits l = limits();
    pd_arena *a = pd_arena_create(0);
    pd_api_request r;
    int http;
    /* text prompt: tokenized with add_special_tokens true by default (§13.5; this tokenizer's
     * post-processor decides about BOS); default max_tokens 16 */
    int32_t *ids_sp = NULL, *ids_plain = NULL;
    size_t n_sp = 0, n_plain = 0;
    ASSERT_OK(pd_tok_encode(g_tok, "Hello <|eot_id|>", 16, true, &ids_sp, &n_sp));
    ASSERT_OK(pd_tok_encode(g_tok, "Hello <|eot_id|>", 16, false, &ids_plain, &n_plain));
    /* prompt logprobs: asked of the prefill as given; echo with logprobs asks for the same k
     * (vLLM), an explicit prompt_logprobs wins; none by default */
    ASSERT_OK(
        parse(&l, PD_API_COMPLETIONS, "{\"prompt\":\"a b\",\"prompt_logprobs\":3}", a, &r, &http));
    ASSERT_EQ_INT(r.sp.prompt_logprobs, 3);
    ASSERT_EQ_INT(r.sp.logprobs, -1);
    ASSERT_OK(parse(&l, PD_API_COMPLETIONS, "{\"prompt\":\"a b\",\"echo\":true,\"logprobs\":2}", a,
                    &r, &http));
    ASSERT_EQ_INT(r.sp.prompt_logprobs, 2);
    ASSERT_EQ_INT(r.sp.logprobs, 2);
    ASSERT_OK(parse(&l, PD_API_COMPLETIONS,
                    "{\"prompt\":\"a b\",\"echo\":true,\"logprobs\":2,\"prompt_logprobs\":0}", a,
                    &r, &http));
    ASSERT_EQ_INT(r.sp.prompt_logprobs, 0);
    ASSERT_OK(parse(&l, PD_API_COMPLETIONS,
                    "{\"prompt\":\"a b\",\"stream\":true,"
                    "\"prompt_logprobs\":0}",
                    a, &r, &http));
    ASSERT_EQ_INT(r.sp.prompt_logprobs, 0);
    ASSERT_OK(parse(&l, PD_API_CHAT,
                    "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"prompt_logprobs\":4}",
                    a, &r, &http));
    ASSERT_EQ_INT(r.sp.prompt_logprobs, 4);
    ASSERT_OK(parse(&l, PD_API_COMPLETIONS, "{\"prompt\":\"a b\"}", a, &r, &http));
    ASSERT_EQ_INT(r.sp.prompt_logprobs, -1);
    int rc = parse(&l, PD_API_COMPLETIONS, "{\"prompt\":\"Hello <|eot_id|>\",\"model\":\"alias\"}",
                   a, &r, &http);
    bool same = rc == 0 && r.prompts[0].n_ids == n_sp &&
                memcmp(r.prompts[0].ids, ids_sp, n_sp * sizeof *ids_sp) == 0;
    free(ids_sp);
    ASSERT_OK(rc);
    ASSERT(same);
    ASSERT_EQ_INT(r.n_prompts, 1);
    ASSERT_EQ_INT(r.prompts[0].max_tokens, 16);
    /* the special token text became its id */
    ASSERT_EQ_INT(r.prompts[0].ids[r.prompts[0].n_ids - 1],
                  pd_tok_token_to_id(g_tok, "<|eot_id|>", 10));
    /* add_special_tokens false; max_tokens null: L - P */
    rc = parse(&l, PD_API_COMPLETIONS,
               "{\"prompt\":\"Hello <|eot_id|>\",\"add_special_tokens\":false,\"max_tokens\":null}",
               a, &r, &http);
    same = rc == 0 && r.prompts[0].n_ids == n_plain &&
           memcmp(r.prompts[0].ids, ids_plain, n_plain * sizeof *ids_plain) == 0;
    free(ids_plain);
    ASSERT_OK(rc);
    ASSERT(same);
    ASSERT_EQ_INT(r.prompts[0].max_tokens, 64 - (int64_t)n_plain);
    /* token ids are used as given; truncation keeps the last k */
    ASSERT_OK(parse(&l, PD_API_COMPLETIONS,
                    "{\"prompt\":[[1,2,3,4],[5,6]],\"n\":2,\"truncate_prompt_tokens\":3,"
                    "\"unknown_key\":{\"x\":1}}",
                    a, &r, &http));
    ASSERT_EQ_INT(r.n_prompts, 2);
    ASSERT_EQ_INT(r.sp.n, 2);
    ASSERT_EQ_INT(r.prompts[0].n_ids, 3);
    ASSERT_EQ_INT(r.prompts[0].ids[0], 2);
    ASSERT_EQ_INT(r.prompts[1].n_ids, 2);
    /* §8.5: P + M = L accepted, L + 1 refused with the exact text */
    char body[1024];
    size_t at = (size_t)snprintf(body, sizeof body, "{\"prompt\":[");
    for (int i = 0; i < 60; i++)
        at += (size_t)snprintf(body + at, sizeof body - at, "%s7", i ? "," : "");
    snprintf(body + at, sizeof body - at, "],\"max_tokens\":4}");
    ASSERT_OK(parse(&l, PD_API_COMPLETIONS, body, a, &r, &http));
    snprintf(body + at, sizeof body - at, "],\"max_tokens\":5}");
    ASSERT(parse(&l, PD_API_COMPLETIONS, body, a, &r, &http) < 0);
    ASSERT_STR_EQ(
        pd_last_error(),
        "'max_tokens' or 'max_completion_tokens' is too large: 5. This model's maximum "
        "context length is 64 tokens and your request has 60 input tokens (5 > 64 - 60).");
    at = (size_t)snprintf(body, sizeof body, "{\"prompt\":[");
    for (int i = 0; i < 64; i++)
        at += (size_t)snprintf(body + at, sizeof body - at, "%s7", i ? "," : "");
    snprintf(body + at, sizeof body - at, "]}");
    ASSERT(parse(&l, PD_API_COMPLETIONS, body, a, &r, &http) < 0);
    ASSERT_STR_EQ(pd_last_error(),
                  "This model's maximum context length is 64 tokens. However, your request has 64 "
                  "input tokens. Please reduce the length of the input messages.");
    /* min_tokens against the effective limit */
    ASSERT(parse(&l, PD_API_COMPLETIONS, "{\"prompt\":\"Hello\",\"min_tokens\":17}", a, &r, &http) <
           0);
    ASSERT_STR_EQ(pd_last_error(),
                  "min_tokens must be less than or equal to max_tokens=16, got 17.");
    /* stop strings are owned by the arena (the JSON is gone after parsing) */
    ASSERT_OK(parse(&l, PD_API_COMPLETIONS, "{\"prompt\":\"Hello\",\"stop\":[\"ab\",\"\\n\"]}", a,
                    &r, &http));
    ASSERT_EQ_INT(r.sp.n_stop, 2);
    ASSERT_STR_EQ(r.sp.stop[0], "ab");
    ASSERT_STR_EQ(r.sp.stop[1], "\n");
    /* stream_options whose members are null is an empty one: allowed without stream */
    ASSERT_OK(parse(&l, PD_API_COMPLETIONS,
                    "{\"prompt\":\"Hello\",\"stream_options\":{\"include_usage\":null}}", a, &r,
                    &http));
    ASSERT(!r.stream);
    pd_arena_free(a);
}

TEST(api_chat_template_and_defaults)
{
    SETUP();
    pd_api_limits l = limits();
    /* §7.1: generation_config temperature 0.6, top_p 0.9, top_k 50 -> top_k stays disabled */
    pd_generation_config g = pd_generation_config_default();
    g.has_temperature = true, g.temperature = 0.6;
    g.has_top_p = true, g.top_p = 0.9;
    g.has_top_k = true, g.top_k = 50;
    l.defaults = pd_sampling_model_params(&g);
    pd_arena *a = pd_arena_create(0);
    pd_api_request r;
    int http;
    ASSERT_OK(parse(&l, PD_API_CHAT,
                    "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],"
                    "\"chat_template_kwargs\":{\"date_string\":\"26 Jul 2024\"}}",
                    a, &r, &http));
    ASSERT_NEAR(r.sp.temperature, 0.6, 1e-12);
    ASSERT_NEAR(r.sp.top_p, 0.9, 1e-12);
    ASSERT_EQ_INT(r.sp.top_k, 0);
    ASSERT_STR_EQ(r.role, "assistant");
    /* the template wrote BOS; add_special_tokens is false for chat: exactly one BOS */
    ASSERT(r.prompts[0].n_ids > 3);
    ASSERT_EQ_INT(r.prompts[0].ids[0], pd_tok_bos_id(g_tok));
    ASSERT(r.prompts[0].ids[1] != pd_tok_bos_id(g_tok));
    ASSERT_CONTAINS(r.prompts[0].text, "<|start_header_id|>assistant<|end_header_id|>");
    /* chat without a limit: L - P */
    ASSERT_EQ_INT(r.prompts[0].max_tokens, 64 - (int64_t)r.prompts[0].n_ids);
    /* add_generation_prompt false: the role is the last message's; echo takes its content */
    ASSERT_OK(parse(&l, PD_API_CHAT,
                    "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"},{\"role\":\"assistant\","
                    "\"content\":\"Hel\"}],\"add_generation_prompt\":false,"
                    "\"continue_final_message\":true,\"echo\":true,\"max_tokens\":2}",
                    a, &r, &http));
    ASSERT_STR_EQ(r.role, "assistant");
    ASSERT_STR_EQ(r.echo_text, "Hel");
    size_t tl = strlen(r.prompts[0].text);
    ASSERT(tl >= 3 && strcmp(r.prompts[0].text + tl - 3, "Hel") == 0);
    /* §13.1: a request with tools renders the model's 'tool_use' template when it has one */
    pd_chat_template *tool_use = NULL;
    ASSERT_OK(pd_chat_compile("{{ raise_exception('tool_use template') }}", "test", &tool_use));
    l.chat_template_tools = tool_use;
    static const char *const with_tools =
        "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"tool_choice\":\"none\","
        "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]}";
    int trc = parse(&l, PD_API_CHAT, with_tools, a, &r, &http);
    ASSERT(trc < 0);
    ASSERT_STR_EQ(pd_last_error(), "tool_use template");
    ASSERT_OK(parse(&l, PD_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}]}", a,
                    &r, &http)); /* no tools: the default */
    l.chat_template_tools = NULL;
    ASSERT_OK(parse(&l, PD_API_CHAT, with_tools, a, &r, &http));
    pd_chat_free(tool_use);
    /* a model without a template */
    l.chat_template = NULL;
    ASSERT(parse(&l, PD_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}]}", a, &r,
                 &http) < 0);
    ASSERT_STR_EQ(pd_last_error(), "This model has no chat template; start the server with "
                                   "--chat-template, or use /v1/completions.");
    pd_arena_free(a);
}

TEST(api_legacy_generate)
{
    SETUP();
    pd_api_limits l = limits();
    l.defaults.temperature = 0.5; /* generation-config defaults never apply to /generate */
    pd_arena *a = pd_arena_create(0);
    pd_api_request r;
    int http;
    ASSERT_OK(
        parse(&l, PD_API_GENERATE, "{\"prompt\":\"Hello\",\"n\":2,\"logprobs\":3}", a, &r, &http));
    ASSERT_NEAR(r.sp.temperature, 1.0, 0);
    ASSERT_EQ_INT(r.sp.n, 2);
    ASSERT_EQ_INT(r.prompts[0].max_tokens, 16);
    ASSERT(parse(&l, PD_API_GENERATE, "{\"prompt\":\"Hello\",\"messages\":[]}", a, &r, &http) < 0);
    ASSERT_STR_EQ(pd_last_error(), "Unsupported sampling parameter: `messages`.");
    ASSERT(parse(&l, PD_API_GENERATE, "{\"prompt\":\"Hello\",\"top_k\":-3}", a, &r, &http) < 0);
    ASSERT_STR_EQ(pd_last_error(), "top_k must be 0 (disable), or at least 1, got -3.");
    pd_arena_free(a);
}

TEST(api_request_template_and_kwargs)
{
    SETUP();
    pd_api_limits l = limits();
    json_t *defaults = json_pack("{s:s, s:s}", "x", "default", "y", "only-default");
    l.default_kwargs = defaults;
    l.trust_request_template = true;
    pd_arena *a = pd_arena_create(0);
    pd_api_request r;
    int http;
    /* the request's kwargs overlay the server's; the request's own template is used */
    int rc = parse(&l, PD_API_CHAT,
                   "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":2,"
                   "\"chat_template\":\"{{ messages[0].content }}|{{ x }}|{{ y }}\","
                   "\"chat_template_kwargs\":{\"x\":\"request\"}}",
                   a, &r, &http);
    bool text_ok = rc == 0 && strcmp(r.prompts[0].text, "Hi|request|only-default") == 0;
    l.default_kwargs = NULL;
    json_decref(defaults);
    ASSERT_OK(rc);
    ASSERT(text_ok);
    /* a request template outside the subset is a 400 naming the construct */
    ASSERT(parse(&l, PD_API_CHAT,
                 "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],"
                 "\"chat_template\":\"{% macro m() %}{% endmacro %}\"}",
                 a, &r, &http) < 0);
    ASSERT_EQ_INT(http, 400);
    ASSERT_CONTAINS(pd_last_error(), "unsupported");
    /* raise_exception text is the message, exactly */
    ASSERT(
        parse(&l, PD_API_CHAT,
              "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],"
              "\"chat_template\":\"{{ raise_exception('Conversation roles must alternate') }}\"}",
              a, &r, &http) < 0);
    ASSERT_STR_EQ(pd_last_error(), "Conversation roles must alternate");
    pd_arena_free(a);
}

TEST(api_zz_cleanup)
{
    pd_chat_free(g_tmpl);
    json_decref(g_vars);
    pd_tok_free(g_tok);
    g_tmpl = NULL, g_vars = NULL, g_tok = NULL;
}
