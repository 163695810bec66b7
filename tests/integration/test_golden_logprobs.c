/* Golden tests of logprobs (§12), §18.29: text_offset on plain text and after a held-back
 * byte, and -inf logits written as -9999.0 (on the crafted model of golden_clusters.c). */
#define _GNU_SOURCE
#include "golden.h"

#include <stdlib.h>

/* ---- logprobs (§12): text_offset and -inf ---------------------------------------------------- */

/* Code points of a UTF-8 string (what Python's len() counts). */
static int64_t code_points(const char *s)
{
    int64_t n = 0;
    for (; s && *s; s++) n += ((unsigned char)*s & 0xC0) != 0x80;
    return n;
}

/* Checks one completions logprobs object against the contract's §12 (k = logprobs): the four
 * lists have one entry per token; offsets start at first and each next offset is the previous
 * one plus the code points of the previous token's text (vLLM's rule, which §12's "counts code
 * points from the start of the choice's text" gives when the tokens spell the text); every
 * top_logprobs object has 1..k+1 entries and holds the sampled token with its own logprob.
 * *next gets the offset after the last token. false with the reason in why. */
static bool check_offsets(json_t *lp, int k, int64_t first, int64_t *next, char *why, size_t wn)
{
    json_t *off = json_object_get(lp, "text_offset"), *tl = json_object_get(lp, "token_logprobs"),
           *toks = json_object_get(lp, "tokens"), *top = json_object_get(lp, "top_logprobs");
    size_t n = json_array_size(toks);
    if (!json_is_array(off) || json_array_size(off) != n || json_array_size(tl) != n ||
        json_array_size(top) != n) {
        snprintf(why, wn, "lists of different lengths");
        return false;
    }
    int64_t at = first;
    for (size_t i = 0; i < n; i++) {
        const char *t = json_string_value(json_array_get(toks, i));
        json_t *o = json_array_get(off, i), *tp = json_array_get(top, i);
        if (!t || !json_is_integer(o) || json_integer_value(o) != at) {
            snprintf(why, wn, "token %zu (%s): text_offset %lld, expected %lld", i, t ? t : "?",
                     (long long)json_integer_value(o), (long long)at);
            char *dump = json_dumps(lp, JSON_COMPACT);
            printf("    logprobs: %s\n", dump ? dump : "?");
            free(dump);
            return false;
        }
        size_t m = json_object_size(tp);
        json_t *own = json_object_get(tp, t);
        if (m < 1 || m > (size_t)k + 1 || !own ||
            json_number_value(own) != json_number_value(json_array_get(tl, i))) {
            snprintf(why, wn, "token %zu (%s): top_logprobs with %zu entries, own value %s", i, t,
                     m, own ? "differs" : "absent");
            return false;
        }
        at += code_points(t);
    }
    *next = at;
    return true;
}

/* The concatenated token texts of a logprobs object (malloc'd). */
static char *joined_tokens(json_t *lp)
{
    size_t i, cap = 1, at = 0;
    json_t *v;
    json_array_foreach(json_object_get(lp, "tokens"), i, v) cap += strlen(json_string_value(v));
    char *s = malloc(cap);
    if (!s) return NULL;
    json_array_foreach(json_object_get(lp, "tokens"), i, v)
    {
        size_t l = strlen(json_string_value(v));
        memcpy(s + at, json_string_value(v), l);
        at += l;
    }
    s[at] = '\0';
    return s;
}

/* One greedy completions prompt (logprobs 3, 10 tokens) checked by check_offsets from 0 (echo
 * false: the choice's text starts with the first generated token), and: one entry per
 * completion token; the tokens spell the text (then §12's "from the start of the choice's
 * text" and vLLM's token-length rule give the same offsets); the last offset plus the last
 * token's length is the text's length; the same request streamed has the same tokens and
 * offsets, continued across chunks, and the same text. *fffd: a token's text has U+FFFD. */
static bool offsets_case(const char *prompt, bool *fffd, char *why, size_t wn)
{
    char *pj = jstr(prompt), body[512], sbody[512];
    char text[1024] = "", stext[1024] = "";
    snprintf(body, sizeof body,
             "{\"prompt\":%s,\"max_tokens\":10,\"temperature\":0,\"ignore_eos\":true,"
             "\"logprobs\":3}",
             pj);
    json_t *o = post_ok(g_port, "/v1/completions", body), *ev[64];
    json_t *lp = json_object_get(json_array_get(json_object_get(o, "choices"), 0), "logprobs");
    int64_t end = -1, at = 0;
    bool ok = o && check_offsets(lp, 3, 0, &end, why, wn);
    char *joined = o ? joined_tokens(lp) : NULL;
    snprintf(text, sizeof text, "%s", o && choice_text(o, 0) ? choice_text(o, 0) : "");
    size_t n_tok = json_array_size(json_object_get(lp, "tokens")), n_stream = 0;
    int64_t ct = o ? usage_of(o, "completion_tokens") : -1;
    *fffd = joined && strstr(joined, "\xef\xbf\xbd");
    if (ok && (int64_t)n_tok != ct)
        snprintf(why, wn, "%zu logprob tokens, completion_tokens %lld", n_tok, (long long)ct),
            ok = false;
    if (ok && (!joined || strcmp(joined, text) != 0))
        snprintf(why, wn, "the tokens spell \"%s\", the text is \"%s\"", joined, text), ok = false;
    if (ok && end != code_points(text))
        snprintf(why, wn, "offsets end at %lld, the text has %lld code points", (long long)end,
                 (long long)code_points(text)),
            ok = false;
    free(joined);
    json_decref(o);
    /* the same request streamed */
    snprintf(sbody, sizeof sbody,
             "{\"prompt\":%s,\"max_tokens\":10,\"temperature\":0,\"ignore_eos\":true,"
             "\"logprobs\":3,\"stream\":true}",
             pj);
    bool done = false;
    int nev = ok ? stream_events(g_port, "/v1/completions", sbody, ev, 64, &done) : 0;
    if (ok && (nev <= 0 || !done)) snprintf(why, wn, "the stream failed"), ok = false;
    for (int i = 0; i < nev && ok; i++) {
        json_t *c = json_array_get(json_object_get(ev[i], "choices"), 0);
        json_t *clp = json_object_get(c, "logprobs");
        if (!c || json_is_null(clp)) continue;
        if (!check_offsets(clp, 3, at, &at, why, wn)) {
            size_t l = strlen(why);
            snprintf(why + l, wn - l, " (stream chunk %d)", i);
            ok = false;
        }
        n_stream += json_array_size(json_object_get(clp, "tokens"));
        snprintf(stext + strlen(stext), sizeof stext - strlen(stext), "%s",
                 json_string_value(json_object_get(c, "text")));
    }
    free_events(ev, nev);
    if (ok && (n_stream != n_tok || strcmp(stext, text) != 0 || at != end))
        snprintf(why, wn, "stream: %zu tokens, text \"%s\", end %lld", n_stream, stext,
                 (long long)at),
            ok = false;
    if (!ok) {
        size_t l = strlen(why);
        snprintf(why + l, wn - l, " [POST /v1/completions %.200s; text \"%.200s\"]",
                 n_stream ? sbody : body, text);
    }
    free(pj);
    return ok;
}

/* §18.29 (text_offset): outputs that are plain text (ASCII and a 2-byte "é" prompt; no token is
 * a partial UTF-8 sequence), non-streaming and streaming; n=2 choices each count from their own
 * start (echo with logprobs, which puts the prompt first: golden_29_prompt_logprobs). */
TEST(golden_29_text_offset)
{
    FIXTURE();
    static const char *const prompts[] = {"The quick brown fox", "Caf\xc3\xa9 au lait"};
    for (size_t p = 0; p < sizeof prompts / sizeof *prompts; p++) {
        char why[1024] = "";
        bool fffd = false;
        bool ok = offsets_case(prompts[p], &fffd, why, sizeof why);
        ASSERT_MSG(ok, "prompt \"%s\": %s", prompts[p], why);
        ASSERT_MSG(!fffd, "prompt \"%s\": a token is U+FFFD; this case wants plain text",
                   prompts[p]);
    }
    json_t *o;
    /* n=2 sampled: each choice's offsets start at 0 and follow its own tokens */
    o = post_ok(g_port, "/v1/completions",
                "{\"prompt\":\"Once upon\",\"max_tokens\":8,\"ignore_eos\":true,"
                "\"logprobs\":2,\"n\":2,\"temperature\":1.0,\"seed\":11}");
    ASSERT(o);
    for (size_t i = 0; i < 2; i++) {
        char why[256];
        int64_t end;
        json_t *lp = json_object_get(json_array_get(json_object_get(o, "choices"), i), "logprobs");
        bool ok = check_offsets(lp, 2, 0, &end, why, sizeof why);
        if (!ok) json_decref(o);
        ASSERT_MSG(ok, "n=2 choice %zu: %s", i, why);
    }
    json_decref(o);
}

/* §18.29 (text_offset after a held-back byte): greedy output of prompt "x" on the tiny model has
 * a lone byte token that is not valid UTF-8 (token text U+FFFD, and the text gets U+FFFD too,
 * once the next token shows the byte is not the start of a character). The tokens still spell
 * the text, so the token after it starts one code point later, by §12 and by vLLM alike. */
TEST(golden_29_text_offset_after_invalid_byte)
{
    FIXTURE();
    char why[1024] = "";
    bool fffd = false;
    bool ok = offsets_case("x", &fffd, why, sizeof why);
    ASSERT_MSG(ok, "prompt \"x\": %s", why);
    ASSERT_MSG(fffd, "prompt \"x\" no longer yields a U+FFFD token; pick another prompt");
}

/* §18.29 (-inf): on a model whose raw logits are -inf for every token but six (see
 * neginf_model.py), a chat request with top_logprobs 20 lists the six finite tokens first and
 * then 14 tokens at exactly -9999.0; the finite ones' probabilities sum to 1 (the -inf ones
 * carry none); completions top_logprobs (20) holds -9999.0 values too, and the body spells
 * them "-9999.0" (§9.4), never -inf, -Infinity or a bare -9999. The sampled tokens' own
 * logprobs are finite. */
TEST(golden_29_neginf_written_as_floor)
{
    if (!neginf_start()) ASSERT_MSG(0, "the -inf cluster did not start");
    resp r;
    ASSERT_EQ_INT(post(g_neginf.port, "/v1/chat/completions",
                       "{\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}],"
                       "\"max_tokens\":3,\"ignore_eos\":true,\"logprobs\":true,"
                       "\"top_logprobs\":20,\"return_tokens_as_token_ids\":true}",
                       &r),
                  0);
    int st = r.status;
    json_t *o = st == 200 ? json_loads(r.body, 0, NULL) : NULL;
    bool spelled = r.body && strstr(r.body, "\"logprob\":-9999.0,") && !strstr(r.body, "-inf") &&
                   !strstr(r.body, "Infinity") && !strstr(r.body, "NaN") &&
                   !strstr(r.body, "-9999,");
    char head[300];
    snprintf(head, sizeof head, "%.290s", r.body ? r.body : "");
    resp_free(&r);
    ASSERT_MSG(o, "chat: %d %s", st, head);
    json_t *content = json_object_get(
        json_object_get(json_array_get(json_object_get(o, "choices"), 0), "logprobs"), "content");
    size_t n = json_array_size(content);
    char why[300] = "";
    for (size_t i = 0; i < n && !why[0]; i++) {
        json_t *item = json_array_get(content, i);
        int tok = token_id_of(json_string_value(json_object_get(item, "token")));
        double own = json_number_value(json_object_get(item, "logprob"));
        json_t *top = json_object_get(item, "top_logprobs");
        if (!is_finite_id(tok) || !(own > -9999.0))
            snprintf(why, sizeof why, "token %zu: sampled id %d with logprob %g", i, tok, own);
        if (json_array_size(top) != 20)
            snprintf(why, sizeof why, "token %zu: %zu top_logprobs", i, json_array_size(top));
        double mass = 0.0, prev = 1.0;
        for (size_t j = 0; j < json_array_size(top) && !why[0]; j++) {
            json_t *e = json_array_get(top, j);
            int id = token_id_of(json_string_value(json_object_get(e, "token")));
            double v = json_number_value(json_object_get(e, "logprob"));
            bool finite = j < g_n_finite;
            if (v > prev) snprintf(why, sizeof why, "token %zu: top_logprobs not sorted", i);
            prev = v;
            if (finite && (!is_finite_id(id) || !(v > -9999.0)))
                snprintf(why, sizeof why,
                         "token %zu: top %zu is id %d at %g, expected a finite "
                         "token",
                         i, j, id, v);
            if (!finite && (is_finite_id(id) || v != -9999.0))
                snprintf(why, sizeof why,
                         "token %zu: top %zu is id %d at %.17g, expected an "
                         "-inf token written -9999.0",
                         i, j, id, v);
            if (finite) mass += exp(v);
        }
        if (!why[0] && fabs(mass - 1.0) > 1e-4)
            snprintf(why, sizeof why, "token %zu: the finite tokens' probabilities sum to %.9g", i,
                     mass);
    }
    json_decref(o);
    ASSERT_EQ_INT((long long)n, 3);
    ASSERT_MSG(!why[0], "%s", why);
    ASSERT_MSG(spelled, "the body does not write -inf as -9999.0: %s", head);

    /* completions: the object maps texts; 20 asked, six finite, so -9999.0 values appear */
    ASSERT_EQ_INT(post(g_neginf.port, "/v1/completions",
                       "{\"prompt\":[5,6,7],\"max_tokens\":2,\"ignore_eos\":true,"
                       "\"logprobs\":20,\"return_tokens_as_token_ids\":true}",
                       &r),
                  0);
    st = r.status;
    o = st == 200 ? json_loads(r.body, 0, NULL) : NULL;
    spelled = r.body && strstr(r.body, ":-9999.0") && !strstr(r.body, "-inf") &&
              !strstr(r.body, "Infinity") && !strstr(r.body, "NaN") && !strstr(r.body, "-9999,") &&
              !strstr(r.body, "-9999}");
    snprintf(head, sizeof head, "%.290s", r.body ? r.body : "");
    resp_free(&r);
    ASSERT_MSG(o, "completions: %d %s", st, head);
    json_t *lp = json_object_get(json_array_get(json_object_get(o, "choices"), 0), "logprobs");
    json_t *tops = json_object_get(lp, "top_logprobs");
    for (size_t i = 0; i < json_array_size(tops) && !why[0]; i++) {
        const char *key;
        json_t *v;
        size_t n_floor = 0, n_fin = 0;
        double own = json_number_value(json_array_get(json_object_get(lp, "token_logprobs"), i));
        json_object_foreach(json_array_get(tops, i), key, v)
        {
            bool fin = is_finite_id(token_id_of(key));
            double x = json_number_value(v);
            if (fin && x > -9999.0)
                n_fin++;
            else if (!fin && x == -9999.0)
                n_floor++;
            else
                snprintf(why, sizeof why, "token %zu: %s at %.17g", i, key, x);
        }
        if (!why[0] && (n_fin != g_n_finite || n_floor != 20 - g_n_finite || !(own > -9999.0)))
            snprintf(why, sizeof why, "token %zu: %zu finite, %zu at -9999.0, own %g", i, n_fin,
                     n_floor, own);
    }
    size_t n_steps = json_array_size(tops);
    json_decref(o);
    ASSERT_EQ_INT((long long)n_steps, 2);
    ASSERT_MSG(!why[0], "%s", why);
    ASSERT_MSG(spelled, "the body does not write -inf as -9999.0: %s", head);
}

/* ---- prompt logprobs: computed on the prefill instance, equal to the in-process engine's ---- */

/* Checks a body's "prompt_logprobs" (pl) against pd-generate's for the same prompt ids (ref,
 * the same shape without decoded_token): one entry per prompt token, null first; each lists the
 * prompt token first, then the top ones (at most k + 1 entries), with the engine's logprob and
 * rank; decoded_token a string. false with the reason in why. */
static bool plp_equal(json_t *pl, json_t *ref, const int32_t *ids, size_t n, int k, char *why,
                      size_t wn)
{
    if (!json_is_array(pl) || json_array_size(pl) != n || json_array_size(ref) != n ||
        !json_is_null(json_array_get(pl, 0))) {
        snprintf(why, wn, "%zu entries (reference %zu, prompt %zu), the first not null",
                 json_array_size(pl), json_array_size(ref), n);
        return false;
    }
    for (size_t i = 1; i < n; i++) {
        json_t *e = json_array_get(pl, i), *r = json_array_get(ref, i);
        char first[16];
        snprintf(first, sizeof first, "%d", ids[i]);
        void *it = json_object_iter(e);
        if (!it || strcmp(json_object_iter_key(it), first) != 0 ||
            json_object_size(e) != json_object_size(r) || json_object_size(e) > (size_t)k + 1) {
            snprintf(why, wn, "position %zu: %zu entries (reference %zu), first key %s, want %s", i,
                     json_object_size(e), json_object_size(r), it ? json_object_iter_key(it) : "-",
                     first);
            return false;
        }
        const char *key;
        json_t *v;
        json_object_foreach(e, key, v)
        {
            json_t *rv = json_object_get(r, key);
            double lp = json_number_value(json_object_get(v, "logprob"));
            double rl = json_number_value(json_object_get(rv, "logprob"));
            if (!rv || fabs(lp - rl) > 1e-6 ||
                json_integer_value(json_object_get(v, "rank")) !=
                    json_integer_value(json_object_get(rv, "rank")) ||
                !json_is_string(json_object_get(v, "decoded_token"))) {
                snprintf(why, wn, "position %zu token %s: logprob %.9g rank %lld, engine %.9g %lld",
                         i, key, lp, (long long)json_integer_value(json_object_get(v, "rank")), rl,
                         (long long)json_integer_value(json_object_get(rv, "rank")));
                return false;
            }
        }
    }
    return true;
}

/* pd-generate (the colocated engine) for one prompt with --prompt-logprobs k: its
 * prompt_logprobs (json_decref it), or NULL. */
static json_t *engine_plp(const int32_t *ids, size_t n, int k)
{
    char dir[600], kk[16];
    snprintf(dir, sizeof dir, "%s", pdt_tmp_dir());
    snprintf(kk, sizeof kk, "%d", k);
    char *extra[] = {"--prompt-logprobs", kk, NULL};
    cl_result res;
    memset(&res, 0, sizeof res);
    const int32_t *prompts[1] = {ids};
    if (cl_reference_ex(g_model, prompts, &n, 1, 2, 0.0, 0, dir, extra, &res) < 0) {
        printf("    pd-generate: %s\n", pd_last_error());
        return NULL;
    }
    json_t *o = res.prompt_logprobs ? json_loads(res.prompt_logprobs, 0, NULL) : NULL;
    free(res.prompt_logprobs);
    return o;
}

/* vLLM's prompt_logprobs through the 1P1D cluster: completions (n = 2: each choice has them) and
 * echo with logprobs (the prompt's tokens lead choice.logprobs, the first one null, text_offset
 * running on into the generated ones; streamed, the first chunk carries them), and chat (at
 * the top of the body); every value equals the colocated engine's (pd-generate). */
TEST(golden_29_prompt_logprobs)
{
    FIXTURE();
    int32_t ids[12];
    char list[256] = "";
    for (size_t i = 0; i < 12; i++) {
        ids[i] = (int32_t)(300 + 37 * i);
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%d", i ? "," : "", ids[i]);
    }
    json_t *ref = engine_plp(ids, 12, 3);
    ASSERT_MSG(ref, "pd-generate gave no prompt_logprobs");
    char body[768], why[512] = "";
    snprintf(body, sizeof body,
             "{\"prompt\":[%s],\"max_tokens\":3,\"temperature\":0,\"ignore_eos\":true,"
             "\"prompt_logprobs\":3,\"n\":2}",
             list);
    json_t *o = post_ok(g_port, "/v1/completions", body);
    bool ok = o != NULL;
    for (size_t c = 0; ok && c < 2; c++) {
        json_t *ch = json_array_get(json_object_get(o, "choices"), c);
        ok = plp_equal(json_object_get(ch, "prompt_logprobs"), ref, ids, 12, 3, why, sizeof why) &&
             json_is_null(json_object_get(ch, "logprobs"));
        if (!ok) snprintf(why + strlen(why), sizeof why - strlen(why), " (choice %zu)", c);
    }
    json_decref(o);
    ASSERT_MSG(ok, "completions prompt_logprobs: %s", why);

    /* echo + logprobs 2: 12 prompt items, then 3 generated ones */
    snprintf(body, sizeof body,
             "{\"prompt\":[%s],\"max_tokens\":3,\"temperature\":0,\"ignore_eos\":true,"
             "\"echo\":true,\"logprobs\":2,\"return_tokens_as_token_ids\":true}",
             list);
    o = post_ok(g_port, "/v1/completions", body);
    ASSERT(o);
    json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
    json_t *lp = json_object_get(ch, "logprobs"), *toks = json_object_get(lp, "tokens"),
           *tl = json_object_get(lp, "token_logprobs"), *top = json_object_get(lp, "top_logprobs"),
           *off = json_object_get(lp, "text_offset");
    ok = json_array_size(toks) == 15 && json_array_size(tl) == 15 && json_array_size(top) == 15 &&
         json_array_size(off) == 15 && json_is_null(json_array_get(tl, 0)) &&
         json_is_null(json_array_get(top, 0)) &&
         json_array_size(json_object_get(ch, "prompt_logprobs")) == 12;
    if (!ok) snprintf(why, sizeof why, "echo: %zu tokens, first not null", json_array_size(toks));
    int64_t at = 0;
    for (size_t i = 0; ok && i < 15; i++) {
        const char *t = json_string_value(json_array_get(toks, i));
        char want[32];
        snprintf(want, sizeof want, "token_id:%d", i < 12 ? ids[i] : 0);
        if (!t || json_integer_value(json_array_get(off, i)) != at || (i < 12 && strcmp(t, want)))
            snprintf(why, sizeof why, "echo token %zu: %s at %lld, want %s at %lld", i, t ? t : "?",
                     (long long)json_integer_value(json_array_get(off, i)), i < 12 ? want : "-",
                     (long long)at),
                ok = false;
        at += t ? code_points(t) : 0;
        if (!ok || i == 0 || i >= 12) continue;
        char key[16];
        snprintf(key, sizeof key, "%d", ids[i]);
        double e = json_number_value(
            json_object_get(json_object_get(json_array_get(ref, i), key), "logprob"));
        double g = json_number_value(json_array_get(tl, i));
        json_t *own = json_object_get(json_array_get(top, i), t);
        if (fabs(g - e) > 1e-6 || !own || json_number_value(own) != g ||
            json_object_size(json_array_get(top, i)) > 3)
            snprintf(why, sizeof why, "echo token %zu: logprob %.9g, engine %.9g", i, g, e),
                ok = false;
    }
    json_decref(o);
    ASSERT_MSG(ok, "%s", why);
    /* streamed: the first chunk holds the prompt's 12 items and the first token's (ids as
     * texts: a top token of this prompt is U+0000, which jansson refuses as an object key) */
    snprintf(body, sizeof body,
             "{\"prompt\":[%s],\"max_tokens\":3,\"temperature\":0,\"ignore_eos\":true,"
             "\"echo\":true,\"logprobs\":2,\"stream\":true,\"return_tokens_as_token_ids\":true}",
             list);
    json_t *ev[16];
    bool done = false;
    int nev = stream_events(g_port, "/v1/completions", body, ev, 16, &done);
    size_t first =
        nev > 0
            ? json_array_size(json_object_get(
                  json_object_get(json_array_get(json_object_get(ev[0], "choices"), 0), "logprobs"),
                  "tokens"))
            : 0;
    free_events(ev, nev);
    ASSERT_MSG(done && first == 13, "echo stream: %d events, first chunk %zu tokens", nev, first);

    /* chat: prompt_logprobs at the top of the body, equal to pd-generate --chat's */
    char gen_out[600];
    snprintf(gen_out, sizeof gen_out, "%s/chat_plp.jsonl", pdt_tmp_dir());
    char *argv[] = {(char *)cl_bin("tools/generate/pd-generate"),
                    "--model",
                    g_model,
                    "--chat",
                    "--prompt",
                    "Hello there",
                    "--json",
                    "--max-tokens",
                    "2",
                    "--temperature",
                    "0",
                    "--cpu-threads",
                    "1",
                    "--prompt-logprobs",
                    "2",
                    NULL};
    ASSERT_EQ_INT(cl_run(argv, gen_out, 120), 0);
    json_t *g = NULL;
    FILE *f = fopen(gen_out, "r");
    static char line[1 << 16];
    while (f && !g && fgets(line, sizeof line, f))
        if (line[0] == '{') g = json_loads(line, 0, NULL);
    if (f) fclose(f);
    ASSERT_MSG(g, "pd-generate --chat printed no result");
    json_t *pids = json_object_get(g, "prompt_token_ids");
    size_t np = json_array_size(pids);
    int32_t cids[256];
    for (size_t i = 0; i < np && i < 256; i++)
        cids[i] = (int32_t)json_integer_value(json_array_get(pids, i));
    o = post_ok(g_port, "/v1/chat/completions",
                "{\"messages\":[{\"role\":\"user\",\"content\":\"Hello there\"}],\"max_tokens\":2,"
                "\"temperature\":0,\"prompt_logprobs\":2}");
    ok = o && np <= 256 && usage_of(o, "prompt_tokens") == (int64_t)np &&
         plp_equal(json_object_get(o, "prompt_logprobs"), json_object_get(g, "prompt_logprobs"),
                   cids, np, 2, why, sizeof why);
    json_decref(o);
    json_decref(g);
    json_decref(ref);
    ASSERT_MSG(ok, "chat prompt_logprobs (%zu prompt tokens): %s", np, why);
}
