/* Golden test: every template of tests/data/chat/cases.json x every conversation, rendered
 * by the C interpreter, must equal python3-jinja2 configured as Hugging Face's
 * apply_chat_template (tests/reference/chat_ref.py) byte for byte.
 *
 * Two references: the committed tests/data/chat/goldens.json (always; the command that made
 * it is in chat_ref.py's docstring) and, when /usr/bin/python3 has jinja2, chat_ref.py run
 * live on the same cases (which also catches stale goldens). The C side goes through the
 * public API the scheduler uses: pd_chat_select (--chat-template FILE), pd_chat_config_vars,
 * pd_chat_normalize_messages/_tools, pd_chat_build_vars, pd_chat_render_at and
 * pd_chat_continue_final.
 */
#include "harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "json/json.h"
#include "tokenizer/chat_template.h"

static char cases_path[1024];

/* Renders one case through the public API; fills *text or the status and message. */
static int render_case(const char *file, const json_t *config, const json_t *conv, int64_t now,
                       char **text, char *msg, size_t msg_n)
{
    char *source = NULL, *what = NULL;
    pd_chat_template *t = NULL;
    json_t *cvars = NULL, *msgs = NULL, *tools = NULL, *vars = NULL;
    *text = NULL;
    int rc = pd_chat_select(NULL, file, false, &source, &what);
    if (rc == 0) rc = pd_chat_compile(source, what, &t);
    if (rc == 0) rc = pd_chat_config_vars(config, &cvars);
    if (rc == 0)
        rc = pd_chat_normalize_messages(json_object_get(conv, "messages"), "messages", &msgs);
    const json_t *rt = json_object_get(conv, "tools");
    if (rc == 0 && rt && !json_is_null(rt)) rc = pd_chat_normalize_tools(rt, "tools", &tools);
    bool cont = json_is_true(json_object_get(conv, "continue_final_message"));
    const json_t *agp = json_object_get(conv, "add_generation_prompt");
    bool add_gen = cont ? false : (agp ? json_is_true(agp) : true);
    if (rc == 0)
        rc = pd_chat_build_vars(cvars, msgs, tools, json_object_get(conv, "documents"), add_gen,
                                json_object_get(conv, "default_kwargs"),
                                json_object_get(conv, "kwargs"), &vars);
    if (rc == 0) rc = pd_chat_render_at(t, vars, now, text, NULL);
    if (rc == 0 && cont) {
        const json_t *last = json_array_get(msgs, json_array_size(msgs) - 1);
        rc = pd_chat_continue_final(*text, json_string_value(json_object_get(last, "content")),
                                    NULL);
    }
    if (rc < 0) {
        snprintf(msg, msg_n, "%s", pd_last_error());
        free(*text);
        *text = NULL;
    }
    free(source);
    free(what);
    pd_chat_free(t);
    json_decref(cvars);
    json_decref(msgs);
    json_decref(tools);
    json_decref(vars);
    return rc;
}

/* Describes the first difference between two texts. */
static void diff(const char *want, const char *got, char *buf, size_t n)
{
    size_t i = 0;
    while (want[i] && want[i] == got[i]) i++;
    size_t from = i > 40 ? i - 40 : 0;
    snprintf(buf, n, "first difference at byte %zu:\n  want ...%.80s\n  got  ...%.80s", i,
             want + from, got + from);
}

/* Compares every case with the expected results object; returns the number of failures. */
static int compare_all(const json_t *cases, const json_t *expected, const char *label)
{
    char base[1024];
    snprintf(base, sizeof base, "%s", cases_path);
    char *slash = strrchr(base, '/');
    if (slash) *slash = 0;
    int64_t now = json_integer_value(json_object_get(cases, "now"));
    const json_t *templates = json_object_get(cases, "templates");
    const json_t *convs = json_object_get(cases, "conversations");
    int failures = 0, total = 0;
    for (size_t i = 0; i < json_array_size(templates); i++) {
        const json_t *tp = json_array_get(templates, i);
        const char *name = json_string_value(json_object_get(tp, "name"));
        char file[2048];
        snprintf(file, sizeof file, "%s/%s", base, json_string_value(json_object_get(tp, "file")));
        for (size_t j = 0; j < json_array_size(convs); j++) {
            const json_t *conv = json_array_get(convs, j);
            char key[512];
            snprintf(key, sizeof key, "%s/%s", name,
                     json_string_value(json_object_get(conv, "name")));
            const json_t *want = json_object_get(expected, key);
            total++;
            if (!want) {
                printf("  %s: %s: no expected result\n", label, key);
                failures++;
                continue;
            }
            char *text, msg[1024] = "";
            int rc =
                render_case(file, json_object_get(tp, "config"), conv, now, &text, msg, sizeof msg);
            const json_t *wt = json_object_get(want, "text"), *wr = json_object_get(want, "raise");
            char d[512];
            if (wt) {
                if (rc < 0) {
                    printf("  %s: %s: expected text, got error %s: %s\n", label, key,
                           pd_status_name(rc), msg);
                    failures++;
                } else if (strcmp(text, json_string_value(wt)) != 0) {
                    diff(json_string_value(wt), text, d, sizeof d);
                    printf("  %s: %s: rendering differs; %s\n", label, key, d);
                    failures++;
                }
            } else if (wr) {
                if (rc != PD_CHAT_ERAISED || strcmp(msg, json_string_value(wr)) != 0) {
                    printf("  %s: %s: expected raise_exception(\"%s\"), got %s \"%s\"\n", label,
                           key, json_string_value(wr), rc ? pd_status_name(rc) : "text", msg);
                    failures++;
                }
            } else if (rc != PD_CHAT_ERENDER) {
                printf("  %s: %s: expected a template error, got %s %s\n", label, key,
                       rc ? pd_status_name(rc) : "text", msg);
                failures++;
            }
            free(text);
        }
    }
    printf("  %s: %d of %d renderings match\n", label, total - failures, total);
    return failures;
}

static int setup(json_t **cases)
{
    snprintf(cases_path, sizeof cases_path, "%s/chat/cases.json", pdt_data_dir());
    return pdj_load_file(cases_path, cases);
}

TEST(chat_golden_committed)
{
    setenv("TZ", "UTC", 1);
    tzset();
    json_t *cases, *goldens;
    ASSERT_OK(setup(&cases));
    char path[1100];
    snprintf(path, sizeof path, "%s/chat/goldens.json", pdt_data_dir());
    ASSERT_OK(pdj_load_file(path, &goldens));
    int failures = compare_all(cases, goldens, "goldens.json");
    json_decref(cases);
    json_decref(goldens);
    ASSERT_MSG(failures == 0, "%d renderings differ from tests/data/chat/goldens.json", failures);
}

TEST(chat_golden_live_python)
{
    setenv("TZ", "UTC", 1);
    tzset();
    const char *root = getenv("PD_SOURCE_ROOT");
    if (!root) SKIP("PD_SOURCE_ROOT not set");
    if (system("/usr/bin/python3 -c 'import jinja2' >/dev/null 2>&1") != 0)
        SKIP("/usr/bin/python3 with jinja2 not available");
    json_t *cases;
    ASSERT_OK(setup(&cases));
    char cmd[3000];
    snprintf(cmd, sizeof cmd, "TZ=UTC /usr/bin/python3 '%s/tests/reference/chat_ref.py' '%s'", root,
             cases_path);
    FILE *p = popen(cmd, "r");
    ASSERT(p);
    size_t cap = 1 << 20, n = 0;
    char *buf = malloc(cap);
    ASSERT(buf);
    for (size_t k; (k = fread(buf + n, 1, cap - n - 1, p)) > 0;) {
        n += k;
        if (n + 1 >= cap) {
            cap *= 2;
            char *nb = realloc(buf, cap);
            ASSERT(nb);
            buf = nb;
        }
    }
    int status = pclose(p);
    ASSERT_MSG(status == 0, "chat_ref.py failed (status %d)", status);
    json_t *live;
    int rc = pdj_loads(buf, n, "chat_ref.py output", &live);
    free(buf);
    ASSERT_OK(rc);
    int failures = compare_all(cases, live, "live chat_ref.py");
    /* the committed goldens must be what the reference produces today */
    char path[1100];
    snprintf(path, sizeof path, "%s/chat/goldens.json", pdt_data_dir());
    json_t *goldens;
    ASSERT_OK(pdj_load_file(path, &goldens));
    bool same = json_equal(goldens, live);
    json_decref(goldens);
    json_decref(live);
    json_decref(cases);
    ASSERT_MSG(failures == 0, "%d renderings differ from the live Python reference", failures);
    ASSERT_MSG(same, "tests/data/chat/goldens.json is stale: regenerate it (see chat_ref.py)");
}

/* The int and float filters on strings, against python3-jinja2 3.1 (expected values rendered
 * there): int(value, base), else int(float(value)), else the default, with Python's literals,
 * not C's: no hex float through strtod ("0x10" is 0 in base 10), underscores only between
 * digits. Regression: '0x10'|int gave 16. */
TEST(chat_jinja_int_float_filters)
{
    static const struct {
        const char *expr, *want;
    } cases[] = {
        {"'0x10'|int", "0"},       {"'0x10'|int(base=16)", "16"},
        {"'0x10'|int(7)", "7"},    {"'10'|int(base=16)", "16"},
        {"' 12 '|int", "12"},      {"'+7'|int", "7"},
        {"'- 7'|int", "0"},        {"'1_000'|int", "1000"},
        {"'1__000'|int", "0"},     {"'_1'|int", "0"},
        {"'1_'|int", "0"},         {"'42.23'|int", "42"},
        {"'1.'|int", "1"},         {"'1e3'|int", "1000"},
        {"'-1.5e2'|int", "-150"},  {"'1_0.5'|int", "10"},
        {"'0x1p3'|int", "0"},      {"'nan'|int", "0"},
        {"'inf'|int", "0"},        {"'1e400'|int", "0"},
        {"'1 2'|int", "0"},        {"'0x10'|float", "0.0"},
        {"'0x1p3'|float", "0.0"},  {"'1_000'|float", "1000.0"},
        {"'1.5_0'|float", "1.5"},  {"'1e_5'|float", "0.0"},
        {"' 2.5 '|float", "2.5"},  {"'.5'|float", "0.5"},
        {"'1e3'|float", "1000.0"}, {"'infinity'|float", "inf"},
        {"'-inf'|float", "-inf"},  {"'nan'|float", "nan"},
        {"'nan(1)'|float", "0.0"}, {"'x'|float(2.5)", "2.5"},
    };
    int failures = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char src[128];
        snprintf(src, sizeof src, "{{ %s }}", cases[i].expr);
        pd_chat_template *t = NULL;
        json_t *vars = json_object();
        char *out = NULL;
        int rc = pd_chat_compile(src, "filter test", &t);
        if (rc == 0) rc = pd_chat_render_at(t, vars, 0, &out, NULL);
        if (rc < 0 || strcmp(out, cases[i].want) != 0) {
            printf("  %s: want %s, got %s\n", cases[i].expr, cases[i].want,
                   rc < 0 ? pd_last_error() : out);
            failures++;
        }
        free(out);
        json_decref(vars);
        pd_chat_free(t);
    }
    ASSERT_MSG(failures == 0, "%d of the filter cases differ from jinja2", failures);
}
