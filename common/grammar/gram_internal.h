/* Internals of common/grammar: the expression tree every front end (regex, JSON Schema,
 * EBNF, choice) builds, the automaton compiler, and the compiled grammar. Not public. */
#ifndef PD_GRAMMAR_INTERNAL_H
#define PD_GRAMMAR_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "grammar/grammar.h"
#include "util/arena.h"

/* Size caps of one compile. A build may lower them: the fuzz targets do, so that an execution
 * never spends seconds building an automaton the cap would refuse anyway. */
#ifndef PD_GRAMMAR_MAX_STATES
#define PD_GRAMMAR_MAX_STATES 150000 /* DFA states, all rules together */
#endif
#ifndef PD_GRAMMAR_MAX_NFA
#define PD_GRAMMAR_MAX_NFA 1000000 /* NFA nodes */
#endif
/* Parse stacks alive at once in a matcher or a mask walk. An ambiguous grammar (a Lark rule
 * `r: "a" (r | )+`) can double them with every token; past the cap the matcher stops with an
 * error instead of spending exponential time and memory. */
#ifndef PD_GRAMMAR_MAX_STACKS
#define PD_GRAMMAR_MAX_STACKS 1024
#endif

/* ---- expressions -------------------------------------------------------------------- */
enum {
    X_NONE,  /* matches nothing */
    X_EMPTY, /* matches the empty string */
    X_BYTES, /* one byte in [lo, hi] */
    X_SEQ,
    X_ALT,
    X_REP,   /* kid{min,max}, max < 0: unbounded */
    X_CALL,  /* rule */
    X_AND,   /* intersection of kids[0], kids[1] (call-free) */
    X_NOT,   /* complement of kids[0] over all byte strings (call-free) */
    X_GRAPH, /* explicit automaton whose edges are expressions (object bodies) */
};

typedef struct gx gx;
typedef struct {
    int32_t from, to;
    gx *x; /* NULL: epsilon */
} gx_edge;

struct gx {
    uint8_t kind, lo, hi;
    int32_t n; /* kids / edges */
    int32_t min, max;
    int32_t rule;
    uint32_t mark; /* visit stamp */
    gx **kids;
    /* X_GRAPH */
    int32_t g_nodes, g_start;
    bool *g_final;
    gx_edge *g_edges;
};

typedef struct {
    const char *name;
    gx *body;
    bool keep; /* never inline (shared lexeme rules: strings, numbers) */
} gb_rule;

/* Builder: owns the expressions of one compile and the error. */
typedef struct {
    pd_arena *a;
    gb_rule *rules;
    int32_t n_rules, cap_rules;
    pd_gerr *err;
    int status;
    long budget; /* NFA nodes left */
    bool strict; /* pd_gspec.strict: unlisted properties and items refused */
} gb;

/* Sorts n code point ranges r (pairs lo, hi) and merges those that overlap or touch, in place;
 * the number left. */
int gram_ranges_merge(uint32_t *r, int n);
gx *gx_none(gb *b);
gx *gx_empty(gb *b);
gx *gx_byte(gb *b, uint8_t lo, uint8_t hi);
gx *gx_lit(gb *b, const char *s, size_t n);
gx *gx_str(gb *b, const char *s); /* gx_lit of a NUL-terminated string */
gx *gx_seq(gb *b, gx **kids, int n);
gx *gx_seq2(gb *b, gx *x, gx *y);
gx *gx_seq3(gb *b, gx *x, gx *y, gx *z);
gx *gx_alt(gb *b, gx **kids, int n);
gx *gx_alt2(gb *b, gx *x, gx *y);
gx *gx_rep(gb *b, gx *x, int32_t min, int32_t max);
gx *gx_opt(gb *b, gx *x);
gx *gx_star(gb *b, gx *x);
gx *gx_plus(gb *b, gx *x);
gx *gx_call(gb *b, int32_t rule);
gx *gx_and(gb *b, gx *x, gx *y);
gx *gx_not(gb *b, gx *x);
/* Code points [lo, hi] as UTF-8 byte sequences (surrogates excluded). */
gx *gx_cp_range(gb *b, uint32_t lo, uint32_t hi);
/* A set of code point ranges (sorted or not, may overlap) as UTF-8. */
gx *gx_cp_set(gb *b, const uint32_t *ranges, int n_ranges);

/* Whether the call-free expression x matches all of s[0..len): 1 yes, 0 no, -1 when x has
 * calls or graphs, or memory ran out. For checking short strings (property names). */
int gx_match(const gx *x, const uint8_t *s, size_t len);

int32_t gb_rule_new(gb *b, const char *name);
void gb_rule_set(gb *b, int32_t r, gx *body);
/* Records a refusal (first one wins); returns status. */
int gb_fail(gb *b, int status, const char *keyword, const char *path, long pos, const char *fmt,
            ...) __attribute__((format(printf, 6, 7)));
void gb_init(gb *b, pd_gerr *err);
void gb_free(gb *b);

/* ---- front ends ---------------------------------------------------------------------- */
enum { RX_FULL = 0, RX_SEARCH = 1 /* JSON Schema pattern: unanchored unless ^ / $ */ };
/* Parses a regex into an expression over the UTF-8 bytes of the matched text. */
gx *rx_parse(gb *b, const char *re, size_t len, int mode, const char *path);
int schema_compile(gb *b, const char *text, size_t len, const char *ws_pattern, int32_t *root);
int json_object_compile(gb *b, const char *ws_pattern, int32_t *root);
int ebnf_compile(gb *b, const char *text, size_t len, int32_t *root);

/* ---- compiled grammar ------------------------------------------------------------------ */
typedef struct {
    int32_t callee; /* rule */
    int32_t ret;    /* state to continue in after the callee */
} gcall;

typedef struct {
    int32_t rule;
    uint32_t flags;    /* GS_* */
    int32_t trans_off; /* into g->trans; ncls entries */
    int32_t calls_off, n_calls;
    int32_t cache_key; /* states with the same key share a mask-cache entry (leaf rules) */
} gstate;

enum { GS_FINAL = 1, GS_BYTES = 2 };

typedef struct {
    int32_t start; /* state */
    int32_t first, n_states;
    uint8_t cls[256]; /* byte -> class */
    int32_t ncls;
    bool leaf; /* no calls anywhere in the rule */
    const char *name;
} grule;

/* What a trie walk from one state finds without the stack below it. */
typedef struct gentry {
    uint32_t n_acc; /* tokens accepted inside the frame */
    bool bits;      /* acc is a bitset of the vocabulary, else a list of ids */
    uint32_t *acc;
    uint32_t n_pop; /* trie nodes after which the frame may end with bytes left */
    uint32_t *pops;
} gentry;

struct pd_grammar {
    _Atomic int refs;
    const pd_gvocab *v;
    grule *rules;
    int32_t n_rules, root;
    gstate *states;
    int32_t n_states;
    int32_t *trans; /* next state or -1 */
    gcall *calls;
    int32_t n_keys;
    _Atomic(gentry *) *cache; /* by cache_key: this grammar's own entries */
    _Atomic(gentry *) **slot; /* by cache_key: where its entry lives (cache or the share) */
    uint8_t *slot_shared;     /* by cache_key: slot is in the vocabulary's share */
    pthread_mutex_t lock;
};

/* Entries of call-free rules shared across the grammars of one vocabulary (share.c). */
typedef struct gshare gshare;
gshare *gshare_create(void);
void gshare_free(gshare *s);
/* Points g->slot of every key at its grammar-local slot, or at the share's slot for states of
 * call-free rules whose DFA is registered (identical tables); -1 out of memory. */
int gshare_attach(gshare *s, pd_grammar *g);
/* Publishes *e into a shared slot if the share has room: true when done (*e is then the slot's
 * entry, another thread's if it won), false to keep it locally. */
bool gshare_publish(gshare *s, _Atomic(gentry *) *slot, gentry **e, int32_t vocab_size);
size_t gentry_bytes(const gentry *e, int32_t vocab_size);

/* Builds the pushdown automaton of rules[root] (and every rule it reaches). */
int gram_build(gb *b, int32_t root, pd_grammar *g);
void gentry_free(gentry *e);

/* ---- vocabulary ---------------------------------------------------------------------- */
/* A byte trie in DFS preorder (node i's subtree is [i, next[i])); node 0 is the root. */
typedef struct {
    uint32_t n_nodes;
    uint8_t *byte;
    uint8_t *depth;
    uint32_t *next; /* first node after the subtree */
    int32_t *tok;   /* token ending here (the first of its duplicates), -1 none */
    uint32_t *full; /* the rest trie: the same node's index in the full trie */
} gtrie;

/* The slice: tokens whose bytes read as the start of a JSON string's body (valid UTF-8, cut
 * anywhere, without control characters, '"' or '\\'); most of a vocabulary. A state of a
 * call-free rule that keeps every such token alive without ending (JSON string contents,
 * object keys) accepts the whole slice, and its walk covers only the rest trie. */
enum { SL_DEAD = -1, SL_NSTATES = 8 };
int8_t gslice_next(int8_t st, uint8_t b); /* start state 0 */

struct pd_gvocab {
    int32_t n;
    uint8_t **tok; /* bytes, NULL for excluded */
    uint32_t *len;
    bool *eos;
    int32_t *eos_ids;
    size_t n_eos;
    gtrie trie;         /* every token */
    gtrie rest;         /* the tokens outside the slice */
    uint32_t *slice;    /* bitset of the slice's ids */
    uint32_t n_slice;   /* its size */
    uint32_t slice_len; /* its longest token, in bytes */
    int32_t *dup;       /* more tokens with the same bytes: chain, -1 ends */
    uint32_t max_len;
    gshare *share; /* mask-cache entries shared by this vocabulary's grammars (mutable) */
};

#endif
