/* Chat templates: the public face of the Jinja subset (see chat_template.h).
 *
 * This file holds what is specific to chat: choosing the template (§13.1), building the
 * render variables from tokenizer_config.json and the request (§13.2), normalizing
 * messages and tools (§13.3) and the continue_final_message cut (§13.6). The language
 * itself lives in jinja_parse.c (compile) and jinja_eval.c (render). Everything here works
 * on jansson values and returns a status with a message naming the file or field.
 */
#include "tokenizer/chat_template.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "json/json.h"
#include "tokenizer/jinja_internal.h"
#include "tokenizer/unicode.h"

#define MAX_TEMPLATE_FILE ((size_t)16 << 20)

struct pd_chat_template {
    jinja_program prog; /* immutable after compile */
};

int pd_chat_compile(const char *source, const char *what, pd_chat_template **out)
{
    *out = NULL;
    if (!source) return pd_error(PD_EINVAL, "chat template: no template text");
    pd_chat_template *t = calloc(1, sizeof *t);
    if (!t) return pd_error(PD_ENOMEM, "chat template: out of memory");
    int rc = jinja_compile(source, what, &t->prog);
    if (rc < 0) {
        free(t);
        return rc;
    }
    *out = t;
    return 0;
}

void pd_chat_free(pd_chat_template *t)
{
    if (!t) return;
    pd_arena_free(t->prog.arena);
    free(t);
}

int pd_chat_render_at(const pd_chat_template *t, const json_t *vars, int64_t now_unix, char **out,
                      size_t *out_len)
{
    *out = NULL;
    if (!t || !vars) return pd_error(PD_EINVAL, "chat template: nothing to render");
    return jinja_render(&t->prog, vars, now_unix, out, out_len);
}

int pd_chat_render(const pd_chat_template *t, const json_t *vars, char **out, size_t *out_len)
{
    return pd_chat_render_at(t, vars, (int64_t)time(NULL), out, out_len);
}

/* ---- §13.3 normalization --------------------------------------------------------------- */

/* The `tool_calls` of message m when it is an assistant's and has them, else NULL. */
static const json_t *assistant_calls(const json_t *m)
{
    const char *role = json_string_value(json_object_get(m, "role"));
    const json_t *calls = json_object_get(m, "tool_calls");
    return role && strcmp(role, "assistant") == 0 && calls && !json_is_null(calls) ? calls : NULL;
}

static int message_types(const json_t *m, const char *path, size_t i)
{
    if (!json_is_object(m))
        return pd_error(PD_EINVAL, "The field `%s[%zu]` must be an object.", path, i);
    const json_t *content = json_object_get(m, "content");
    if (json_is_array(content)) {
        for (size_t j = 0; j < json_array_size(content); j++) {
            const json_t *part = json_array_get(content, j);
            const char *type = json_string_value(json_object_get(part, "type"));
            if (!json_is_object(part) || !type)
                return pd_error(PD_EINVAL,
                                "The field `%s[%zu].content[%zu].type` must be a string.", path, i,
                                j);
            if (strcmp(type, "text") == 0 && !json_is_string(json_object_get(part, "text")))
                return pd_error(PD_EINVAL,
                                "The field `%s[%zu].content[%zu].text` must be a string.", path, i,
                                j);
        }
    } else if (content && !json_is_null(content) && !json_is_string(content)) {
        return pd_error(PD_EINVAL,
                        "The field `%s[%zu].content` must be a string, an array of content "
                        "parts, or null.",
                        path, i);
    }
    const json_t *calls = assistant_calls(m);
    if (calls && !json_is_array(calls))
        return pd_error(PD_EINVAL, "The field `%s[%zu].tool_calls` must be an array.", path, i);
    for (size_t j = 0; calls && j < json_array_size(calls); j++)
        if (!json_is_object(json_array_get(calls, j)))
            return pd_error(PD_EINVAL, "The field `%s[%zu].tool_calls[%zu]` must be an object.",
                            path, i, j);
    return 0;
}

int pd_chat_check_message_types(const json_t *request, const char *path)
{
    if (!path) path = "messages";
    for (size_t i = 0; json_is_array(request) && i < json_array_size(request); i++)
        PD_CHECK(message_types(json_array_get(request, i), path, i));
    return 0;
}

/* The §8.3 rules on messages whose types are right, in table order: a non-empty array, every
 * role a string, text parts only, tool-call arguments that are JSON strings. */
static int message_rules(const json_t *request, const char *path)
{
    size_t n = json_array_size(request);
    if (!json_is_array(request) || n == 0)
        return pd_error(PD_EINVAL, "The field `%s` must be a non-empty array.", path);
    for (size_t i = 0; i < n; i++)
        if (!json_is_string(json_object_get(json_array_get(request, i), "role")))
            return pd_error(PD_EINVAL, "The field `%s[%zu].role` must be a string.", path, i);
    for (size_t i = 0; i < n; i++) {
        const json_t *content = json_object_get(json_array_get(request, i), "content");
        for (size_t j = 0; json_is_array(content) && j < json_array_size(content); j++) {
            const char *type =
                json_string_value(json_object_get(json_array_get(content, j), "type"));
            if (strcmp(type, "text") != 0)
                return pd_error(PD_EINVAL, "Content part type '%s' is not supported by this model.",
                                type);
        }
    }
    for (size_t i = 0; i < n; i++) {
        const json_t *calls = assistant_calls(json_array_get(request, i));
        for (size_t j = 0; calls && j < json_array_size(calls); j++) {
            const json_t *fn = json_object_get(json_array_get(calls, j), "function");
            const json_t *args = json_is_object(fn) ? json_object_get(fn, "arguments") : NULL;
            json_t *parsed = json_is_string(args)
                                 ? json_loadb(json_string_value(args), json_string_length(args),
                                              JSON_DECODE_ANY, NULL)
                                 : NULL;
            json_decref(parsed);
            if (args && !parsed)
                return pd_error(PD_EINVAL,
                                "The field `%s[%zu].tool_calls[%zu].function.arguments` must be a "
                                "JSON-encoded string.",
                                path, i, j);
        }
    }
    return 0;
}

/* A checked message's content as one string: null -> "", text parts joined by "\n". */
static json_t *content_string(const json_t *content)
{
    if (!content || json_is_null(content)) return json_string("");
    if (json_is_string(content)) return json_incref((json_t *)content);
    size_t total = 0, n = json_array_size(content);
    for (size_t j = 0; j < n; j++)
        total += json_string_length(json_object_get(json_array_get(content, j), "text")) + 1;
    char *buf = malloc(total + 1);
    if (!buf) return NULL;
    size_t o = 0;
    for (size_t j = 0; j < n; j++) {
        const json_t *text = json_object_get(json_array_get(content, j), "text");
        if (j) buf[o++] = '\n';
        memcpy(buf + o, json_string_value(text), json_string_length(text));
        o += json_string_length(text);
    }
    json_t *s = json_stringn_nocheck(buf, o);
    free(buf);
    return s;
}

/* Checked tool calls, copied, with each function's arguments parsed; NULL when out of memory. */
static json_t *parsed_tool_calls(const json_t *calls)
{
    json_t *arr = json_array();
    for (size_t j = 0; arr && j < json_array_size(calls); j++) {
        json_t *call = json_deep_copy(json_array_get(calls, j));
        json_t *fn = json_object_get(call, "function");
        const json_t *args = json_is_object(fn) ? json_object_get(fn, "arguments") : NULL;
        bool ok = call && (!args || json_object_set_new(fn, "arguments",
                                                        json_loadb(json_string_value(args),
                                                                   json_string_length(args),
                                                                   JSON_DECODE_ANY, NULL)) == 0);
        if (!ok || json_array_append_new(arr, call) < 0) { /* append_new took call */
            if (!ok) json_decref(call);
            json_decref(arr);
            arr = NULL;
        }
    }
    return arr;
}

int pd_chat_normalize_messages(const json_t *request, const char *path, json_t **out)
{
    *out = NULL;
    if (!path) path = "messages";
    PD_CHECK(pd_chat_check_message_types(request, path));
    PD_CHECK(message_rules(request, path));
    json_t *arr = json_array();
    for (size_t i = 0; arr && i < json_array_size(request); i++) {
        const json_t *m = json_array_get(request, i);
        const json_t *role = json_object_get(m, "role"), *calls = assistant_calls(m);
        const json_t *tcid = json_object_get(m, "tool_call_id"), *name = json_object_get(m, "name");
        bool tool = strcmp(json_string_value(role), "tool") == 0 && tcid && !json_is_null(tcid);
        json_t *msg = json_object(); /* set_new takes its value, also when it fails */
        bool ok =
            msg && json_object_set(msg, "role", (json_t *)role) == 0 &&
            json_object_set_new(msg, "content", content_string(json_object_get(m, "content"))) ==
                0 &&
            (!calls || json_object_set_new(msg, "tool_calls", parsed_tool_calls(calls)) == 0) &&
            (!tool || json_object_set(msg, "tool_call_id", (json_t *)tcid) == 0) &&
            (!json_is_string(name) || json_object_set(msg, "name", (json_t *)name) == 0);
        if (!ok || json_array_append_new(arr, msg) < 0) {
            if (!ok) json_decref(msg);
            json_decref(arr);
            arr = NULL;
        }
    }
    if (!arr) return pd_error(PD_ENOMEM, "out of memory");
    *out = arr;
    return 0;
}

int pd_chat_normalize_tools(const json_t *request, const char *path, json_t **out)
{
    *out = NULL;
    if (!path) path = "tools";
    if (!json_is_array(request))
        return pd_error(PD_EINVAL, "The field `%s` must be an array.", path);
    json_t *arr = json_array();
    if (!arr) return pd_error(PD_ENOMEM, "out of memory");
    for (size_t i = 0; i < json_array_size(request); i++) {
        const json_t *tool = json_array_get(request, i);
        const json_t *fn = json_is_object(tool) ? json_object_get(tool, "function") : NULL;
        const json_t *name = json_is_object(fn) ? json_object_get(fn, "name") : NULL;
        if (!json_is_object(tool) || !json_is_object(fn) || !json_is_string(name)) {
            json_decref(arr);
            if (!json_is_object(tool))
                return pd_error(PD_EINVAL, "The field `%s[%zu]` must be an object.", path, i);
            if (!json_is_object(fn))
                return pd_error(PD_EINVAL, "The field `%s[%zu].function` must be an object.", path,
                                i);
            return pd_error(PD_EINVAL, "The field `%s[%zu].function.name` must be a string.", path,
                            i);
        }
        json_t *f = json_object(), *t = json_object();
        const json_t *desc = json_object_get(fn, "description"),
                     *params = json_object_get(fn, "parameters");
        bool ok = f && t && json_object_set(f, "name", (json_t *)name) == 0 &&
                  json_object_set_new(f, "description",
                                      desc ? json_incref((json_t *)desc) : json_null()) == 0 &&
                  json_object_set_new(f, "parameters",
                                      params ? json_incref((json_t *)params) : json_null()) == 0;
        const char *key;
        json_t *val;
        json_object_foreach((json_t *)fn, key, val)
        {
            if (ok && strcmp(key, "name") && strcmp(key, "description") &&
                strcmp(key, "parameters"))
                ok = json_object_set(f, key, val) == 0;
        }
        ok = ok && json_object_set_new(t, "type", json_string("function")) == 0 &&
             json_object_set(t, "function", f) == 0;
        json_object_foreach((json_t *)tool, key, val)
        {
            if (ok && strcmp(key, "type") && strcmp(key, "function"))
                ok = json_object_set(t, key, val) == 0;
        }
        json_decref(f);
        if (!ok || json_array_append_new(arr, t) < 0) {
            if (!ok) json_decref(t);
            json_decref(arr);
            return pd_error(PD_ENOMEM, "out of memory");
        }
    }
    *out = arr;
    return 0;
}

/* ---- §13.1 selection --------------------------------------------------------------------- */

/* Reads a whole text file; PD_ENOTFOUND when it does not exist. */
static int read_text(const char *file, char **out)
{
    *out = NULL;
    FILE *f = fopen(file, "rb");
    if (!f) {
        if (errno == ENOENT) return pd_error(PD_ENOTFOUND, "%s: no such file", file);
        return pd_error(PD_EIO, "%s: %s", file, strerror(errno));
    }
    char *buf = NULL;
    size_t n = 0, cap = 0;
    int rc = 0;
    for (;;) {
        if (n + 4096 + 1 > cap) {
            cap = cap ? cap * 2 : 8192;
            char *nb = realloc(buf, cap);
            if (!nb) {
                rc = pd_error(PD_ENOMEM, "%s: out of memory", file);
                break;
            }
            buf = nb;
        }
        size_t k = fread(buf + n, 1, cap - n - 1, f);
        n += k;
        if (n > MAX_TEMPLATE_FILE) {
            rc = pd_error(PD_ERANGE, "%s: larger than %zu bytes", file, MAX_TEMPLATE_FILE);
            break;
        }
        if (k == 0) {
            if (ferror(f)) rc = pd_error(PD_EIO, "%s: read error", file);
            break;
        }
    }
    fclose(f);
    if (rc < 0) {
        free(buf);
        return rc;
    }
    buf[n] = 0;
    if (strlen(buf) != n) {
        free(buf);
        return pd_error(PD_EINVAL, "%s: contains a NUL byte", file);
    }
    *out = buf;
    return 0;
}

/* tokenizer_config.json as Hugging Face writes it: integers beyond int64 (model_max_length
 * is often 1e30) are read as reals instead of failing the whole file. */

static int set_what(char **what, const char *fmt, const char *a, const char *b)
{
    if (!what) return 0;
    size_t n = strlen(fmt) + strlen(a) + (b ? strlen(b) : 0) + 1;
    *what = malloc(n);
    if (!*what) return pd_error(PD_ENOMEM, "out of memory");
    snprintf(*what, n, fmt, a, b ? b : "");
    return 0;
}

static int dup_out(const char *s, char **out)
{
    *out = strdup(s);
    return *out ? 0 : pd_error(PD_ENOMEM, "out of memory");
}

int pd_chat_select(const char *model_dir, const char *override, bool has_tools, char **source,
                   char **what)
{
    *source = NULL;
    if (what) *what = NULL;
    int rc;
    if (override) {
        struct stat st;
        if (stat(override, &st) == 0 && S_ISREG(st.st_mode)) {
            PD_CHECK(read_text(override, source));
            rc = set_what(what, "%s%s", override, NULL);
            if (rc < 0) {
                free(*source);
                *source = NULL;
            }
            return rc;
        }
        if (strstr(override, "{{") || strstr(override, "{%")) {
            PD_CHECK(dup_out(override, source));
            rc = set_what(what, "--chat-template%s%s", "", NULL);
            if (rc < 0) {
                free(*source);
                *source = NULL;
            }
            return rc;
        }
        return pd_error(PD_EINVAL,
                        "--chat-template: '%s' is neither a readable file nor a template (it "
                        "contains no '{{' or '{%%')",
                        override);
    }
    if (!model_dir) return 0;
    char path[4096];
    snprintf(path, sizeof path, "%s/chat_template.jinja", model_dir);
    rc = read_text(path, source);
    if (rc == 0) {
        rc = set_what(what, "%s%s", path, NULL);
        if (rc < 0) {
            free(*source);
            *source = NULL;
        }
        return rc;
    }
    if (rc != PD_ENOTFOUND) return rc;
    pd_error_clear();
    snprintf(path, sizeof path, "%s/tokenizer_config.json", model_dir);
    struct stat st;
    if (stat(path, &st) != 0) return 0;
    json_t *cfg;
    PD_CHECK(pdj_load_file(path, &cfg));
    const json_t *ct = json_is_object(cfg) ? json_object_get(cfg, "chat_template") : NULL;
    const char *text = NULL, *name = NULL;
    rc = 0;
    if (!json_is_object(cfg)) {
        rc = pd_error(PD_EINVAL, "%s: expected a JSON object", path);
    } else if (!ct || json_is_null(ct)) {
        rc = 0;
    } else if (json_is_string(ct)) {
        text = json_string_value(ct);
    } else if (json_is_array(ct)) {
        const char *def = NULL, *tool = NULL;
        for (size_t i = 0; i < json_array_size(ct) && rc == 0; i++) {
            const json_t *e = json_array_get(ct, i);
            const json_t *nm = json_is_object(e) ? json_object_get(e, "name") : NULL;
            const json_t *tp = json_is_object(e) ? json_object_get(e, "template") : NULL;
            if (!json_is_string(nm) || !json_is_string(tp)) {
                rc = pd_error(PD_EINVAL,
                              "%s: chat_template[%zu]: expected an object with string name and "
                              "template",
                              path, i);
                break;
            }
            if (strcmp(json_string_value(nm), "default") == 0) def = json_string_value(tp);
            if (strcmp(json_string_value(nm), "tool_use") == 0) tool = json_string_value(tp);
        }
        if (rc == 0) {
            if (has_tools && tool) {
                text = tool;
                name = "tool_use";
            } else if (def) {
                text = def;
                name = "default";
            } else {
                rc =
                    pd_error(PD_EINVAL, "%s: chat_template: the list has no 'default' entry", path);
            }
        }
    } else {
        rc = pd_error(PD_EINVAL, "%s: chat_template: expected a string or a list, got %s", path,
                      pdj_type_name(ct));
    }
    if (rc == 0 && text) {
        rc = dup_out(text, source);
        if (rc == 0)
            rc = name ? set_what(what, "%s chat_template '%s'", path, name)
                      : set_what(what, "%s chat_template%s", path, NULL);
        if (rc < 0) {
            free(*source);
            *source = NULL;
        }
    }
    json_decref(cfg);
    return rc;
}

/* ---- §13.2 variables --------------------------------------------------------------------- */

static int token_string(const json_t *v, const char *key, json_t **out)
{
    *out = NULL;
    if (!v || json_is_null(v)) return 0;
    if (json_is_string(v)) {
        *out = json_incref((json_t *)v);
        return 0;
    }
    const json_t *c = json_is_object(v) ? json_object_get(v, "content") : NULL;
    if (json_is_string(c)) {
        *out = json_incref((json_t *)c);
        return 0;
    }
    return pd_error(PD_EINVAL,
                    "tokenizer_config.json: %s: expected a string or an object with a string "
                    "`content`",
                    key);
}

int pd_chat_config_vars(const json_t *tokenizer_config, json_t **out)
{
    *out = json_object();
    if (!*out) return pd_error(PD_ENOMEM, "out of memory");
    if (!tokenizer_config) return 0;
    if (!json_is_object(tokenizer_config)) {
        json_decref(*out);
        *out = NULL;
        return pd_error(PD_EINVAL, "tokenizer_config.json: expected a JSON object");
    }
    static const char *const keys[] = {"bos_token", "eos_token", "unk_token", "pad_token"};
    int rc = 0;
    for (size_t i = 0; i < 4 && rc == 0; i++) {
        json_t *s;
        rc = token_string(json_object_get(tokenizer_config, keys[i]), keys[i], &s);
        if (rc == 0 && s) json_object_set_new(*out, keys[i], s);
    }
    const json_t *extra = json_object_get(tokenizer_config, "additional_special_tokens");
    if (rc == 0 && extra && !json_is_null(extra)) {
        json_t *list = json_array();
        if (!json_is_array(extra))
            rc = pd_error(PD_EINVAL,
                          "tokenizer_config.json: additional_special_tokens: expected a list");
        for (size_t i = 0; rc == 0 && i < json_array_size(extra); i++) {
            json_t *s;
            char key[64];
            snprintf(key, sizeof key, "additional_special_tokens[%zu]", i);
            rc = token_string(json_array_get(extra, i), key, &s);
            if (rc == 0 && !s)
                rc = pd_error(PD_EINVAL, "tokenizer_config.json: %s: expected a string", key);
            if (rc == 0) json_array_append_new(list, s);
        }
        if (rc == 0)
            json_object_set_new(*out, "additional_special_tokens", list);
        else
            json_decref(list);
    }
    if (rc < 0) {
        json_decref(*out);
        *out = NULL;
    }
    return rc;
}

int pd_chat_build_vars(const json_t *config_vars, const json_t *messages, const json_t *tools,
                       const json_t *documents, bool add_generation_prompt,
                       const json_t *default_kwargs, const json_t *request_kwargs, json_t **out)
{
    *out = NULL;
    if (!json_is_array(messages))
        return pd_error(PD_EINVAL, "chat template: messages must be a list");
    if ((default_kwargs && !json_is_object(default_kwargs) && !json_is_null(default_kwargs)))
        return pd_error(PD_EINVAL, "--default-chat-template-kwargs: expected a JSON object");
    if ((request_kwargs && !json_is_object(request_kwargs) && !json_is_null(request_kwargs)))
        return pd_error(PD_EINVAL, "The field `chat_template_kwargs` must be an object.");
    json_t *v = json_object();
    if (!v) return pd_error(PD_ENOMEM, "out of memory");
    int bad = 0;
    if (json_is_object(config_vars)) bad |= json_object_update(v, (json_t *)config_vars);
    bad |= json_object_set_new(v, "tools", tools ? json_incref((json_t *)tools) : json_null());
    bad |= json_object_set_new(v, "documents",
                               documents ? json_incref((json_t *)documents) : json_null());
    bad |= json_object_set_new(v, "add_generation_prompt", json_boolean(add_generation_prompt));
    if (json_is_object(default_kwargs)) bad |= json_object_update(v, (json_t *)default_kwargs);
    if (json_is_object(request_kwargs)) bad |= json_object_update(v, (json_t *)request_kwargs);
    bad |= json_object_set(v, "messages", (json_t *)messages);
    if (bad) {
        json_decref(v);
        return pd_error(PD_ENOMEM, "out of memory");
    }
    *out = v;
    return 0;
}

/* ---- §13.6 continue_final_message -------------------------------------------------------- */

static size_t lstrip_off(const char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        uint32_t cp;
        bool valid;
        size_t k = pd_utf8_decode((const uint8_t *)s + i, n - i, &cp, &valid);
        if (!valid || !jinja_is_space(cp)) break;
        i += k;
    }
    return i;
}

static size_t rstrip_end(const char *s, size_t a, size_t n)
{
    while (n > a) {
        size_t st = n - 1;
        while (st > a && ((unsigned char)s[st] & 0xC0) == 0x80 && n - st < 4) st--;
        uint32_t cp;
        bool valid;
        pd_utf8_decode((const uint8_t *)s + st, n - st, &cp, &valid);
        if (!valid || !jinja_is_space(cp)) break;
        n = st;
    }
    return n;
}

int pd_chat_continue_final(char *rendered, const char *final_content, size_t *len)
{
    size_t rn = strlen(rendered), fn = strlen(final_content);
    size_t a = lstrip_off(final_content, fn), b = rstrip_end(final_content, a, fn);
    const char *stripped = final_content + a;
    size_t sn = b - a;
    /* last occurrence of the stripped text */
    size_t loc = SIZE_MAX;
    if (sn == 0)
        loc = rn;
    else
        for (size_t i = rn >= sn ? rn - sn + 1 : 0; i-- > 0;)
            if (memcmp(rendered + i, stripped, sn) == 0) {
                loc = i;
                break;
            }
    if (loc == SIZE_MAX)
        return pd_error(PD_EINVAL, "continue_final_message is set but the final message does not "
                                   "appear in the chat after applying the chat template!");
    size_t lstripped_len = fn - a, cut;
    if (loc + lstripped_len <= rn && lstripped_len == fn &&
        memcmp(rendered + loc, final_content, fn) == 0)
        cut = loc + lstripped_len;
    else
        cut = loc + sn;
    rendered[cut] = 0;
    if (len) *len = cut;
    return 0;
}
