/* Unit tests: the stop checker (docs/api.md §9.1-9.2): EOS and stop ids with their
 * stop_reason, stop strings across deltas, hold-back release in code points,
 * include_stop_str_in_output, list order among several stop strings, min_tokens, max_tokens,
 * max_model_len, and the final flush. */
#include "harness.h"

#include "engine/stop.h"

typedef struct {
    int32_t token;
    const char *text;
} tok_step;

/* Feeds steps until the sequence finishes; chunks[i] receives each call's text, all the
 * concatenation. Returns the number of pushes, or a negative status. */
static int feed(pd_stop *s, const tok_step *steps, int n, char chunks[][64], char *all,
                pd_stop_result *last)
{
    all[0] = '\0';
    memset(last, 0, sizeof *last);
    int i = 0;
    for (; i < n; i++) {
        pd_stop_result r;
        int rc = pd_stop_push(s, steps[i].token, steps[i].text, strlen(steps[i].text), &r);
        if (rc < 0) return rc;
        if (chunks) {
            memcpy(chunks[i], r.text, r.text_len);
            chunks[i][r.text_len] = '\0';
        }
        strncat(all, r.text, r.text_len);
        *last = r;
        if (r.finish != PD_FINISH_NONE) return i + 1;
    }
    return i;
}

static pd_stop_model model(void)
{
    pd_stop_model m = {.eos_id = 2,
                       .extra_eos_ids = NULL,
                       .n_extra_eos_ids = 0,
                       .max_model_len = 1000,
                       .max_new_tokens = -1};
    return m;
}

TEST(stop_contract_example_holdback)
{
    /* §11.4: stop "\n\nUser:" (7 code points, B = 6) */
    pd_sampling_params p = pd_sampling_default_params();
    const char *stop[] = {"\n\nUser:"};
    p.stop = stop;
    p.n_stop = 1;
    pd_stop_model m = model();
    pd_stop *s = NULL;
    ASSERT_OK(pd_stop_create(&p, &m, 5, &s));
    tok_step steps[] = {{10, "Hello"}, {11, ","},    {12, " world"},
                        {13, "\n\n"},  {14, "User"}, {15, ":"}};
    char chunks[6][64], all[256];
    pd_stop_result r;
    ASSERT_EQ_INT(feed(s, steps, 6, chunks, all, &r), 6);
    ASSERT_STR_EQ(chunks[0], "");
    ASSERT_STR_EQ(chunks[1], "");
    ASSERT_STR_EQ(chunks[2], "Hello,");
    ASSERT_STR_EQ(chunks[3], " w");
    ASSERT_STR_EQ(chunks[4], "orld");
    ASSERT_STR_EQ(chunks[5], "");
    ASSERT_STR_EQ(all, "Hello, world");
    ASSERT_EQ_INT(r.finish, PD_FINISH_STOP);
    ASSERT_EQ_INT(r.stop_kind, PD_STOP_REASON_STRING);
    ASSERT_EQ_INT(r.stop_index, 0);
    ASSERT_STR_EQ(r.stop_string, "\n\nUser:");
    ASSERT_STR_EQ(pd_finish_reason_name(r.finish), "stop");
    ASSERT_EQ_INT(pd_stop_num_output(s), 6);
    ASSERT(pd_stop_finished(s));
    /* the detokenizer's tail is dropped after a stop string */
    ASSERT_OK(pd_stop_flush(s, "\xEF\xBF\xBD", 3, &r));
    ASSERT_EQ_INT(r.text_len, 0);
    ASSERT_EQ_INT(r.stop_kind, PD_STOP_REASON_STRING);
    ASSERT_ERR(pd_stop_flush(s, "", 0, &r), PD_EINVAL, "flushed twice");
    ASSERT_ERR(pd_stop_push(s, 1, "x", 1, &r), PD_EINVAL, "after the sequence finished");
    pd_stop_free(s);
}

TEST(stop_include_stop_str_in_output)
{
    pd_sampling_params p = pd_sampling_default_params();
    const char *stop[] = {"\n\nUser:"};
    p.stop = stop;
    p.n_stop = 1;
    p.include_stop_str_in_output = true;
    pd_stop_model m = model();
    pd_stop *s = NULL;
    ASSERT_OK(pd_stop_create(&p, &m, 5, &s));
    /* no hold-back; the match ends inside the last delta, whose rest is dropped */
    tok_step steps[] = {{10, "Hello"}, {11, ","},    {12, " world"},
                        {13, "\n\n"},  {14, "User"}, {15, ": tail"}};
    char chunks[6][64], all[256];
    pd_stop_result r;
    ASSERT_EQ_INT(feed(s, steps, 6, chunks, all, &r), 6);
    ASSERT_STR_EQ(chunks[0], "Hello");
    ASSERT_STR_EQ(chunks[3], "\n\n");
    ASSERT_STR_EQ(chunks[5], ":");
    ASSERT_STR_EQ(all, "Hello, world\n\nUser:");
    ASSERT_EQ_INT(r.stop_kind, PD_STOP_REASON_STRING);
    pd_stop_free(s);
}

TEST(stop_string_across_deltas_and_rest_of_token_dropped)
{
    pd_sampling_params p = pd_sampling_default_params();
    const char *stop[] = {"bcd"};
    p.stop = stop;
    p.n_stop = 1;
    pd_stop_model m = model();
    pd_stop *s = NULL;
    ASSERT_OK(pd_stop_create(&p, &m, 1, &s));
    tok_step steps[] = {{5, "xa"}, {6, "b"}, {7, "c"}, {8, "dYZ"}, {9, "never"}};
    char chunks[5][64], all[256];
    pd_stop_result r;
    ASSERT_EQ_INT(feed(s, steps, 5, chunks, all, &r), 4);
    ASSERT_STR_EQ(all, "xa");
    ASSERT_STR_EQ(r.stop_string, "bcd");
    pd_stop_free(s);
    /* a partial match that fails is released once ruled out */
    ASSERT_OK(pd_stop_create(&p, &m, 1, &s));
    tok_step miss[] = {{5, "ab"}, {6, "c"}, {7, "e"}, {8, "f"}};
    ASSERT_EQ_INT(feed(s, miss, 4, chunks, all, &r), 4);
    ASSERT_EQ_INT(r.finish, PD_FINISH_NONE);
    ASSERT_STR_EQ(chunks[0], "");  /* "ab": 2 held (B = 2) */
    ASSERT_STR_EQ(chunks[1], "a"); /* "abc": keep "bc" */
    ASSERT_STR_EQ(chunks[2], "b"); /* "abce": keep "ce" */
    ASSERT_STR_EQ(chunks[3], "c");
    ASSERT_STR_EQ(all, "abc");
    pd_stop_free(s);
}

TEST(stop_strings_list_order_wins)
{
    /* §9.2: the strings are tried in the order of the list; the first found wins, even when
     * a later string occurs earlier in the text. */
    pd_sampling_params p = pd_sampling_default_params();
    const char *stop[] = {"world", "lo"};
    p.stop = stop;
    p.n_stop = 2;
    pd_stop_model m = model();
    pd_stop *s = NULL;
    ASSERT_OK(pd_stop_create(&p, &m, 1, &s));
    tok_step steps[] = {{5, "hello world!"}};
    char all[256];
    pd_stop_result r;
    ASSERT_EQ_INT(feed(s, steps, 1, NULL, all, &r), 1);
    ASSERT_STR_EQ(all, "hello ");
    ASSERT_EQ_INT(r.stop_index, 0);
    pd_stop_free(s);
    /* "lo" alone in a token */
    ASSERT_OK(pd_stop_create(&p, &m, 1, &s));
    tok_step st2[] = {{5, "hel"}, {6, "lo"}};
    ASSERT_EQ_INT(feed(s, st2, 2, NULL, all, &r), 2);
    ASSERT_STR_EQ(all, "hel");
    ASSERT_EQ_INT(r.stop_index, 1);
    ASSERT_STR_EQ(r.stop_string, "lo");
    pd_stop_free(s);
}

TEST(stop_holdback_counts_code_points)
{
    /* stop "é!" is 2 code points (3 bytes): B = 1 code point, so "aé" releases "a" */
    pd_sampling_params p = pd_sampling_default_params();
    const char *stop[] = {"\xC3\xA9!", "xy"};
    p.stop = stop;
    p.n_stop = 2;
    pd_stop_model m = model();
    pd_stop *s = NULL;
    ASSERT_OK(pd_stop_create(&p, &m, 1, &s));
    tok_step steps[] = {{5, "a\xC3\xA9"}, {6, "\xE2\x82\xAC"}, {7, "\xC3\xA9"}, {8, "!"}};
    char chunks[4][64], all[256];
    pd_stop_result r;
    ASSERT_EQ_INT(feed(s, steps, 4, chunks, all, &r), 4);
    ASSERT_STR_EQ(chunks[0], "a");
    ASSERT_STR_EQ(chunks[1], "\xC3\xA9");
    ASSERT_STR_EQ(chunks[2], "\xE2\x82\xAC");
    ASSERT_STR_EQ(chunks[3], "");
    ASSERT_STR_EQ(all, "a\xC3\xA9\xE2\x82\xAC");
    ASSERT_EQ_INT(r.stop_index, 0);
    pd_stop_free(s);
}

TEST(stop_eos_and_stop_token_ids)
{
    pd_sampling_params p = pd_sampling_default_params();
    int32_t ids[] = {7};
    p.stop_token_ids = ids;
    p.n_stop_token_ids = 1;
    int32_t extra[] = {2, 9}; /* generation_config eos_token_id: primary 2 and 9 */
    pd_stop_model m = model();
    m.extra_eos_ids = extra;
    m.n_extra_eos_ids = 2;
    char all[256];
    pd_stop_result r;
    pd_stop *s = NULL;

    /* primary EOS: stop, null reason, its text dropped */
    ASSERT_OK(pd_stop_create(&p, &m, 3, &s));
    tok_step e1[] = {{5, "Hi"}, {2, "</s>"}};
    ASSERT_EQ_INT(feed(s, e1, 2, NULL, all, &r), 2);
    ASSERT_STR_EQ(all, "Hi");
    ASSERT_EQ_INT(r.finish, PD_FINISH_STOP);
    ASSERT_EQ_INT(r.stop_kind, PD_STOP_REASON_NULL);
    /* a finish by EOS still releases the detokenizer's pending tail */
    ASSERT_OK(pd_stop_flush(s, "\xEF\xBF\xBD", 3, &r));
    ASSERT_EQ_INT(r.text_len, 3);
    ASSERT(memcmp(r.text, "\xEF\xBF\xBD", 3) == 0);
    ASSERT_EQ_INT(r.finish, PD_FINISH_STOP);
    pd_stop_free(s);

    /* client stop id: reason = the id */
    ASSERT_OK(pd_stop_create(&p, &m, 3, &s));
    tok_step e2[] = {{5, "Hi"}, {7, "!"}};
    ASSERT_EQ_INT(feed(s, e2, 2, NULL, all, &r), 2);
    ASSERT_STR_EQ(all, "Hi");
    ASSERT_EQ_INT(r.stop_kind, PD_STOP_REASON_TOKEN);
    ASSERT_EQ_INT(r.stop_token, 7);
    pd_stop_free(s);

    /* generation_config EOS id: reason = the id */
    ASSERT_OK(pd_stop_create(&p, &m, 3, &s));
    tok_step e3[] = {{9, "<|eot|>"}};
    ASSERT_EQ_INT(feed(s, e3, 1, NULL, all, &r), 1);
    ASSERT_STR_EQ(all, "");
    ASSERT_EQ_INT(r.stop_kind, PD_STOP_REASON_TOKEN);
    ASSERT_EQ_INT(r.stop_token, 9);
    pd_stop_free(s);

    /* include_stop_str_in_output keeps the token's text */
    p.include_stop_str_in_output = true;
    ASSERT_OK(pd_stop_create(&p, &m, 3, &s));
    ASSERT_EQ_INT(feed(s, e2, 2, NULL, all, &r), 2);
    ASSERT_STR_EQ(all, "Hi!");
    pd_stop_free(s);
    p.include_stop_str_in_output = false;

    /* ignore_eos: neither EOS nor generation_config ids stop; client ids still do */
    p.ignore_eos = true;
    ASSERT_OK(pd_stop_create(&p, &m, 3, &s));
    tok_step e4[] = {{2, "a"}, {9, "b"}, {5, "c"}, {7, "d"}};
    ASSERT_EQ_INT(feed(s, e4, 4, NULL, all, &r), 4);
    ASSERT_STR_EQ(all, "abc");
    ASSERT_EQ_INT(r.stop_token, 7);
    pd_stop_free(s);
}

TEST(stop_length_limits)
{
    pd_sampling_params p = pd_sampling_default_params();
    pd_stop_model m = model();
    char all[256];
    pd_stop_result r;
    pd_stop *s = NULL;
    const char *stop[] = {"zzz"};
    p.stop = stop;
    p.n_stop = 1;
    p.max_tokens = 3;
    ASSERT_EQ_INT(pd_stop_effective_max_tokens(&p, &m, 10), 3);
    ASSERT_OK(pd_stop_create(&p, &m, 10, &s));
    tok_step st[] = {{5, "ab"}, {6, "cd"}, {7, "ef"}, {8, "gh"}};
    char chunks[4][64];
    ASSERT_EQ_INT(feed(s, st, 4, chunks, all, &r), 3);
    ASSERT_EQ_INT(r.finish, PD_FINISH_LENGTH);
    ASSERT_EQ_INT(r.stop_kind, PD_STOP_REASON_NULL);
    ASSERT_STR_EQ(pd_finish_reason_name(r.finish), "length");
    ASSERT_STR_EQ(chunks[2], "cdef"); /* held text released at the finish */
    ASSERT_STR_EQ(all, "abcdef");
    ASSERT_OK(pd_stop_flush(s, "\xEF\xBF\xBD", 3, &r));
    ASSERT_EQ_INT(r.text_len, 3);
    pd_stop_free(s);

    /* EOS as the last allowed token: "length" wins (vLLM v1 checks length first) and the
     * token's text is kept */
    p.max_tokens = 2;
    ASSERT_OK(pd_stop_create(&p, &m, 10, &s));
    tok_step eos_last[] = {{5, "a"}, {2, "E"}};
    ASSERT_EQ_INT(feed(s, eos_last, 2, NULL, all, &r), 2);
    ASSERT_EQ_INT(r.finish, PD_FINISH_LENGTH);
    ASSERT_STR_EQ(all, "aE");
    pd_stop_free(s);

    /* a stop string in the last token overrides "length" */
    ASSERT_OK(pd_stop_create(&p, &m, 10, &s));
    tok_step str_last[] = {{5, "z"}, {6, "zz!"}};
    ASSERT_EQ_INT(feed(s, str_last, 2, NULL, all, &r), 2);
    ASSERT_EQ_INT(r.finish, PD_FINISH_STOP);
    ASSERT_EQ_INT(r.stop_kind, PD_STOP_REASON_STRING);
    ASSERT_STR_EQ(all, "");
    pd_stop_free(s);

    /* max_model_len: P + generated = L */
    p.max_tokens = -1;
    m.max_model_len = 12;
    ASSERT_EQ_INT(pd_stop_effective_max_tokens(&p, &m, 10), 2);
    ASSERT_OK(pd_stop_create(&p, &m, 10, &s));
    ASSERT_EQ_INT(feed(s, st, 4, NULL, all, &r), 2);
    ASSERT_EQ_INT(r.finish, PD_FINISH_LENGTH);
    pd_stop_free(s);

    /* generation_config max_new_tokens caps too */
    m.max_model_len = 1000;
    m.max_new_tokens = 1;
    p.max_tokens = 50;
    ASSERT_EQ_INT(pd_stop_effective_max_tokens(&p, &m, 10), 1);
    ASSERT_OK(pd_stop_create(&p, &m, 10, &s));
    ASSERT_EQ_INT(feed(s, st, 4, NULL, all, &r), 1);
    ASSERT_EQ_INT(r.finish, PD_FINISH_LENGTH);
    pd_stop_free(s);

    /* bad sizes */
    m.max_new_tokens = -1;
    ASSERT_ERR(pd_stop_create(&p, &m, 1000, &s), PD_EINVAL, "leaves no room");
    m.max_model_len = 0;
    ASSERT_ERR(pd_stop_create(&p, &m, 0, &s), PD_EINVAL, "max_model_len must be positive");
    ASSERT(s == NULL);
}

TEST(stop_min_tokens)
{
    pd_sampling_params p = pd_sampling_default_params();
    const char *stop[] = {"ab"};
    p.stop = stop;
    p.n_stop = 1;
    p.min_tokens = 2;
    pd_stop_model m = model();
    char all[256];
    pd_stop_result r;
    pd_stop *s = NULL;
    /* the EOS at output 1 does not stop (output count < min_tokens); "ab" completed by the
     * 2nd token is not checked (stop strings need count > min_tokens); the 3rd token's new
     * text is searched with one code point of look-behind */
    ASSERT_OK(pd_stop_create(&p, &m, 3, &s));
    tok_step st[] = {{2, "x"}, {5, "ab"}, {6, "ca"}, {7, "b"}};
    ASSERT_EQ_INT(feed(s, st, 4, NULL, all, &r), 4);
    ASSERT_EQ_INT(r.stop_kind, PD_STOP_REASON_STRING);
    ASSERT_STR_EQ(all, "xabc");
    pd_stop_free(s);
    /* stop ids count from min_tokens on: the 2nd token may be EOS */
    ASSERT_OK(pd_stop_create(&p, &m, 3, &s));
    tok_step st2[] = {{5, "q"}, {2, "E"}};
    ASSERT_EQ_INT(feed(s, st2, 2, NULL, all, &r), 2);
    ASSERT_EQ_INT(r.finish, PD_FINISH_STOP);
    ASSERT_STR_EQ(all, "q");
    pd_stop_free(s);
}

TEST(stop_long_text_and_no_stop_strings)
{
    /* no stop strings: every delta is released at once, buffers stay bounded */
    pd_sampling_params p = pd_sampling_default_params();
    pd_stop_model m = model();
    m.max_model_len = 100000;
    pd_stop *s = NULL;
    ASSERT_OK(pd_stop_create(&p, &m, 1, &s));
    char big[600];
    memset(big, 'q', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    for (int i = 0; i < 2000; i++) {
        pd_stop_result r;
        ASSERT_OK(pd_stop_push(s, 5, big, strlen(big), &r));
        ASSERT_EQ_INT(r.text_len, strlen(big));
        ASSERT_EQ_INT(r.finish, PD_FINISH_NONE);
    }
    pd_stop_result r;
    ASSERT_ERR(pd_stop_flush(s, "", 0, &r), PD_EINVAL, "before the sequence finished");
    ASSERT_ERR(pd_stop_push(s, 5, NULL, 3, &r), PD_EINVAL, "NULL text");
    pd_stop_free(s);
    /* with a long stop string and many tokens, the held text stays at B code points */
    const char *stop[] = {"0123456789"};
    p.stop = stop;
    p.n_stop = 1;
    ASSERT_OK(pd_stop_create(&p, &m, 1, &s));
    size_t total = 0;
    for (int i = 0; i < 5000; i++) {
        ASSERT_OK(pd_stop_push(s, 5, "abc", 3, &r));
        total += r.text_len;
        ASSERT(r.finish == PD_FINISH_NONE);
    }
    ASSERT_EQ_INT(total, 5000 * 3 - 9);
    ASSERT_OK(pd_stop_push(s, 5, "x0123456789y", 12, &r));
    ASSERT_EQ_INT(r.finish, PD_FINISH_STOP);
    ASSERT_EQ_INT(r.text_len, 9 + 1);
    pd_stop_free(s);
}

/* pd_stop_complete (a structured-output grammar with nothing left to follow): the next push
 * finishes with "stop" and a null stop_reason, its text and the held-back text released; a
 * length limit reached by the same token still says "length". */
TEST(stop_complete_ends_as_eos)
{
    pd_sampling_params p = pd_sampling_default_params();
    const char *stops[] = {"}}"};
    p.stop = stops;
    p.n_stop = 1;
    pd_stop_model m = model();
    pd_stop *s = NULL;
    ASSERT_OK(pd_stop_create(&p, &m, 4, &s));
    pd_stop_result r;
    ASSERT_OK(pd_stop_push(s, 10, "{\"a\":1", 6, &r));
    ASSERT_EQ_INT(r.finish, PD_FINISH_NONE);
    char all[64] = "";
    strncat(all, r.text, r.text_len);
    pd_stop_complete(s);
    ASSERT_OK(pd_stop_push(s, 11, "}", 1, &r));
    ASSERT_EQ_INT(r.finish, PD_FINISH_STOP);
    ASSERT_EQ_INT(r.stop_kind, PD_STOP_REASON_NULL);
    strncat(all, r.text, r.text_len);
    ASSERT_STR_EQ(all, "{\"a\":1}"); /* the held-back "}" is released, not a stop match */
    pd_stop_result f;
    ASSERT_OK(pd_stop_flush(s, "", 0, &f));
    ASSERT_EQ_INT(f.text_len, 0);
    pd_stop_free(s);
    p.n_stop = 0;
    p.max_tokens = 1;
    ASSERT_OK(pd_stop_create(&p, &m, 4, &s));
    pd_stop_complete(s);
    ASSERT_OK(pd_stop_push(s, 11, "1", 1, &r));
    ASSERT_EQ_INT(r.finish, PD_FINISH_LENGTH);
    pd_stop_free(s);
}
