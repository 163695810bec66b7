/* Constrained decoding (structured output): JSON Schema, regex, choice and EBNF grammars
 * compiled to byte-level automata, and a per-sequence matcher that gives the token mask.
 *
 * Pipeline: a spec (pd_gspec) -> grammar expression (AST) -> one byte-level DFA per rule
 * (rules call each other only where recursion or sharing needs it: a pushdown automaton) ->
 * pd_grammar (immutable, reference-counted, shareable across threads). A pd_gmatcher holds
 * one sequence's parser state (a set of stacks) and computes masks by walking a byte trie of
 * the vocabulary; what a trie walk finds for a DFA state independently of the stack below it
 * is cached in the grammar (docs/structured_output.md).
 *
 * Thread safety: pd_gvocab and pd_grammar are immutable after creation (their mask caches
 * are filled under a lock); a pd_gmatcher belongs to one thread at a time.
 * Errors: functions return 0 or a negative PD_E* status after pd_error() (util/status.h);
 * compile refusals also fill a pd_gerr when one is given. */
#ifndef PD_GRAMMAR_GRAMMAR_H
#define PD_GRAMMAR_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct pd_tok pd_tok;
typedef struct pd_gvocab pd_gvocab;
typedef struct pd_grammar pd_grammar;
typedef struct pd_gmatcher pd_gmatcher;
typedef struct pd_gcache pd_gcache;

/* ---- vocabulary ------------------------------------------------------------------------ */

/* The token bytes of a pdserve tokenizer (byte-level BPE decoded through the GPT-2 byte map,
 * SentencePiece "▁" as a space and <0xNN> as the byte). Special tokens are never allowed by a
 * mask, except the EOS ids (pd_tok_eos_ids plus extra_eos, e.g. generation_config's) where
 * the grammar accepts. tok must outlive nothing: the bytes are copied. */
int pd_gvocab_from_tok(const pd_tok *tok, const int32_t *extra_eos, size_t n_extra_eos,
                       pd_gvocab **out);
/* A vocabulary from explicit token bytes (tests, other tokenizers). special[i] true (may be
 * NULL) excludes token i; eos ids are allowed only at accepting states. */
int pd_gvocab_create(int32_t n_tokens, const uint8_t *const *bytes, const uint32_t *lens,
                     const bool *special, const int32_t *eos, size_t n_eos, pd_gvocab **out);
void pd_gvocab_free(pd_gvocab *v);
int32_t pd_gvocab_size(const pd_gvocab *v);
/* Bytes of token id (NULL and 0 for special/unused ids). */
const uint8_t *pd_gvocab_token(const pd_gvocab *v, int32_t id, uint32_t *len);
bool pd_gvocab_is_eos(const pd_gvocab *v, int32_t id);
/* Words of a mask: (size + 31) / 32. */
static inline size_t pd_gmask_words(int32_t vocab_size)
{
    return ((size_t)vocab_size + 31) / 32;
}

/* ---- compiling ------------------------------------------------------------------------- */

typedef enum {
    PD_GSPEC_JSON_SCHEMA = 1, /* text: a JSON Schema (guided_json, response_format json_schema) */
    PD_GSPEC_JSON_OBJECT,     /* any JSON object (response_format json_object); text unused */
    PD_GSPEC_REGEX,           /* text: a regex the whole output must match (guided_regex) */
    PD_GSPEC_CHOICE,          /* text: a JSON array of strings (guided_choice) */
    PD_GSPEC_GRAMMAR,         /* text: GBNF (llama.cpp) or Lark-style EBNF (guided_grammar) */
} pd_gspec_kind;

typedef struct {
    pd_gspec_kind kind;
    const char *text;
    size_t len;
    /* guided_whitespace_pattern: a regex for the whitespace allowed between JSON tokens
     * (NULL: the default, [ \t\n\r]{0,PD_GRAMMAR_WS_MAX}). JSON kinds only. */
    const char *ws_pattern;
    /* JSON Schema: what the schema leaves unspecified is not generated, as vLLM's default
     * backend (XGrammar's strict mode) does: an object with `properties` and no
     * `additionalProperties` takes no other keys, an array with `prefixItems` and no `items`
     * no further items. false: the JSON Schema meaning (both allowed; MaskBench's). */
    bool strict;
} pd_gspec;

#define PD_GRAMMAR_WS_MAX 20

/* What a refusal names: the JSON Schema keyword and its JSON pointer ("/properties/a/not"),
 * or for regex and grammar text the byte offset. Unused fields are "" / -1. */
typedef struct {
    char keyword[64];
    char path[256];
    long pos;
    char msg[512];
} pd_gerr;

/* Compiles spec for vocabulary v (which must outlive the grammar). *out holds one
 * reference. Refusals are PD_EUNSUPPORTED (a keyword or construct that cannot be enforced)
 * or PD_EPARSE/PD_EINVAL (malformed input), with the message also in err when non-NULL. */
int pd_grammar_compile(const pd_gvocab *v, const pd_gspec *spec, pd_grammar **out, pd_gerr *err);
pd_grammar *pd_grammar_ref(pd_grammar *g);
void pd_grammar_unref(pd_grammar *g);
/* Sizes for logs and tests: rules and DFA states. */
void pd_grammar_stats(const pd_grammar *g, size_t *rules, size_t *states);

/* LRU cache of compiled grammars keyed by (kind, text, ws_pattern); thread-safe. get returns
 * a new reference (release with pd_grammar_unref); a refused spec is not cached. */
pd_gcache *pd_gcache_create(const pd_gvocab *v, size_t max_entries);
void pd_gcache_free(pd_gcache *c);
int pd_gcache_get(pd_gcache *c, const pd_gspec *spec, pd_grammar **out, pd_gerr *err);
/* Whether spec is compiled in the cache (no compile, no LRU change). */
bool pd_gcache_has(pd_gcache *c, const pd_gspec *spec);
void pd_gcache_stats(const pd_gcache *c, size_t *entries, uint64_t *hits, uint64_t *misses);

/* ---- matching (one per sequence) -------------------------------------------------------- */

int pd_gmatcher_create(pd_grammar *g, pd_gmatcher **out); /* takes its own reference */
void pd_gmatcher_free(pd_gmatcher *m);
/* A copy with the same state and history (n > 1, speculative branches). */
int pd_gmatcher_clone(const pd_gmatcher *m, pd_gmatcher **out);

/* Advances by token id. PD_EINVAL (state unchanged) when the mask would not allow it.
 * An EOS id is allowed only when accepting and ends the sequence (is_terminated). */
int pd_gmatcher_accept_token(pd_gmatcher *m, int32_t id);
/* Advances by raw bytes (tests, forced text); PD_EINVAL (unchanged) when not allowed. */
int pd_gmatcher_accept_bytes(pd_gmatcher *m, const void *bytes, size_t len);
/* Whether token id would be accepted now (no state change). */
bool pd_gmatcher_allows(pd_gmatcher *m, int32_t id);
/* Writes the allowed-token bitmask (bit id%32 of word id/32) over the whole vocabulary:
 * pd_gmask_words(vocab) words. EOS bits are set exactly when is_accepting. */
int pd_gmatcher_fill_mask(pd_gmatcher *m, uint32_t *bits);
/* The output so far is a complete match (EOS allowed). */
bool pd_gmatcher_is_accepting(const pd_gmatcher *m);
/* EOS was accepted, or the output is complete and nothing may follow. */
bool pd_gmatcher_is_terminated(const pd_gmatcher *m);
/* The grammar proved too ambiguous here: more parses at once than the matcher follows
 * (PD_GRAMMAR_MAX_STACKS, 1,024). Then fill_mask and accept fail (PD_EUNSUPPORTED) and allows is
 * false, until a rollback. */
bool pd_gmatcher_too_ambiguous(const pd_gmatcher *m);
/* Undoes the last k accepted tokens (k <= pd_gmatcher_history(m)). */
int pd_gmatcher_rollback(pd_gmatcher *m, size_t k);
size_t pd_gmatcher_history(const pd_gmatcher *m);

#endif
