/* Tool-call parsers: the generated text of a chat completion -> OpenAI `tool_calls`, as vLLM's
 * `--tool-call-parser` hermes, llama3_json and mistral do (docs/api.md "Tool calling").
 *
 *   hermes       <tool_call>{"name": N, "arguments": A}</tool_call> ... (Qwen2.5, Hermes 2/3)
 *   llama3_json  [<|python_tag|>]{"name": N, "parameters"|"arguments": A}; {...} (Llama 3.x)
 *   mistral      [TOOL_CALLS][{"name": N, "arguments": A}, ...] (Mistral 7B Instruct v0.3)
 *
 * Whole text (pd_tool_extract): vLLM's extract_tool_calls, rule for rule: which text counts as
 * calls, what stays as `content` (NULL for JSON null), and the fallback to the whole text as
 * content when the calls are not valid JSON. `arguments` is A re-serialized the way Python's
 * json.dumps(A, ensure_ascii=False) writes it (", " and ": " separators, floats as repr).
 *
 * Streaming (pd_tool_stream): fed the text deltas of one choice, it returns the delta of each
 * chunk as vLLM's extract_tool_calls_streaming shapes them: text before the calls as `content`
 * (a partial start marker held back until it is known), then per call a first delta with id,
 * type, index and function.name, then function.arguments fragments. Design choice: a fragment
 * is the part of json.dumps(A) that the text seen so far fixes (closed strings' characters,
 * finished numbers and literals, separators), so the fragments of a call concatenate to exactly
 * the non-streaming `arguments` at every split of the text; vLLM's own fragment boundaries
 * follow its tokenizer and partial-JSON library, its concatenation is the same string.
 * Text after the first call is not content, in both modes (vLLM's non-streaming rule).
 *
 * tool_choice "required" and a named function (pd_tool_extract_forced, pd_tool_stream_create_
 * forced) read what structured output made the model write, as vLLM's serving_chat does:
 *
 *   required     [{"name": N, "parameters": A}, ...] (the whole text)
 *   named        A (the whole text: the named function's arguments)
 *
 * Required goes through the same scanner as the parsers (the mistral array without its marker,
 * the arguments under "parameters"), so its streamed fragments concatenate to its `arguments`
 * too; named passes the text through untouched, streamed and not.
 *
 * Ids: hermes, llama3_json, required and named "chatcmpl-tool-" + 32 hex digits, mistral 9
 * letters or digits (what mistral_common accepts), from a generator seeded by the caller.
 */
#ifndef PD_TOKENIZER_TOOL_PARSER_H
#define PD_TOKENIZER_TOOL_PARSER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The order of the pd-scheduler flag's choices (util/flags.c --tool-call-parser). */
typedef enum { PD_TOOL_HERMES = 0, PD_TOOL_LLAMA3_JSON = 1, PD_TOOL_MISTRAL = 2 } pd_tool_kind;

/* The parser of a --tool-call-parser value; PD_EINVAL naming the ones there are. */
int pd_tool_kind_from_name(const char *name, pd_tool_kind *out);
/* The text a parser needs as one token of the vocabulary ("[TOOL_CALLS]" for mistral, as vLLM
 * checks at start-up), or NULL. */
const char *pd_tool_required_token(pd_tool_kind k);

typedef struct {
    char id[48];
    char *name;      /* malloc'd, NUL-terminated UTF-8 */
    char *arguments; /* malloc'd: json.dumps of the arguments */
} pd_tool_call;

typedef struct {
    pd_tool_call *calls; /* (n,) malloc'd; n == 0: no tool was called */
    size_t n;
    char *content; /* malloc'd, or NULL for null */
    size_t content_len;
} pd_tool_calls;

/* The calls in text (len bytes) and what remains as content. PD_ENOMEM only; text that holds no
 * valid call gives n == 0 and the content vLLM gives. Free with pd_tool_calls_free. */
int pd_tool_extract(pd_tool_kind k, const char *text, size_t len, uint64_t seed,
                    pd_tool_calls *out);
void pd_tool_calls_free(pd_tool_calls *c);

/* tool_choice forced: named (the function's name) != NULL: one call of it whose arguments are
 * text as is; NULL ("required"): text must be a JSON array of {"name": string, "parameters":
 * object or null} objects (whitespace around it allowed), one call each, arguments json.dumps
 * of the parameters. content is "" (not null), as vLLM sets it. PD_EINVAL (with a message)
 * when text is not such an array (e.g. max_tokens cut it), PD_ENOMEM. */
int pd_tool_extract_forced(const char *named, const char *text, size_t len, uint64_t seed,
                           pd_tool_calls *out);

/* One tool call's part of a streamed delta. */
typedef struct {
    int index;
    bool first;       /* its first delta: id, type and name are set */
    const char *id;   /* first only */
    const char *name; /* first only, NUL-terminated */
    const char *args; /* (args_len,) the next arguments fragment; NULL: no arguments key
                         (a named function's deltas always have one, "" included) */
    size_t args_len;
} pd_tool_delta_call;

typedef struct {
    const char *content; /* (content_len,) or NULL: no content in this delta */
    size_t content_len;
    const pd_tool_delta_call *calls; /* (n_calls,) */
    size_t n_calls;
} pd_tool_delta;

typedef struct pd_tool_stream pd_tool_stream;

/* NULL when out of memory. */
pd_tool_stream *pd_tool_stream_create(pd_tool_kind k, uint64_t seed);
/* The stream of a forced tool_choice: named != NULL (copied): every delta is a call-0 delta whose
 * arguments are the text delta as is (a chunk per delta, as vLLM); NULL: "required", the calls
 * of the array as the parsers stream theirs. NULL when out of memory. */
pd_tool_stream *pd_tool_stream_create_forced(const char *named, uint64_t seed);
void pd_tool_stream_free(pd_tool_stream *st);
/* Feeds the next text delta (len bytes); final: the generation ended (held-back text is
 * flushed, a number at the end is complete). *out points into st until the next call; an empty
 * delta (no content, no calls) means vLLM sends no chunk for it (unless it is the final one).
 * PD_ENOMEM only. */
int pd_tool_stream_feed(pd_tool_stream *st, const char *text, size_t len, bool final,
                        pd_tool_delta *out);
/* The finish reason is "tool_calls": at least one call was streamed (never for a named
 * function, whose finish reason stays the generation's, as vLLM and OpenAI). */
bool pd_tool_stream_called(const pd_tool_stream *st);

#endif
