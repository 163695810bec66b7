/* common/grammar: regex, JSON Schema (acceptance and refusals), choice, EBNF, masks against a
 * brute-force check on a small vocabulary and on the Llama-3 tokenizer of the npm cache. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "grammar/grammar.h"
#include "util/clock.h"
#include "harness.h"
#include "tokenizer/tokenizer.h"

/* ---- a small vocabulary -------------------------------------------------------------------- */
static const char *const SMALL[] = {"{",     "}",      "[",
                                    "]",     ":",      ",",
                                    "\"",    " ",      "\n",
                                    "\t",    "a",      "b",
                                    "c",     "x",      "y",
                                    "z",     "0",      "1",
                                    "2",     "9",      "-",
                                    ".",     "e",      "+",
                                    "\\",    "n",      "u",
                                    "t",     "r",      "l",
                                    "s",     "f",      "{\"",
                                    "\":",   "\",",    "\"}",
                                    "\": ",  ", \"",   "true",
                                    "false", "null",   "12",
                                    "abc",   "\"a",    "  ",
                                    "}\n",   "\"]",    "[\"",
                                    "ab",    "ba",     "1.",
                                    ".5",    "e+",     "\xc3\xa9",
                                    "\xc3",  "\xa9",   "\xe2\x82\xac",
                                    "-1",    "00",     "name",
                                    "age",   "\"name", "\"age\":",
                                    "foo",   "bar",    "baz",
                                    "yes",   "no",     "_",
                                    "/",     "A",      "Z",
                                    "@",     "#",      "2023",
                                    "-01",   "T",      "Z\"",
                                    "12:",   "30:",    "00\"",
                                    NULL};
static pd_gvocab *g_small;
static int32_t g_small_eos;

static pd_gvocab *small_vocab(void)
{
    if (g_small) return g_small;
    /* the list above, then every printable ASCII byte (so no walk is stuck for want of a
     * token), then EOS and a special token */
    static char ascii[95][2];
    int n0 = 0;
    while (SMALL[n0]) n0++;
    int n = n0 + 95;
    const uint8_t **b = calloc((size_t)n + 2, sizeof *b);
    uint32_t *l = calloc((size_t)n + 2, sizeof *l);
    bool *sp = calloc((size_t)n + 2, sizeof *sp);
    for (int i = 0; i < n0; i++) {
        b[i] = (const uint8_t *)SMALL[i];
        l[i] = (uint32_t)strlen(SMALL[i]);
    }
    for (int i = 0; i < 95; i++) {
        ascii[i][0] = (char)(0x20 + i);
        b[n0 + i] = (const uint8_t *)ascii[i];
        l[n0 + i] = 1;
    }
    b[n] = (const uint8_t *)"<eos>";
    l[n] = 5;
    b[n + 1] = (const uint8_t *)"<pad>";
    l[n + 1] = 5;
    sp[n + 1] = true;
    g_small_eos = n;
    if (pd_gvocab_create(n + 2, b, l, sp, &g_small_eos, 1, &g_small) < 0) g_small = NULL;
    free(b);
    free(l);
    free(sp);
    return g_small;
}

static pd_grammar *compile(pd_gvocab *v, pd_gspec_kind kind, const char *text, pd_gerr *err)
{
    pd_gspec s = {kind, text, text ? strlen(text) : 0, NULL, false};
    pd_grammar *g = NULL;
    pd_gerr e;
    if (pd_grammar_compile(v, &s, &g, err ? err : &e) < 0) return NULL;
    return g;
}

/* whole text accepted (bytes) and then accepting */
static int accepts(pd_grammar *g, const char *text)
{
    pd_gmatcher *m;
    if (pd_gmatcher_create(g, &m) < 0) return -1;
    int ok = pd_gmatcher_accept_bytes(m, text, strlen(text)) == 0 && pd_gmatcher_is_accepting(m);
    pd_gmatcher_free(m);
    return ok;
}

/* byte-at-a-time as well (the two must agree) */
static int accepts_bytewise(pd_grammar *g, const char *text)
{
    pd_gmatcher *m;
    if (pd_gmatcher_create(g, &m) < 0) return -1;
    int ok = 1;
    for (size_t i = 0; text[i] && ok; i++) ok = pd_gmatcher_accept_bytes(m, text + i, 1) == 0;
    ok = ok && pd_gmatcher_is_accepting(m);
    pd_gmatcher_free(m);
    return ok;
}

#define ACCEPT(g, t)                                                                               \
    ASSERT_MSG(accepts(g, t) == 1 && accepts_bytewise(g, t) == 1, "should accept: %s", t)
#define REJECT(g, t)                                                                               \
    ASSERT_MSG(accepts(g, t) == 0 && accepts_bytewise(g, t) == 0, "should reject: %s", t)

/* ---- regex ---------------------------------------------------------------------------------- */
TEST(regex_basics)
{
    pd_gvocab *v = small_vocab();
    ASSERT(v);
    pd_grammar *g = compile(v, PD_GSPEC_REGEX, "ab*c|x{2,3}|[0-9]+(\\.[0-9]{1,2})?", NULL);
    ASSERT(g);
    ACCEPT(g, "ac");
    ACCEPT(g, "abbbc");
    ACCEPT(g, "xx");
    ACCEPT(g, "xxx");
    REJECT(g, "xxxx");
    REJECT(g, "x");
    ACCEPT(g, "12.5");
    ACCEPT(g, "0.25");
    REJECT(g, "0.255");
    REJECT(g, "abcd");
    pd_grammar_unref(g);
    g = compile(v, PD_GSPEC_REGEX, "^[^a-c\\d]\\w\\s(?:yes|no)\\.$", NULL);
    ASSERT(g);
    ACCEPT(g, "x_ yes.");
    ACCEPT(g, "\xc3\xa9Z\tno.");
    REJECT(g, "a_ yes.");
    REJECT(g, "5_ yes.");
    REJECT(g, "xx yes!");
    pd_grammar_unref(g);
    g = compile(v, PD_GSPEC_REGEX, "(\\u00e9|\\x41|[\\u20ac-\\u20ad])+.", NULL);
    ASSERT(g);
    ACCEPT(g, "\xc3\xa9"
              "A\xe2\x82\xac!");
    REJECT(g, "\xc3\xa9\n");
    REJECT(g, "\xc3");
    pd_grammar_unref(g);
}

TEST(regex_refusals_name_the_position)
{
    pd_gvocab *v = small_vocab();
    const char *bad[] = {"a(?=b)", "(a)\\1", "\\bword", "a{3,2}", "(ab", "a)",
                         "[abc",   "a++",    "x^y",     "a$b",    "*a"};
    long pos[] = {1, 3, 0, 1, 0, 1, 0, 2, 1, 1, 0};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        pd_gerr e;
        pd_grammar *g = compile(v, PD_GSPEC_REGEX, bad[i], &e);
        ASSERT_MSG(!g, "should refuse %s", bad[i]);
        ASSERT_MSG(e.pos == pos[i], "%s: pos %ld, want %ld (%s)", bad[i], e.pos, pos[i], e.msg);
        ASSERT_CONTAINS(e.msg, "position");
    }
}

/* ---- JSON Schema ---------------------------------------------------------------------------- */
TEST(schema_object_properties)
{
    pd_gvocab *v = small_vocab();
    pd_grammar *g =
        compile(v, PD_GSPEC_JSON_SCHEMA,
                "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},"
                "\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":150},"
                "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"},\"maxItems\":2}},"
                "\"required\":[\"name\"],\"additionalProperties\":false}",
                NULL);
    ASSERT(g);
    ACCEPT(g, "{\"name\":\"bob\"}");
    ACCEPT(g, "{\"name\": \"bob\", \"age\": 42}");
    ACCEPT(g, "{ \"name\" : \"b\\\"o\\u00e9b\" ,\n \"age\":150,\"tags\":[\"a\",\"b\"]}");
    ACCEPT(g, "{\"name\":\"\",\"tags\":[]}");
    REJECT(g, "{\"age\":1}");                                   /* name required */
    REJECT(g, "{\"name\":\"x\",\"age\":151}");                  /* maximum */
    REJECT(g, "{\"name\":\"x\",\"age\":-1}");                   /* minimum */
    REJECT(g, "{\"name\":\"x\",\"age\":1.5}");                  /* integer */
    REJECT(g, "{\"name\":\"x\",\"other\":1}");                  /* additionalProperties */
    REJECT(g, "{\"name\":\"x\",\"tags\":[\"a\",\"b\",\"c\"]}"); /* maxItems */
    REJECT(g, "{\"name\":\"x\",}");
    REJECT(g, "{\"name\":\"x\"} ");
    pd_grammar_unref(g);
}

/* The property order of merged schemas (docs/structured_output.md), which pd-maskbench writes
 * its instances in: the object's properties, then a branch's (anyOf/oneOf, through allOf and
 * $ref, dependentSchemas), then required names none of them lists, then additional keys. */
TEST(schema_property_order_of_merges)
{
    pd_gvocab *v = small_vocab();
    struct {
        const char *schema, *yes, *no;
    } cases[] = {
        {"{\"type\":\"object\",\"required\":[\"a\"],\"anyOf\":[{\"properties\":{\"b\":{},\"a\":{}}}"
         "]}",
         "{\"b\":1,\"a\":2}", "{\"a\":2,\"b\":1}"},
        {"{\"$defs\":{\"r\":{\"properties\":{\"r\":{},\"t\":{\"const\":\"y\"}}}},\"oneOf\":[{"
         "\"properties\":{\"t\":{\"const\":\"x\"}}},{\"allOf\":[{\"$ref\":\"#/$defs/r\"}]}]}",
         "{\"r\":1,\"t\":\"y\"}", "{\"t\":\"y\",\"r\":1}"},
        {"{\"allOf\":[{\"properties\":{\"h\":{}}},{\"type\":\"object\",\"required\":[\"t\"]}]}",
         "{\"h\":1,\"t\":2,\"z\":3}", "{\"h\":1,\"z\":3,\"t\":2}"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{}},\"dependentSchemas\":{\"a\":{"
         "\"properties\":{\"d\":{}}}}}",
         "{\"a\":1,\"d\":2,\"z\":3}", "{\"a\":1,\"z\":3,\"d\":2}"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        pd_gerr e;
        pd_grammar *g = compile(v, PD_GSPEC_JSON_SCHEMA, cases[i].schema, &e);
        ASSERT_MSG(g, "%s: %s", cases[i].schema, e.msg);
        ASSERT_MSG(accepts(g, cases[i].yes) == 1, "%s should accept %s", cases[i].schema,
                   cases[i].yes);
        ASSERT_MSG(accepts(g, cases[i].no) == 0, "%s should reject %s", cases[i].schema,
                   cases[i].no);
        pd_grammar_unref(g);
    }
}

TEST(schema_additional_properties_default_and_keys)
{
    pd_gvocab *v = small_vocab();
    pd_grammar *g = compile(v, PD_GSPEC_JSON_SCHEMA,
                            "{\"properties\":{\"a\":{\"type\":\"integer\"}},"
                            "\"additionalProperties\":{\"type\":\"boolean\"}}",
                            NULL);
    ASSERT(g);
    ACCEPT(g, "{}");
    ACCEPT(g, "{\"a\":1,\"b\":true,\"ab\":false}");
    ACCEPT(g, "{\"b\":true}");
    REJECT(g, "{\"a\":1,\"a\":true}"); /* a listed name is not an additional property */
    REJECT(g, "{\"b\":1}");
    ACCEPT(g, "\"just a string\""); /* no type: other types are unconstrained */
    pd_grammar_unref(g);
}

TEST(schema_pattern_properties_and_property_counts)
{
    pd_gvocab *v = small_vocab();
    pd_grammar *g = compile(v, PD_GSPEC_JSON_SCHEMA,
                            "{\"type\":\"object\",\"properties\":{\"x1\":{\"type\":\"string\"}},"
                            "\"patternProperties\":{\"^x\":{\"type\":\"integer\"},"
                            "\"1$\":{\"minimum\":0}},"
                            "\"additionalProperties\":{\"type\":\"boolean\"}}",
                            NULL);
    ASSERT(g);
    ACCEPT(g, "{}");
    ACCEPT(g, "{\"xa\":-5,\"b\":true,\"b1\":3}");
    ACCEPT(g, "{\"x2\":-5,\"x11\":4}");
    REJECT(g, "{\"x11\":-4}");   /* both patterns: an integer >= 0 */
    REJECT(g, "{\"xa\":true}");  /* ^x: integer */
    REJECT(g, "{\"b\":1}");      /* neither: boolean */
    REJECT(g, "{\"x1\":\"s\"}"); /* listed and matching both patterns: string and integer */
    pd_grammar_unref(g);
    /* additionalProperties false: only pattern keys */
    g = compile(v, PD_GSPEC_JSON_SCHEMA,
                "{\"type\":\"object\",\"patternProperties\":{\"^[a-z]+$\":{\"type\":\"null\"}},"
                "\"additionalProperties\":false}",
                NULL);
    ASSERT(g);
    ACCEPT(g, "{\"ab\":null,\"c\":null}");
    REJECT(g, "{\"A\":null}");
    REJECT(g, "{\"ab\":1}");
    pd_grammar_unref(g);
    g = compile(v, PD_GSPEC_JSON_SCHEMA,
                "{\"type\":\"object\",\"properties\":{\"a\":{},\"b\":{}},\"required\":[\"a\"],"
                "\"minProperties\":2,\"maxProperties\":3}",
                NULL);
    ASSERT(g);
    REJECT(g, "{\"a\":1}");
    ACCEPT(g, "{\"a\":1,\"b\":2}");
    ACCEPT(g, "{\"a\":1,\"c\":2}");
    ACCEPT(g, "{\"a\":1,\"b\":2,\"c\":3}");
    REJECT(g, "{\"a\":1,\"b\":2,\"c\":3,\"d\":4}");
    REJECT(g, "{\"b\":2,\"c\":3}");
    pd_grammar_unref(g);
    g = compile(v, PD_GSPEC_JSON_SCHEMA, "{\"type\":\"object\",\"minProperties\":1}", NULL);
    ASSERT(g);
    REJECT(g, "{}");
    ACCEPT(g, "{\"q\":[]}");
    ACCEPT(g, "{\"q\":[],\"r\":{},\"s\":1}");
    pd_grammar_unref(g);
    /* maxProperties 0 (Snowplow sp_321 had one accepted): only {} */
    g = compile(v, PD_GSPEC_JSON_SCHEMA,
                "{\"type\":\"object\",\"properties\":{\"p\":{\"type\":\"object\","
                "\"maxProperties\":0}}}",
                NULL);
    ASSERT(g);
    ACCEPT(g, "{\"p\":{}}");
    ACCEPT(g, "{\"p\":{ }}");
    REJECT(g, "{\"p\":{\"a\":1}}");
    pd_grammar_unref(g);
    g = compile(v, PD_GSPEC_JSON_SCHEMA,
                "{\"type\":\"object\",\"maxProperties\":0,\"required\":[\"a\"]}", NULL);
    ASSERT(!g); /* nothing matches */
    /* allOf: one entry's additionalProperties binds the keys only the other lists (Github
     * o61085: a package's own properties and those of its $ref, both closed) */
    g = compile(v, PD_GSPEC_JSON_SCHEMA,
                "{\"allOf\":[{\"properties\":{\"a\":{}},\"additionalProperties\":false},"
                "{\"properties\":{\"b\":{}}}]}",
                NULL);
    ASSERT(g);
    ACCEPT(g, "{\"a\":1}");
    REJECT(g, "{\"b\":1}");
    REJECT(g, "{\"a\":1,\"c\":2}");
    pd_grammar_unref(g);
    g = compile(v, PD_GSPEC_JSON_SCHEMA,
                "{\"allOf\":[{\"properties\":{\"a\":{}},\"patternProperties\":{\"^b\":"
                "{\"type\":\"integer\"}},\"additionalProperties\":{\"type\":\"string\"}},"
                "{\"properties\":{\"ba\":{},\"c\":{}}}]}",
                NULL);
    ASSERT(g);
    ACCEPT(g, "{\"a\":null,\"ba\":1,\"c\":\"x\"}");
    REJECT(g, "{\"ba\":\"x\"}"); /* ^b: integer */
    REJECT(g, "{\"c\":1}");      /* additionalProperties of the first entry: string */
    pd_grammar_unref(g);
}

TEST(schema_not_formats)
{
    pd_gvocab *v = small_vocab();
    pd_grammar *g =
        compile(v, PD_GSPEC_JSON_SCHEMA, "{\"not\":{\"type\":[\"string\",\"null\"]}}", NULL);
    ASSERT(g);
    ACCEPT(g, "1.5");
    ACCEPT(g, "{}");
    REJECT(g, "\"s\"");
    REJECT(g, "null");
    pd_grammar_unref(g);
    g = compile(v, PD_GSPEC_JSON_SCHEMA,
                "{\"type\":[\"integer\",\"string\"],\"not\":{\"type\":\"integer\"}}", NULL);
    ASSERT(g);
    ACCEPT(g, "\"s\"");
    REJECT(g, "1");
    pd_grammar_unref(g);
    g = compile(v, PD_GSPEC_JSON_SCHEMA,
                "{\"properties\":{\"a\":{\"not\":{}},\"b\":{\"not\":false}}}", NULL);
    ASSERT(g);
    ACCEPT(g, "{\"b\":1}");
    REJECT(g, "{\"a\":1}");
    pd_grammar_unref(g);
    /* drafts 3-7: keywords beside $ref are ignored; later drafts: merged */
    g = compile(v, PD_GSPEC_JSON_SCHEMA,
                "{\"$schema\":\"http://json-schema.org/draft-07/schema#\",\"definitions\":{"
                "\"o\":{\"type\":\"object\"}},\"properties\":{\"a\":{\"type\":\"string\","
                "\"$ref\":\"#/definitions/o\"}}}",
                NULL);
    ASSERT(g);
    ACCEPT(g, "{\"a\":{}}");
    REJECT(g, "{\"a\":\"s\"}");
    pd_grammar_unref(g);
    g = compile(v, PD_GSPEC_JSON_SCHEMA,
                "{\"definitions\":{\"o\":{\"type\":[\"object\",\"string\"]}},\"properties\":{"
                "\"a\":{\"type\":\"string\",\"$ref\":\"#/definitions/o\"}}}",
                NULL);
    ASSERT(g);
    ACCEPT(g, "{\"a\":\"s\"}");
    REJECT(g, "{\"a\":{}}");
    pd_grammar_unref(g);
    pd_gerr e;
    ASSERT(!compile(v, PD_GSPEC_JSON_SCHEMA, "{\"not\":{\"type\":\"integer\"}}", &e));
    ASSERT(strcmp(e.keyword, "not") == 0);
    /* formats: JSON Schema's enforced, other names constrain nothing */
    g = compile(v, PD_GSPEC_JSON_SCHEMA,
                "{\"type\":\"array\",\"items\":[{\"format\":\"ipv6\",\"type\":\"string\"},"
                "{\"format\":\"duration\",\"type\":\"string\"},"
                "{\"format\":\"password\",\"type\":\"string\"},"
                "{\"format\":\"uint8\",\"type\":\"integer\"}]}",
                NULL);
    ASSERT(g);
    ACCEPT(g, "[\"fe80::1\",\"P1Y2M\",\"x\",255]");
    ACCEPT(g, "[\"::ffff:1.2.3.4\",\"PT5S\",\"\",0]");
    REJECT(g, "[\"1:::2\",\"P1Y2M\",\"x\",255]");
    REJECT(g, "[\"::1\",\"P1H\",\"x\",255]");
    REJECT(g, "[\"::1\",\"P1D\",\"x\",256]");
    pd_grammar_unref(g);
    g = compile(v, PD_GSPEC_JSON_SCHEMA, "{\"type\":\"string\",\"format\":\"date\"}", NULL);
    ASSERT(g);
    ACCEPT(g, "\"2024-02-29\"");
    ACCEPT(g, "\"2000-02-29\"");
    ACCEPT(g, "\"2023-12-31\"");
    REJECT(g, "\"2023-02-29\"");
    REJECT(g, "\"1900-02-29\"");
    REJECT(g, "\"2022-02-30\"");
    REJECT(g, "\"2022-04-31\"");
    pd_grammar_unref(g);
}

/* `not` forms that reduce exactly, and dependencies: accepted and rejected values */
TEST(schema_not_forms_and_dependencies)
{
    pd_gvocab *v = small_vocab();
    struct {
        const char *schema, *yes[4], *no[4];
    } cases[] = {
        /* string-only nots: the complement of one spelling per string */
        {"{\"type\":\"string\",\"not\":{\"enum\":[\"ab\",\"c\\\"\"]}}",
         {"\"a\"", "\"abc\"", "\"\"", "\"c\""},
         {"\"ab\"", "\"c\\\"\"", "\"a\\u0062\"", "1"}},
        {"{\"not\":{\"pattern\":\"^x\",\"minLength\":2}}",
         {"\"x\"", "\"yx\"", "3", "\"\\n\""},
         {"\"xy\"", "\"xxx\"", "\"x\\n\"", "\"\\u0078y\""}},
        {"{\"type\":[\"string\",\"null\"],\"not\":{\"const\":\"n\"}}",
         {"null", "\"nn\"", "\"\"", "\"N\""},
         {"\"n\"", "\"\\u006e\"", "1", "\"\\u006E\""}},
        /* not not, not anyOf / allOf / $ref, not of a bound */
        {"{\"not\":{\"not\":{\"type\":\"integer\",\"minimum\":3}}}",
         {"3", "40", "5", "100"},
         {"2", "\"s\"", "3.5", "null"}},
        {"{\"type\":\"integer\",\"not\":{\"anyOf\":[{\"minimum\":10},{\"maximum\":0}]}}",
         {"1", "9", "5", "2"},
         {"0", "10", "-1", "11"}},
        {"{\"type\":\"integer\",\"not\":{\"allOf\":[{\"minimum\":10},{\"maximum\":20}]}}",
         {"9", "21", "-3", "100"},
         {"10", "20", "15", "11"}},
        {"{\"$defs\":{\"s\":{\"type\":\"string\"}},\"not\":{\"$ref\":\"#/$defs/s\"}}",
         {"1", "null", "[]", "{}"},
         {"\"\"", "\"s\"", "\"1\"", "\"[]\""}},
        {"{\"type\":\"array\",\"not\":{\"maxItems\":1}}",
         {"[1,2]", "[1,2,3]", "[[],[]]", "[null,null]"},
         {"[]", "[1]", "[[1,2]]", "{}"}},
        /* not required: one of them absent */
        {"{\"type\":\"object\",\"properties\":{\"a\":{},\"b\":{}},\"not\":{\"required\":[\"a\","
         "\"b\"]}}",
         {"{}", "{\"a\":1}", "{\"b\":1}", "{\"c\":1}"},
         {"{\"a\":1,\"b\":2}", "{\"a\":1,\"b\":2,\"c\":3}", "[]", "1"}},
        /* dependencies: names and schemas */
        {"{\"type\":\"object\",\"properties\":{\"a\":{},\"b\":{},\"c\":{}},\"dependentRequired\":"
         "{\"a\":[\"b\"]}}",
         {"{}", "{\"a\":1,\"b\":2}", "{\"b\":1}", "{\"c\":1}"},
         {"{\"a\":1}", "{\"a\":1,\"c\":3}", "[]", "1"}},
        {"{\"type\":\"object\",\"properties\":{\"a\":{},\"b\":{\"type\":\"string\"}},"
         "\"dependencies\":{\"a\":{\"required\":[\"b\"],\"properties\":{\"b\":{\"minLength\":2}}}}"
         "}",
         {"{}", "{\"a\":1,\"b\":\"xy\"}", "{\"b\":\"x\"}", "{\"b\":\"\"}"},
         {"{\"a\":1}", "{\"a\":1,\"b\":\"x\"}", "{\"b\":1}", "{\"a\":1,\"b\":2}"}},
        {"{\"type\":\"object\",\"required\":[\"a\"],\"properties\":{\"a\":{},\"b\":{},\"c\":{}},"
         "\"dependentSchemas\":{\"a\":{\"required\":[\"b\"]},\"c\":false}}",
         {"{\"a\":1,\"b\":2}", "{\"a\":{},\"b\":[]}", "{\"a\":1,\"b\":null}", "{\"a\":0,\"b\":0}"},
         {"{\"a\":1}", "{\"b\":1}", "{}", "{\"a\":1,\"b\":1,\"c\":1}"}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        pd_gerr e;
        pd_grammar *g = compile(v, PD_GSPEC_JSON_SCHEMA, cases[i].schema, &e);
        ASSERT_MSG(g, "%s: %s", cases[i].schema, e.msg);
        for (int k = 0; k < 4; k++) {
            ASSERT_MSG(accepts(g, cases[i].yes[k]) == 1, "%s should accept %s", cases[i].schema,
                       cases[i].yes[k]);
            ASSERT_MSG(accepts(g, cases[i].no[k]) == 0, "%s should reject %s", cases[i].schema,
                       cases[i].no[k]);
        }
        pd_grammar_unref(g);
    }
}

TEST(schema_numbers)
{
    pd_gvocab *v = small_vocab();
    struct {
        const char *schema, *yes[6], *no[6];
    } cases[] = {
        {"{\"type\":\"number\",\"minimum\":-1.5,\"exclusiveMaximum\":2.25}",
         {"-1.5", "-1.49", "0", "2.2", "-0", "2.2499"},
         {"-1.51", "2.25", "2.250", "3", "-2", "1e1"}},
        {"{\"type\":\"integer\",\"exclusiveMinimum\":10,\"maximum\":1000}",
         {"11", "99", "100", "1000", "500", "999"},
         {"10", "1001", "9", "0", "-5", "10.5"}},
        {"{\"type\":\"number\",\"minimum\":0.1,\"maximum\":0.3}",
         {"0.1", "0.2", "0.3", "0.10", "0.29999", "0.300"},
         {"0.09", "0.31", "0", "1", "0.30001", "-0.2"}},
        {"{\"type\":\"number\"}",
         {"0", "-0.5e+10", "12.75", "1E5", "-3", "7"},
         {"01", "1.", ".5", "+1", "--1", "1e"}},
        {"{\"type\":\"integer\",\"minimum\":-20,\"maximum\":-3}",
         {"-20", "-3", "-10", "-19", "-4", "-15"},
         {"-21", "-2", "0", "3", "-200", "20"}},
        /* multipleOf: a remainder automaton over the digits, numbers without an exponent */
        {"{\"type\":\"number\",\"multipleOf\":1.0,\"minimum\":0.0}",
         {"0", "5", "5.0", "100", "0.00", "12"},
         {"-1", "0.5", "1e1", "5.01", "1.5", "-3"}},
        {"{\"type\":\"integer\",\"multipleOf\":7}",
         {"0", "7", "-14", "700", "-0", "98"},
         {"1", "8", "-15", "701", "7.0", "7e0"}},
        {"{\"type\":\"number\",\"multipleOf\":0.01}",
         {"0.01", "1", "-2.5", "3.14", "0.100", "7.00"},
         {"0.001", "3.141", "1e-2", "0.015", "2.0001", "-0.009"}},
        {"{\"type\":\"number\",\"multipleOf\":1.5,\"maximum\":6}",
         {"0", "1.5", "3", "4.50", "-1.5", "6"},
         {"1", "2", "7.5", "0.5", "4.55", "6.0001"}},
        {"{\"type\":\"integer\",\"multipleOf\":0.5,\"exclusiveMinimum\":2}",
         {"3", "4", "10", "999", "21", "5"},
         {"2", "1", "0", "-4", "2.5", "3.0e0"}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        pd_gerr e;
        pd_grammar *g = compile(v, PD_GSPEC_JSON_SCHEMA, cases[i].schema, &e);
        ASSERT_MSG(g, "%s: %s", cases[i].schema, e.msg);
        for (int k = 0; k < 6; k++) {
            ASSERT_MSG(accepts(g, cases[i].yes[k]) == 1, "%s should accept %s", cases[i].schema,
                       cases[i].yes[k]);
            ASSERT_MSG(accepts(g, cases[i].no[k]) == 0, "%s should reject %s", cases[i].schema,
                       cases[i].no[k]);
        }
        pd_grammar_unref(g);
    }
}

TEST(schema_strings_formats_enums)
{
    pd_gvocab *v = small_vocab();
    pd_grammar *g = compile(v, PD_GSPEC_JSON_SCHEMA,
                            "{\"type\":\"array\",\"prefixItems\":["
                            "{\"type\":\"string\",\"minLength\":2,\"maxLength\":3},"
                            "{\"type\":\"string\",\"pattern\":\"^a[bc]+$\"},"
                            "{\"type\":\"string\",\"pattern\":\"x\\\\d\"},"
                            "{\"type\":\"string\",\"format\":\"date\"},"
                            "{\"enum\":[\"red\",1,null,{\"k\":[true]}]},"
                            "{\"const\":\"a\\\"b\"}],\"items\":false}",
                            NULL);
    ASSERT(g);
    ACCEPT(g, "[\"ab\",\"abcb\",\"zzx5zz\",\"2023-01-31\",\"red\",\"a\\\"b\"]");
    ACCEPT(g, "[\"\\u00e9\\n\",\"ac\",\"x0\",\"1999-12-01\",1,\"a\\\"b\"]");
    ACCEPT(g, "[\"abc\",\"ac\",\"x0\",\"1999-12-01\",{ \"k\" : [ true ] },\"a\\\"b\"]");
    ACCEPT(g, "[\"abc\",\"ac\",\"x0\",\"1999-12-01\",null,\"a\\\"b\"]");
    REJECT(g, "[\"a\",\"ac\",\"x0\",\"1999-12-01\",null,\"a\\\"b\"]");    /* minLength */
    REJECT(g, "[\"abcd\",\"ac\",\"x0\",\"1999-12-01\",null,\"a\\\"b\"]"); /* maxLength */
    REJECT(g, "[\"ab\",\"ad\",\"x0\",\"1999-12-01\",null,\"a\\\"b\"]");   /* pattern */
    REJECT(g, "[\"ab\",\"ac\",\"xx\",\"1999-12-01\",null,\"a\\\"b\"]");   /* pattern (search) */
    REJECT(g, "[\"ab\",\"ac\",\"x0\",\"1999-13-01\",null,\"a\\\"b\"]");   /* format */
    REJECT(g, "[\"ab\",\"ac\",\"x0\",\"1999-12-01\",2,\"a\\\"b\"]");      /* enum */
    REJECT(g, "[\"ab\",\"ac\",\"x0\",\"1999-12-01\",null,\"ab\"]");       /* const */
    REJECT(g, "[\"ab\",\"ac\",\"x0\",\"1999-12-01\",null,\"a\\\"b\",1]"); /* items: false */
    pd_grammar_unref(g);
}

/* A pattern's alternatives are searched with their own anchors (`^ab|cd$|ef|gh`: ab at the start,
 * cd at the end, ef or gh anywhere), and a search through many alternatives compiles at once.
 * Regression: each unanchored alternative had its own `.*` before and after, and the subset
 * construction tracked which of them had matched (Github_easy o5116, 7 words: 18,691 states,
 * 1.4 s; 12 words went past the cap on automaton states and were refused). */
TEST(schema_pattern_alternatives_anchors_and_size)
{
    pd_gvocab *v = small_vocab();
    pd_grammar *g = compile(v, PD_GSPEC_JSON_SCHEMA,
                            "{\"type\":\"string\",\"pattern\":\"^ab|cd$|ef|gh\"}", NULL);
    ASSERT(g);
    ACCEPT(g, "\"abx\"");
    ACCEPT(g, "\"xcd\"");
    ACCEPT(g, "\"xefy\"");
    ACCEPT(g, "\"ghz\"");
    ACCEPT(g, "\"zabcd\"");
    REJECT(g, "\"xab\"");
    REJECT(g, "\"cdx\"");
    REJECT(g, "\"zz\"");
    REJECT(g, "\"\"");
    pd_grammar_unref(g);
    static const char *const words[] = {"ALPHA", "BRAVO", "CHARLIE", "DELTA",  "ECHO", "FOXTROT",
                                        "GOLF",  "HOTEL", "INDIA",   "JULIET", "KILO", "LIMA"};
    char schema[512];
    size_t len = (size_t)snprintf(schema, sizeof schema, "{\"type\":\"string\",\"pattern\":\"");
    for (size_t i = 0; i < sizeof words / sizeof *words; i++)
        len += (size_t)snprintf(schema + len, sizeof schema - len, "%sQ_%s_TYPE", i ? "|" : "",
                                words[i]);
    snprintf(schema + len, sizeof schema - len, "\"}");
    int64_t t0 = pd_now_ns();
    g = compile(v, PD_GSPEC_JSON_SCHEMA, schema, NULL);
    double ms = (double)(pd_now_ns() - t0) / 1e6;
    ASSERT(g);
    ACCEPT(g, "\"x Q_KILO_TYPE y\"");
    REJECT(g, "\"x Q_KILO_TYP y\"");
    pd_grammar_unref(g);
    printf("    12 unanchored words: compiled in %.1f ms\n", ms);
    ASSERT_MSG(ms < 3000, "12 unanchored words took %.0f ms to compile", ms);
}

/* A repeated optional is one chain: `[ ]?{2257}` as the whitespace pattern takes up to 2,257
 * spaces between tokens and compiles at once. Regression: 2,257 copies each of which could be
 * skipped made closures of every copy after it (94 s; found by fuzz_grammar_schema). */
TEST(schema_whitespace_repeated_optional)
{
    pd_gvocab *v = small_vocab();
    pd_gspec s = {PD_GSPEC_JSON_SCHEMA, "{\"type\":\"array\"}", 16, "[ ]?{2257}", false};
    pd_grammar *g = NULL;
    pd_gerr err;
    int64_t t0 = pd_now_ns();
    ASSERT_OK(pd_grammar_compile(v, &s, &g, &err));
    double ms = (double)(pd_now_ns() - t0) / 1e6;
    char text[2400];
    size_t n = 0;
    text[n++] = '[';
    for (int i = 0; i < 2257; i++) text[n++] = ' ';
    text[n++] = ']';
    text[n] = 0;
    ACCEPT(g, text);
    ACCEPT(g, "[ 1 , 2 ]");
    REJECT(g, "[\t]"); /* only spaces */
    pd_grammar_unref(g);
    printf("    compiled in %.1f ms\n", ms);
    /* here: 1.1 s (debugoptimized), 3.5 s under ASan; before the fix over 90 s at -O2 */
    ASSERT_MSG(ms < 30000, "the whitespace pattern took %.0f ms to compile", ms);
}

/* A repeated loop is one chain ending in a loop: (y{a,}){m,n} is y{a*m,}, (y+){0,n} is y*
 * (fuzz_grammar_regex's timeout: a regex with `[^a]+{2257}` took 9 s at -O2). */
TEST(regex_repeated_loop)
{
    pd_gvocab *v = small_vocab();
    int64_t t0 = pd_now_ns();
    pd_grammar *g = compile(v, PD_GSPEC_REGEX, "([^a]+){2257}", NULL);
    double ms = (double)(pd_now_ns() - t0) / 1e6;
    ASSERT(g);
    char text[3100];
    memset(text, 'b', 3000);
    text[3000] = 0;
    ACCEPT(g, text);
    text[2257] = 0;
    ACCEPT(g, text);
    text[2256] = 0;
    REJECT(g, text);
    REJECT(g, "a");
    pd_grammar_unref(g);
    printf("    compiled in %.1f ms\n", ms);
    /* here: 0.1 s under ASan; before the fix 3.3 s at -O2 */
    ASSERT_MSG(ms < 2000, "([^a]+){2257} took %.0f ms to compile", ms);
    g = compile(v, PD_GSPEC_REGEX, "(bc)+{3}", NULL); /* (bc){3,} */
    ASSERT(g);
    ACCEPT(g, "bcbcbc");
    ACCEPT(g, "bcbcbcbcbc");
    REJECT(g, "bcbc");
    REJECT(g, "bcbcbcb");
    pd_grammar_unref(g);
    g = compile(v, PD_GSPEC_REGEX, "x(b+){0,4}", NULL); /* xb* */
    ASSERT(g);
    ACCEPT(g, "x");
    ACCEPT(g, "xbbbbbbbbb");
    REJECT(g, "xa");
    pd_grammar_unref(g);
    g = compile(v, PD_GSPEC_REGEX, "x(b{2,}){0,3}", NULL); /* not b*: one b is refused */
    ASSERT(g);
    ACCEPT(g, "x");
    ACCEPT(g, "xbb");
    ACCEPT(g, "xbbbbbbb");
    REJECT(g, "xb");
    pd_grammar_unref(g);
}

/* A real enum or const value is matched as written (2.1, not 2.1000000000000001), a whole one
 * with or without ".0"; a schema with a bound beyond int64 (Snowplow's maximum
 * 9223372036854776000) compiles with its other keywords exact. */
TEST(schema_real_literals_and_big_bounds)
{
    pd_gvocab *v = small_vocab();
    pd_grammar *g = compile(v, PD_GSPEC_JSON_SCHEMA, "{\"enum\":[2,2.1,1e-7,3.0]}", NULL);
    ASSERT(g);
    ACCEPT(g, "2");
    ACCEPT(g, "2.1");
    ACCEPT(g, "1e-07");
    ACCEPT(g, "3.0");
    ACCEPT(g, "3");
    REJECT(g, "2.1000000000000001");
    REJECT(g, "2.2");
    pd_grammar_unref(g);
    g = compile(v, PD_GSPEC_JSON_SCHEMA,
                "{\"type\":\"object\",\"properties\":{\"x\":{\"type\":[\"integer\",\"null\"],"
                "\"minimum\":0,\"maximum\":9223372036854776000},\"v\":{\"type\":\"string\","
                "\"maxLength\":3}},\"required\":[\"x\",\"v\"],\"additionalProperties\":false}",
                NULL);
    ASSERT(g);
    ACCEPT(g, "{\"x\":1,\"v\":\"abc\"}");
    ACCEPT(g, "{\"x\":9223372036854775999,\"v\":\"\"}");
    REJECT(g, "{\"x\":1,\"v\":\"abcd\"}");
    REJECT(g, "{\"x\":-1,\"v\":\"a\"}");
    REJECT(g, "{\"x\":9223372036854776001,\"v\":\"a\"}");
    pd_grammar_unref(g);
}

TEST(schema_refs_recursion_anyof_allof)
{
    pd_gvocab *v = small_vocab();
    pd_grammar *g = compile(v, PD_GSPEC_JSON_SCHEMA,
                            "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{"
                            "\"v\":{\"anyOf\":[{\"type\":\"integer\"},{\"type\":\"null\"}]},"
                            "\"kids\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/node\"}}},"
                            "\"required\":[\"v\"],\"additionalProperties\":false}},"
                            "\"allOf\":[{\"$ref\":\"#/$defs/node\"},{\"required\":[\"kids\"]}]}",
                            NULL);
    ASSERT(g);
    ACCEPT(g, "{\"v\":1,\"kids\":[]}");
    ACCEPT(g, "{\"v\":null,\"kids\":[{\"v\":2},{\"v\":3,\"kids\":[{\"v\":4}]}]}");
    REJECT(g, "{\"v\":1}");
    REJECT(g, "{\"v\":1,\"kids\":[{\"v\":\"x\"}]}");
    REJECT(g, "{\"v\":1,\"kids\":[{}]}");
    pd_grammar_unref(g);
}

TEST(schema_refusals_name_keyword_and_path)
{
    pd_gvocab *v = small_vocab();
    struct {
        const char *schema, *kw, *path;
    } cases[] = {
        {"{\"properties\":{\"a\":{\"not\":{\"multipleOf\":2}}}}", "not", "/properties/a/not"},
        {"{\"type\":\"array\",\"uniqueItems\":true}", "uniqueItems", "/uniqueItems"},
        {"{\"items\":{\"type\":\"string\",\"format\":\"iri\"}}", "format", "/items/format"},
        {"{\"$ref\":\"http://x/y.json\"}", "$ref", "/$ref"},
        {"{\"anyOf\":[{\"if\":{}}]}", "if", "/anyOf/0/if"},
        {"{\"properties\":{\"a/b\":{\"type\":\"number\",\"multipleOf\":1001}}}", "multipleOf",
         "/properties/a~1b/multipleOf"},
        {"{\"patternProperties\":{\"a\":{},\"b\":{},\"c\":{},\"d\":{}}}", "patternProperties",
         "/patternProperties"},
        {"{\"type\":\"object\",\"maxProperties\":1000}", "maxProperties", "/maxProperties"},
        {"{\"type\":\"string\",\"pattern\":\"(?=a)\"}", "pattern", "/pattern"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        pd_gerr e;
        pd_grammar *g = compile(v, PD_GSPEC_JSON_SCHEMA, cases[i].schema, &e);
        ASSERT_MSG(!g, "should refuse %s", cases[i].schema);
        ASSERT_MSG(strcmp(e.keyword, cases[i].kw) == 0 && strcmp(e.path, cases[i].path) == 0,
                   "%s: got %s %s (%s)", cases[i].schema, e.keyword, e.path, e.msg);
        ASSERT_CONTAINS(e.msg, cases[i].path);
    }
    /* annotations are not refusals */
    pd_grammar *g =
        compile(v, PD_GSPEC_JSON_SCHEMA,
                "{\"$schema\":\"x\",\"title\":\"t\",\"description\":\"d\",\"default\":1,"
                "\"examples\":[1],\"$comment\":\"c\",\"type\":\"integer\"}",
                NULL);
    ASSERT(g);
    pd_grammar_unref(g);
}

TEST(json_object_choice_grammar)
{
    pd_gvocab *v = small_vocab();
    pd_grammar *g = compile(v, PD_GSPEC_JSON_OBJECT, NULL, NULL);
    ASSERT(g);
    ACCEPT(g, "{}");
    ACCEPT(g, "{\"a\": [1, {\"b\": null}], \"c\": \"x\"}");
    REJECT(g, "[1]");
    REJECT(g, "{\"a\"}");
    pd_grammar_unref(g);
    g = compile(v, PD_GSPEC_CHOICE, "[\"yes\",\"no\",\"yes please\"]", NULL);
    ASSERT(g);
    ACCEPT(g, "yes");
    ACCEPT(g, "yes please");
    REJECT(g, "ye");
    pd_grammar_unref(g);
    /* GBNF */
    g = compile(v, PD_GSPEC_GRAMMAR,
                "# a list\nroot ::= \"[\" item (\",\" item)* \"]\"\nitem ::= [a-c]+ | num\n"
                "num ::= \"-\"? [0-9]{1,3}\n",
                NULL);
    ASSERT(g);
    ACCEPT(g, "[a,-12,cab]");
    REJECT(g, "[a,1234]");
    REJECT(g, "[]");
    pd_grammar_unref(g);
    /* Lark */
    g = compile(v, PD_GSPEC_GRAMMAR,
                "?start: expr\nexpr: term ((\"+\"|\"-\") term)*\n?term: NUMBER | \"(\" expr \")\"\n"
                "NUMBER: /[0-9]+/\n",
                NULL);
    ASSERT(g);
    ACCEPT(g, "1+(2-30)");
    REJECT(g, "1+");
    pd_grammar_unref(g);
    pd_gerr e;
    ASSERT(!compile(v, PD_GSPEC_GRAMMAR, "root ::= root \"a\" | \"b\"", &e));
    ASSERT_CONTAINS(e.msg, "left-recursive");
    ASSERT(!compile(v, PD_GSPEC_GRAMMAR, "root ::= \"a\" \n x ::= (", &e));
    ASSERT_CONTAINS(e.msg, "line 2");
    ASSERT(!compile(v, PD_GSPEC_GRAMMAR, "start: a\n%ignore \" \"\na: \"x\"", &e));
    ASSERT_CONTAINS(e.msg, "%ignore");
}

/* ---- masks ----------------------------------------------------------------------------------- */
static uint64_t g_rng = 88172645463325252ull;
static uint32_t rnd(void)
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)g_rng;
}

/* Random walk: every step the mask equals the brute-force per-token check; EOS iff accepting. */
static int check_walk(pd_grammar *g, pd_gvocab *v, int steps, const char **why)
{
    int32_t n = pd_gvocab_size(v);
    uint32_t *bits = malloc(pd_gmask_words(n) * 4);
    int32_t *allowed = malloc(sizeof(int32_t) * (size_t)n);
    pd_gmatcher *m;
    if (pd_gmatcher_create(g, &m) < 0) return -1;
    int rc = 0;
    for (int s = 0; s < steps && !pd_gmatcher_is_terminated(m); s++) {
        if (pd_gmatcher_fill_mask(m, bits) < 0) {
            rc = -1;
            break;
        }
        int na = 0;
        for (int32_t t = 0; t < n; t++) {
            bool bit = bits[t >> 5] >> (t & 31) & 1;
            bool brute;
            if (pd_gvocab_is_eos(v, t)) {
                brute = pd_gmatcher_is_accepting(m);
            } else {
                pd_gmatcher *c;
                pd_gmatcher_clone(m, &c);
                brute = pd_gmatcher_accept_token(c, t) == 0;
                pd_gmatcher_free(c);
            }
            if (bit != brute) {
                *why = bit ? "mask allows a token brute force refuses" : "mask misses a token";
                rc = t + 1;
                goto out;
            }
            if (bit) allowed[na++] = t;
        }
        if (na == 0) {
            *why = "dead end: nothing allowed";
            rc = -2;
            break;
        }
        int32_t pick = allowed[rnd() % (uint32_t)na];
        if (getenv("PD_GRAMMAR_TEST_TRACE")) {
            uint32_t len;
            const uint8_t *b = pd_gvocab_token(v, pick, &len);
            printf("%.*s", (int)len, b ? (const char *)b : "<eos>");
            fflush(stdout);
        }
        if (pd_gmatcher_accept_token(m, pick) < 0) {
            *why = "accept of an allowed token failed";
            rc = -3;
            break;
        }
    }
out:
    pd_gmatcher_free(m);
    free(bits);
    free(allowed);
    return rc;
}

static const char *const WALK_SPECS[][2] = {
    {"s",
     "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":5},"
     "\"age\":{\"type\":\"integer\",\"minimum\":-5,\"maximum\":120},\"ok\":{\"type\":\"boolean\"},"
     "\"xs\":{\"type\":\"array\",\"items\":{\"type\":\"number\"}}},\"required\":[\"name\"]}"},
    {"s", "{\"$defs\":{\"t\":{\"type\":\"object\",\"properties\":{\"a\":{\"$ref\":\"#/$defs/t\"},"
          "\"b\":{\"enum\":[\"x\",\"yz\",12]}},\"additionalProperties\":false}},\"$ref\":\"#/$defs/"
          "t\"}"},
    {"s", "{\"type\":\"string\",\"format\":\"date-time\"}"},
    {"o", ""},
    {"r", "(ab|ba)*c?[0-9]{2,4}"},
    {"g", "root ::= \"{\" pair (\",\" pair)* \"}\"\npair ::= [a-c]+ \":\" (root | [0-9]+)\n"},
    {"c", "[\"foo\",\"foobar\",\"bar baz\"]"},
};

TEST(mask_matches_brute_force_small_vocab)
{
    pd_gvocab *v = small_vocab();
    for (size_t i = 0; i < sizeof WALK_SPECS / sizeof *WALK_SPECS; i++) {
        char k = WALK_SPECS[i][0][0];
        pd_gspec_kind kind = k == 's'   ? PD_GSPEC_JSON_SCHEMA
                             : k == 'o' ? PD_GSPEC_JSON_OBJECT
                             : k == 'r' ? PD_GSPEC_REGEX
                             : k == 'g' ? PD_GSPEC_GRAMMAR
                                        : PD_GSPEC_CHOICE;
        pd_gerr e;
        pd_grammar *g = compile(v, kind, WALK_SPECS[i][1], &e);
        ASSERT_MSG(g, "%s: %s", WALK_SPECS[i][1], e.msg);
        for (int w = 0; w < 20; w++) {
            const char *why = "";
            int rc = check_walk(g, v, 60, &why);
            ASSERT_MSG(rc == 0, "spec %zu walk %d: %s (token %d)", i, w, why, rc - 1);
        }
        pd_grammar_unref(g);
    }
}

/* The slice (tokens of string contents, accepted whole by states that keep them all alive):
 * tokens at its edges (UTF-8 cut anywhere, overlongs, surrogates, stray continuation bytes,
 * control characters, quotes and backslashes inside tokens, long tokens near maxLength) must
 * get the same bits as brute force in string contents, keys and bounded strings. */
static const char *const SLICE_TOKENS[] = {"\xc3",
                                           "\xa9",
                                           "\xc3\xa9",
                                           "\xe0\xa0",
                                           "\xe0\x80",
                                           "\xe2\x82",
                                           "\xe2\x82\xac",
                                           "\xed\x9f\xbf",
                                           "\xed\xa0\x80",
                                           "\xf0\x9f",
                                           "\xf0\x8f",
                                           "\xf0\x9f\x98\x80",
                                           "\xf4\x8f\xbf\xbf",
                                           "\xf4\x90",
                                           "\xc0\xaf",
                                           "\x7f",
                                           "\x1f",
                                           "\t",
                                           "a\"",
                                           "ab\"",
                                           "\"a",
                                           "\": ",
                                           "\", \"",
                                           "a\\",
                                           "\\n",
                                           "\\u00e9",
                                           "abc",
                                           "abcd",
                                           "abcdef",
                                           "name",
                                           "nam",
                                           "\"name\"",
                                           "xyz ",
                                           " \xc3\xa9t\xc3\xa9",
                                           NULL};

TEST(slice_tokens_match_brute_force)
{
    const uint8_t *b[256];
    uint32_t l[256];
    static char ascii[95][2];
    int n = 0;
    for (; SLICE_TOKENS[n]; n++) {
        b[n] = (const uint8_t *)SLICE_TOKENS[n];
        l[n] = (uint32_t)strlen(SLICE_TOKENS[n]);
    }
    for (int i = 0; i < 95; i++) {
        ascii[i][0] = (char)(0x20 + i);
        b[n] = (const uint8_t *)ascii[i];
        l[n++] = 1;
    }
    b[n] = (const uint8_t *)"<eos>";
    l[n] = 5;
    int32_t eos = n++;
    pd_gvocab *v;
    ASSERT_OK(pd_gvocab_create(n, b, l, NULL, &eos, 1, &v));
    static const char *const specs[] = {
        "{\"type\":\"string\"}",
        "{\"type\":\"string\",\"maxLength\":4}",
        "{\"type\":\"string\",\"minLength\":2,\"maxLength\":9}",
        "{\"type\":\"string\",\"pattern\":\"^[a-z]+$\"}",
        "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"nam\":{\"const\":1}}"
        ","
        "\"additionalProperties\":{\"type\":\"string\",\"maxLength\":3}}",
        "{\"type\":\"array\",\"items\":{\"enum\":[\"abc\",\"\xc3\xa9t\xc3\xa9\",\"a\\\"b\"]}}",
    };
    for (size_t i = 0; i < sizeof specs / sizeof *specs; i++) {
        pd_gerr e;
        pd_grammar *g = compile(v, PD_GSPEC_JSON_SCHEMA, specs[i], &e);
        ASSERT_MSG(g, "%s: %s", specs[i], e.msg);
        for (int w = 0; w < 30; w++) {
            const char *why = "";
            int rc = check_walk(g, v, 40, &why);
            ASSERT_MSG(rc == 0, "%s walk %d: %s (token %d)", specs[i], w, why, rc - 1);
        }
        pd_grammar_unref(g);
    }
    pd_gvocab_free(v);
}

/* An ambiguous grammar doubles its parses with every token (a fuzz input took minutes); the
 * matcher stops at PD_GRAMMAR_MAX_STACKS with an error, and a rollback resumes. */
TEST(ambiguous_grammar_stops_with_an_error)
{
    pd_gvocab *v = small_vocab();
    pd_gerr e;
    pd_grammar *g = compile(v, PD_GSPEC_GRAMMAR, "root: \"a\" (root | )+\n", &e);
    ASSERT_MSG(g, "%s", e.msg);
    pd_gmatcher *m;
    ASSERT_OK(pd_gmatcher_create(g, &m));
    uint32_t bits[8];
    int32_t a = 10; /* "a" */
    size_t n = 0;
    while (n < 200 && pd_gmatcher_accept_token(m, a) == 0) n++;
    ASSERT_MSG(n < 200, "accepted %zu tokens without stopping", n);
    ASSERT(pd_gmatcher_too_ambiguous(m));
    ASSERT(strstr(pd_last_error(), "too ambiguous"));
    ASSERT(pd_gmatcher_fill_mask(m, bits) < 0);
    ASSERT(!pd_gmatcher_allows(m, a));
    ASSERT_OK(pd_gmatcher_rollback(m, 4));
    ASSERT(!pd_gmatcher_too_ambiguous(m));
    ASSERT_OK(pd_gmatcher_fill_mask(m, bits));
    ASSERT(bits[a >> 5] >> (a & 31) & 1);
    pd_gmatcher_free(m);
    pd_grammar_unref(g);
}

TEST(matcher_eos_rollback_clone)
{
    pd_gvocab *v = small_vocab();
    pd_grammar *g = compile(v, PD_GSPEC_REGEX, "ab|abc", NULL);
    ASSERT(g);
    pd_gmatcher *m;
    ASSERT_OK(pd_gmatcher_create(g, &m));
    int32_t a = 10, b = 11, c = 12; /* "a" "b" "c" */
    ASSERT(!pd_gmatcher_allows(m, g_small_eos));
    ASSERT(pd_gmatcher_accept_token(m, g_small_eos) < 0);
    ASSERT_OK(pd_gmatcher_accept_token(m, a));
    ASSERT(pd_gmatcher_accept_token(m, c) < 0);
    ASSERT_OK(pd_gmatcher_accept_token(m, b));
    ASSERT(pd_gmatcher_is_accepting(m) && !pd_gmatcher_is_terminated(m));
    pd_gmatcher *k;
    ASSERT_OK(pd_gmatcher_clone(m, &k));
    ASSERT_OK(pd_gmatcher_accept_token(m, c));
    ASSERT(pd_gmatcher_is_terminated(m));
    uint32_t bits[8];
    ASSERT_OK(pd_gmatcher_fill_mask(m, bits));
    for (int32_t t = 0; t < pd_gvocab_size(v); t++)
        ASSERT_EQ_INT(bits[t >> 5] >> (t & 31) & 1, t == g_small_eos);
    ASSERT_OK(pd_gmatcher_rollback(m, 1));
    ASSERT(!pd_gmatcher_is_terminated(m));
    ASSERT_OK(pd_gmatcher_accept_token(m, g_small_eos));
    ASSERT(pd_gmatcher_is_terminated(m));
    ASSERT_OK(pd_gmatcher_rollback(m, 3));
    ASSERT_EQ_INT(pd_gmatcher_history(m), 0);
    ASSERT(pd_gmatcher_allows(m, a) && !pd_gmatcher_allows(m, b));
    ASSERT(pd_gmatcher_allows(k, c) && pd_gmatcher_allows(k, g_small_eos));
    /* special tokens are never allowed */
    ASSERT(!pd_gmatcher_allows(k, g_small_eos + 1));
    pd_gmatcher_free(k);
    pd_gmatcher_free(m);
    pd_grammar_unref(g);
}

TEST(compile_cache_lru)
{
    pd_gvocab *v = small_vocab();
    pd_gcache *c = pd_gcache_create(v, 2);
    ASSERT(c);
    pd_gspec s1 = {PD_GSPEC_REGEX, "a+", 2, NULL, false},
             s2 = {PD_GSPEC_REGEX, "b+", 2, NULL, false},
             s3 = {PD_GSPEC_CHOICE, "[\"a\"]", 5, NULL, false},
             bad = {PD_GSPEC_REGEX, "(", 1, NULL, false};
    pd_grammar *g1, *g1b, *g;
    ASSERT_OK(pd_gcache_get(c, &s1, &g1, NULL));
    ASSERT_OK(pd_gcache_get(c, &s1, &g1b, NULL));
    ASSERT(g1 == g1b);
    ASSERT_OK(pd_gcache_get(c, &s2, &g, NULL));
    pd_grammar_unref(g);
    ASSERT_OK(pd_gcache_get(c, &s3, &g, NULL)); /* evicts s1 */
    pd_grammar_unref(g);
    ASSERT(pd_gcache_get(c, &bad, &g, NULL) < 0);
    size_t n;
    uint64_t hits, misses;
    pd_gcache_stats(c, &n, &hits, &misses);
    ASSERT_EQ_INT(n, 2);
    ASSERT_EQ_INT(hits, 1);
    ASSERT_EQ_INT(misses, 4);
    ASSERT(accepts(g1, "aaa") == 1); /* still alive through its own reference */
    pd_grammar_unref(g1);
    pd_grammar_unref(g1b);
    pd_gcache_free(c);
}

/* ---- Llama 3 -------------------------------------------------------------------------------- */
static pd_tok *llama3(void)
{
    static pd_tok *t;
    static bool tried;
    if (tried) return t;
    tried = true;
    char dir[1024];
    if (!pdt_npm_tokenizer_dir("llama3", dir, sizeof dir) || pd_tok_load(dir, &t) < 0) t = NULL;
    return t;
}

TEST(llama3_tokens_pass_mask_and_brute_force)
{
    pd_tok *t = llama3();
    if (!t) SKIP("Llama-3 tokenizer not in the npm cache (tests/npm_cache.sh)");
    pd_gvocab *v;
    ASSERT_OK(pd_gvocab_from_tok(t, NULL, 0, &v));
    int32_t n = pd_gvocab_size(v);
    const char *schema =
        "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},"
        "\"age\":{\"type\":\"integer\",\"minimum\":0},\"city\":{\"enum\":[\"Paris\",\"Rome\"]}},"
        "\"required\":[\"name\",\"age\"]}";
    pd_grammar *g = compile(v, PD_GSPEC_JSON_SCHEMA, schema, NULL);
    ASSERT(g);
    const char *text = "{\"name\": \"Zo\\u00e9 \\\"Z\\\" caf\xc3\xa9 \xe2\x82\xac\", \"age\": 31, "
                       "\"city\": \"Rome\"}";
    int32_t *ids;
    size_t nid;
    ASSERT_OK(pd_tok_encode(t, text, strlen(text), false, &ids, &nid));
    uint32_t *bits = malloc(pd_gmask_words(n) * 4);
    pd_gmatcher *m;
    ASSERT_OK(pd_gmatcher_create(g, &m));
    for (size_t i = 0; i <= nid; i++) {
        ASSERT_OK(pd_gmatcher_fill_mask(m, bits));
        /* brute force on every token at the first three positions and the end */
        if (i < 3 || i >= nid - 1) {
            for (int32_t k = 0; k < n; k++) {
                bool bit = bits[k >> 5] >> (k & 31) & 1;
                ASSERT_MSG(bit == pd_gmatcher_allows(m, k), "position %zu token %d: mask %d", i, k,
                           bit);
            }
        }
        if (i == nid) break;
        ASSERT_MSG(bits[ids[i] >> 5] >> (ids[i] & 31) & 1, "token %zu (%d) not in the mask", i,
                   ids[i]);
        ASSERT_OK(pd_gmatcher_accept_token(m, ids[i]));
    }
    ASSERT(pd_gmatcher_is_accepting(m));
    const int32_t *eos;
    size_t ne = pd_tok_eos_ids(t, &eos);
    for (size_t i = 0; i < ne; i++) ASSERT(bits[eos[i] >> 5] >> (eos[i] & 31) & 1);
    /* no special token other than EOS is ever allowed */
    for (int32_t k = 0; k < n; k++)
        if (pd_tok_is_special(t, k) && !pd_gvocab_is_eos(v, k))
            ASSERT(!(bits[k >> 5] >> (k & 31) & 1));
    pd_gmatcher_free(m);
    free(bits);
    free(ids);
    /* random walks against brute force on a recursive grammar */
    pd_grammar_unref(g);
    g = compile(v, PD_GSPEC_JSON_OBJECT, NULL, NULL);
    ASSERT(g);
    for (int w = 0; w < 2; w++) {
        const char *why = "";
        int rc = check_walk(g, v, 12, &why);
        ASSERT_MSG(rc == 0, "walk %d: %s (token %d)", w, why, rc - 1);
    }
    pd_grammar_unref(g);
    pd_gvocab_free(v);
}

/* pd_gspec.strict (what requests use, as XGrammar's strict mode): no keys beyond `properties`
 * when `additionalProperties` is absent, no items beyond `prefixItems` when `items` is absent;
 * what the schema does say still holds, and without strict both are allowed. */
TEST(schema_strict_mode)
{
    pd_gvocab *v = small_vocab();
    ASSERT(v);
    static const struct {
        const char *schema, *text;
        int strict, loose;
    } cases[] = {
        {"{\"properties\":{\"a\":{\"type\":\"integer\"}}}", "{\"a\":1}", 1, 1},
        {"{\"properties\":{\"a\":{\"type\":\"integer\"}}}", "{\"a\":1,\"b\":2}", 0, 1},
        {"{\"properties\":{\"a\":{\"type\":\"integer\"}},\"additionalProperties\":true}",
         "{\"a\":1,\"b\":2}", 1, 1},
        {"{\"properties\":{\"a\":{}},\"additionalProperties\":{\"type\":\"string\"}}",
         "{\"b\":\"x\"}", 1, 1},
        {"{\"type\":\"object\"}", "{\"b\":2}", 1, 1},
        {"{\"prefixItems\":[{\"type\":\"integer\"}]}", "[1]", 1, 1},
        {"{\"prefixItems\":[{\"type\":\"integer\"}]}", "[1,2]", 0, 1},
        {"{\"prefixItems\":[{\"type\":\"integer\"}],\"items\":{\"type\":\"string\"}}", "[1,\"x\"]",
         1, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        for (int strict = 0; strict < 2; strict++) {
            pd_gspec s = {PD_GSPEC_JSON_SCHEMA, cases[i].schema, strlen(cases[i].schema), NULL,
                          strict == 1};
            pd_grammar *g = NULL;
            pd_gerr e;
            ASSERT_MSG(pd_grammar_compile(v, &s, &g, &e) == 0, "%s: %s", cases[i].schema, e.msg);
            int want = strict ? cases[i].strict : cases[i].loose;
            ASSERT_MSG(accepts(g, cases[i].text) == want, "%s strict %d: %s", cases[i].schema,
                       strict, cases[i].text);
            pd_grammar_unref(g);
        }
}
