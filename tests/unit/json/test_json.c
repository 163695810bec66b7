/* Unit tests: typed JSON getters, path messages, parse errors, dumping. */
#include "harness.h"

#include <stdlib.h>

#include "json/json.h"

static json_t *parse(const char *s)
{
    json_t *v = NULL;
    if (pdj_loads(s, strlen(s), "test", &v) < 0) return NULL;
    return v;
}

TEST(json_paths)
{
    char a[64], b[64];
    ASSERT_STR_EQ(pdj_path_key(a, sizeof a, "", "model"), "model");
    ASSERT_STR_EQ(pdj_path_index(b, sizeof b, "messages", 2), "messages[2]");
    ASSERT_STR_EQ(pdj_path_key(a, sizeof a, b, "content"), "messages[2].content");
}

TEST(json_int_accepts_integer_valued_float)
{
    json_t *o = parse("{\"a\": 5, \"b\": 3.0, \"c\": 3.5, \"d\": \"7\", \"e\": 1e300}");
    ASSERT(o);
    int64_t v;
    ASSERT_EQ_INT(pdj_get_int(o, "", "a", PDJ_REQUIRED, &v), 1);
    ASSERT_EQ_INT(v, 5);
    ASSERT_EQ_INT(pdj_get_int(o, "", "b", PDJ_REQUIRED, &v), 1);
    ASSERT_EQ_INT(v, 3);
    ASSERT_ERR(pdj_get_int(o, "", "c", 0, &v), PD_EINVAL, "c: expected integer, got 3.5");
    ASSERT_ERR(pdj_get_int(o, "", "d", 0, &v), PD_EINVAL, "d: expected integer, got string");
    ASSERT_ERR(pdj_get_int(o, "", "e", 0, &v), PD_EINVAL, "e: expected integer");
    json_decref(o);
}

TEST(json_missing_required_and_optional)
{
    json_t *o = parse("{\"x\": null}");
    int64_t v = 99;
    ASSERT_EQ_INT(pdj_get_int(o, "req", "y", PDJ_OPTIONAL, &v), 0);
    ASSERT_EQ_INT(v, 99);
    ASSERT_ERR(pdj_get_int(o, "req", "y", PDJ_REQUIRED, &v), PD_EINVAL, "req.y: required");
    /* null: absent only when asked */
    ASSERT_EQ_INT(pdj_get_int(o, "", "x", PDJ_NULL_IS_ABSENT, &v), 0);
    ASSERT_ERR(pdj_get_int(o, "", "x", 0, &v), PD_EINVAL, "x: expected integer, got null");
    ASSERT_ERR(pdj_get_int(o, "", "x", PDJ_REQUIRED | PDJ_NULL_IS_ABSENT, &v), PD_EINVAL,
               "x: required");
    json_decref(o);
}

TEST(json_double_and_range)
{
    json_t *o = parse("{\"t\": 0.7, \"i\": 2, \"big\": 5}");
    double d;
    ASSERT_EQ_INT(pdj_get_double(o, "", "t", 0, &d), 1);
    ASSERT_NEAR(d, 0.7, 1e-15);
    ASSERT_EQ_INT(pdj_get_double(o, "", "i", 0, &d), 1); /* integers are numbers */
    ASSERT_NEAR(d, 2.0, 0);
    ASSERT_ERR(pdj_get_double_range(o, "", "t", 0, 1.0, 2.0, &d), PD_EINVAL,
               "t: must be between 1 and 2, got 0.7");
    int64_t v;
    ASSERT_ERR(pdj_get_int_range(o, "opts", "big", 0, 0, 4, &v), PD_EINVAL,
               "opts.big: must be between 0 and 4, got 5");
    ASSERT_EQ_INT(pdj_get_int_range(o, "", "i", 0, 0, 4, &v), 1);
    ASSERT_EQ_INT(v, 2);
    json_decref(o);
}

TEST(json_rejects_nan_and_inf)
{
    json_t *v = json_real(NAN);
    /* jansson refuses to build a NaN real; a hand-made inf must also be refused */
    ASSERT(v == NULL);
    json_t *o = json_object();
    json_object_set_new(o, "x", json_real(1.0));
    double d;
    ASSERT_EQ_INT(pdj_get_double(o, "", "x", 0, &d), 1);
    json_decref(o);
    /* overflowing literal is a parse error, never an infinity */
    json_t *bad = NULL;
    const char *s = "{\"x\": 1e999}";
    ASSERT_EQ_INT(pdj_loads(s, strlen(s), "body", &bad), PD_EPARSE);
    ASSERT_CONTAINS(pd_last_error(), "body: line 1");
}

TEST(json_bool_and_string)
{
    json_t *o = parse("{\"s\": true, \"n\": \"hi\", \"k\": 1}");
    bool b = false;
    const char *str = NULL;
    ASSERT_EQ_INT(pdj_get_bool(o, "", "s", 0, &b), 1);
    ASSERT(b);
    ASSERT_ERR(pdj_get_bool(o, "", "k", 0, &b), PD_EINVAL, "k: expected boolean, got integer");
    ASSERT_EQ_INT(pdj_get_string(o, "", "n", 0, &str), 1);
    ASSERT_STR_EQ(str, "hi");
    ASSERT_ERR(pdj_get_string(o, "messages[2]", "s", 0, &str), PD_EINVAL,
               "messages[2].s: expected string, got boolean");
    json_decref(o);
}

TEST(json_nested_path_message)
{
    json_t *o = parse("{\"messages\": [{\"role\": \"user\", \"content\": \"a\"},"
                      " {\"role\": \"user\", \"content\": \"b\"},"
                      " {\"role\": \"user\", \"content\": 5}]}");
    json_t *msgs;
    ASSERT_EQ_INT(pdj_get_array(o, "", "messages", PDJ_REQUIRED, &msgs), 1);
    char p[64];
    const char *content = NULL;
    for (size_t i = 0; i < 2; i++)
        ASSERT_EQ_INT(pdj_get_string(json_array_get(msgs, i),
                                     pdj_path_index(p, sizeof p, "messages", i), "content",
                                     PDJ_REQUIRED, &content),
                      1);
    ASSERT_ERR(pdj_get_string(json_array_get(msgs, 2), pdj_path_index(p, sizeof p, "messages", 2),
                              "content", PDJ_REQUIRED, &content),
               PD_EINVAL, "messages[2].content: expected string, got integer");
    json_decref(o);
}

TEST(json_container_types)
{
    json_t *o = parse("{\"a\": [1], \"o\": {}, \"s\": \"x\"}");
    json_t *v;
    ASSERT_EQ_INT(pdj_get_array(o, "", "a", 0, &v), 1);
    ASSERT_EQ_INT(pdj_get_object(o, "", "o", 0, &v), 1);
    ASSERT_ERR(pdj_get_object(o, "", "s", 0, &v), PD_EINVAL, "s: expected object, got string");
    ASSERT_ERR(pdj_get_array(o, "", "o", 0, &v), PD_EINVAL, "o: expected array, got object");
    /* the container itself must be an object */
    ASSERT_ERR(pdj_get_array(json_object_get(o, "a"), "a", "x", 0, &v), PD_EINVAL,
               "a: expected object, got array");
    json_decref(o);
}

TEST(json_parse_error_line_column)
{
    json_t *v = NULL;
    const char *s = "{\n  \"a\": 1,\n  \"b\": ]\n}";
    ASSERT_EQ_INT(pdj_loads(s, strlen(s), "request body", &v), PD_EPARSE);
    ASSERT_CONTAINS(pd_last_error(), "request body: line 3 column");
    ASSERT(v == NULL);
}

/* An integer beyond int64 (Python reads it; a JSON Schema bound) is read as a real; the
 * document's other integers stay integers, also at the top level. */
TEST(json_loadb_reads_big_integers_as_reals)
{
    const char *s = "{\"maximum\": 9223372036854776000, \"maxLength\": 3, \"x\": 2.5, "
                    "\"a\": [1, -18446744073709551616, {\"n\": 7}]}";
    json_error_t e;
    json_t *v = pdj_loadb(s, strlen(s), 0, &e);
    ASSERT(v);
    ASSERT(json_is_real(json_object_get(v, "maximum")));
    ASSERT(json_real_value(json_object_get(v, "maximum")) == 9223372036854776000.0);
    ASSERT(json_is_integer(json_object_get(v, "maxLength")));
    ASSERT(json_is_real(json_object_get(v, "x")));
    const json_t *a = json_object_get(v, "a");
    ASSERT(json_is_integer(json_array_get(a, 0)));
    ASSERT(json_is_real(json_array_get(a, 1)));
    ASSERT_EQ_INT(json_integer_value(json_object_get(json_array_get(a, 2), "n")), 7);
    json_decref(v);
    v = pdj_loadb("[1", 2, 0, &e); /* any other error is still one */
    ASSERT(!v);
    v = pdj_loadb("12345678901234567890", 20, JSON_DECODE_ANY, &e);
    ASSERT(json_is_real(v));
    json_decref(v);
}

TEST(json_duplicate_keys_last_wins_in_bodies_rejected_in_files)
{
    json_t *v = NULL;
    const char *s = "{\"a\": 1, \"a\": 2}";
    ASSERT_OK(pdj_loads(s, strlen(s), "x", &v));
    ASSERT_EQ_INT(json_integer_value(json_object_get(v, "a")), 2);
    json_decref(v);
    char path[512];
    snprintf(path, sizeof path, "%s/dup.json", pdt_tmp_dir());
    FILE *f = fopen(path, "w");
    fputs(s, f);
    fclose(f);
    v = NULL;
    ASSERT_EQ_INT(pdj_load_file(path, &v), PD_EPARSE);
    ASSERT_CONTAINS(pd_last_error(), "duplicate");
    ASSERT(v == NULL);
}

TEST(json_file_roundtrip)
{
    char path[512];
    snprintf(path, sizeof path, "%s/rt.json", pdt_tmp_dir());
    json_t *o = json_pack("{s:s, s:f, s:[i,i]}", "version", "1.0", "t", 0.7, "ids", 1, 2);
    ASSERT_OK(pdj_dump_file(o, path, 4));
    json_t *back = NULL;
    ASSERT_OK(pdj_load_file(path, &back));
    ASSERT(json_equal(o, back));
    char *s = pdj_dumps(back);
    ASSERT_CONTAINS(s, "0.7");
    ASSERT(strstr(s, "0.69999") == NULL);
    free(s);
    json_decref(o);
    json_decref(back);
}

TEST(json_file_errors_name_the_file)
{
    json_t *v = NULL;
    ASSERT_ERR(pdj_load_file("/nonexistent/x.json", &v), PD_ENOTFOUND, "/nonexistent/x.json");
    char path[512];
    snprintf(path, sizeof path, "%s/bad.json", pdt_tmp_dir());
    FILE *f = fopen(path, "w");
    fputs("{\"a\": [1, 2,}\n", f);
    fclose(f);
    ASSERT_EQ_INT(pdj_load_file(path, &v), PD_EPARSE);
    ASSERT_CONTAINS(pd_last_error(), path);
    ASSERT_CONTAINS(pd_last_error(), "line 1 column");
}

TEST(json_type_names)
{
    json_t *o = parse("[1, 1.5, \"s\", true, null, {}, []]");
    const char *want[] = {"integer", "number", "string", "boolean", "null", "object", "array"};
    for (size_t i = 0; i < 7; i++) ASSERT_STR_EQ(pdj_type_name(json_array_get(o, i)), want[i]);
    json_decref(o);
}

TEST(json_file_with_huge_integer_reads_reals)
{
    char path[512];
    snprintf(path, sizeof path, "%s/huge.json", pdt_tmp_dir());
    FILE *f = fopen(path, "w");
    fputs("{\"model_max_length\": 1000000000000000019884624838656, \"n\": 7}", f);
    fclose(f);
    json_t *v = NULL;
    ASSERT_OK(pdj_load_file(path, &v));
    int64_t n;
    ASSERT_EQ_INT(pdj_get_int(v, "", "n", PDJ_REQUIRED, &n), 1);
    ASSERT_EQ_INT(n, 7);
    double big;
    ASSERT_EQ_INT(pdj_get_double(v, "", "model_max_length", PDJ_REQUIRED, &big), 1);
    ASSERT(big > 1e29);
    json_decref(v);
}
