/* Chat templates: the Jinja subset of docs/api.md §13, written in C.
 *
 * A template is compiled once (start-up, or per request with --trust-request-chat-template)
 * into an immutable tree, then rendered any number of times, from any number of threads at
 * once, against a jansson object of render variables. The environment matches Hugging Face's
 * apply_chat_template: trim_blocks and lstrip_blocks on, keep_trailing_newline off, no
 * autoescape, break/continue allowed, tojson as json.dumps(ensure_ascii=False). Everything
 * outside the subset (macro, call, include, import, extends, block, filter blocks, with, do,
 * unknown filters, tests, methods and functions) fails at compile time, never at render time.
 *
 * Render variables are plain JSON: a key that is absent is *undefined* (prints as "", is
 * false, iterates as empty), a key whose value is JSON null is *none*. The helpers below
 * build that object from tokenizer_config.json and a request, and normalize messages and
 * tools exactly as §13.3 says.
 *
 * Status codes:
 *   compile: PD_EUNSUPPORTED with "chat template: unsupported {construct} '{name}' at line
 *            {l}; pass --chat-template to override" (construct is tag, filter, test, method,
 *            function or loop modifier); PD_EPARSE with "chat template: {what}: line {l}: {detail}"
 * for syntax errors. render:  PD_CHAT_ERAISED (PD_EINVAL) when the template called
 * raise_exception(msg); the message is exactly msg. PD_CHAT_ERENDER (PD_ERANGE) for every other
 * template error; the message is "Chat template error: line {l}: {detail}", ready for the §8.3 400
 * body. PD_ENOMEM when out of memory. Rendering is bounded (50M steps, 64 MiB of output, 512 MiB of
 * values): a runaway template gets PD_CHAT_ERENDER.
 */
#ifndef PD_TOKENIZER_CHAT_TEMPLATE_H
#define PD_TOKENIZER_CHAT_TEMPLATE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "util/status.h"

enum {
    PD_CHAT_ERAISED = PD_EINVAL, /* raise_exception(msg) was called; message == msg */
    PD_CHAT_ERENDER = PD_ERANGE, /* any other error while rendering */
};

typedef struct pd_chat_template pd_chat_template;

/* Compiles template text (NUL-terminated UTF-8). what names its origin in syntax errors
 * ("tokenizer_config.json chat_template", a file path); NULL means "template". On success
 * *out owns the compiled template (free with pd_chat_free); the source is copied. */
int pd_chat_compile(const char *source, const char *what, pd_chat_template **out);
void pd_chat_free(pd_chat_template *t);

/* Renders t with vars (a JSON object, borrowed; see pd_chat_build_vars). *out receives a
 * malloc'd NUL-terminated string (the caller frees it); *out_len (may be NULL) its length
 * in bytes. strftime_now() formats the current time in local time (TZ), C locale. Thread
 * safe: t is never modified. On error *out is NULL; see the status codes above. */
int pd_chat_render(const pd_chat_template *t, const json_t *vars, char **out, size_t *out_len);
/* Same, with strftime_now() seeing the fixed time now_unix (seconds since the epoch, still
 * formatted in local time per TZ). For reproducible tests. */
int pd_chat_render_at(const pd_chat_template *t, const json_t *vars, int64_t now_unix, char **out,
                      size_t *out_len);

/* The type errors of a request's `messages` (the contract's "types of known fields" step, which
 * comes before the model and the §8 rules): every message an object; its content a string, an
 * array of content parts or null; every part an object with a string `type`, and a string `text`
 * when it is a text part; an assistant's tool_calls an array of objects. PD_EINVAL with the §3
 * text ("The field `messages[1].content` must be a string, an array of content parts, or
 * null."). A `messages` that is not an array is left to the §8.3 rule. */
int pd_chat_check_message_types(const json_t *request, const char *path);

/* §13.3 messages: request is the request's `messages` value (borrowed), path names it in
 * errors ("messages"). *out is a new array of objects {role, content, [tool_calls],
 * [tool_call_id], [name]}: content always a string (null -> "", text parts joined by "\n"),
 * tool_calls[*].function.arguments parsed from its JSON string. Errors (PD_EINVAL): the type
 * errors of pd_chat_check_message_types first, then the §8.3 rules in table order, e.g.
 * "The field `messages` must be a non-empty array.", "The field `messages[2].role` must be a
 * string.", "Content part type 'image_url' is not supported by this model.",
 * "The field `messages[0].tool_calls[1].function.arguments` must be a JSON-encoded string.". */
int pd_chat_normalize_messages(const json_t *request, const char *path, json_t **out);

/* §13.3 tools: request is the request's `tools` value (borrowed; an array). *out is a new
 * array of {"type":"function","function":{"name","description"|null,"parameters"|null,
 * other keys in request order}}. PD_EINVAL naming `{path}[i]...` for a tool that is not an
 * object, lacks function.name or has a non-string name. */
int pd_chat_normalize_tools(const json_t *request, const char *path, json_t **out);

/* §13.1 template selection. override is the --chat-template value or NULL: a readable file
 * is read, otherwise the text itself is the template when it contains "{{" or "{%", else
 * PD_EINVAL "--chat-template: ...". Without override: model_dir/chat_template.jinja, then
 * tokenizer_config.json "chat_template" (a string, or a list of {name, template} from which
 * "tool_use" is taken when has_tools and present, else "default"). *source receives a
 * malloc'd template text, or NULL when the model has no template (status 0); *what (may be
 * NULL) a malloc'd description of where it came from, for pd_chat_compile. Bad files and
 * fields give PD_EINVAL/PD_EPARSE/PD_EIO naming the file and field. */
int pd_chat_select(const char *model_dir, const char *override, bool has_tools, char **source,
                   char **what);

/* §13.2 variables from tokenizer_config.json (borrowed; NULL = none): a new object holding
 * bos_token, eos_token, unk_token, pad_token (a string or an object's "content"; left out,
 * i.e. undefined, when missing or null) and additional_special_tokens (list of strings, when
 * present). PD_EINVAL naming the field when one has the wrong type. */
int pd_chat_config_vars(const json_t *tokenizer_config, json_t **out);

/* §13.2 full render variables. config_vars from pd_chat_config_vars (borrowed, may be NULL);
 * messages normalized (borrowed); tools normalized or NULL (-> none); documents or NULL
 * (-> none); default_kwargs (--default-chat-template-kwargs) and request_kwargs
 * (chat_template_kwargs), both objects or NULL, overlaid in that order over everything but
 * messages. *out is a new object. */
int pd_chat_build_vars(const json_t *config_vars, const json_t *messages, const json_t *tools,
                       const json_t *documents, bool add_generation_prompt,
                       const json_t *default_kwargs, const json_t *request_kwargs, json_t **out);

/* §13.6 continue_final_message: rendered (rendered with add_generation_prompt false) is cut
 * in place right after the last occurrence of final_content (the final message's content),
 * keeping its trailing whitespace only when the rendered text kept it. *len (may be NULL)
 * receives the new length. PD_EINVAL with the §8.3 message when the stripped text does not
 * occur. */
int pd_chat_continue_final(char *rendered, const char *final_content, size_t *len);

#endif
