/* Internals shared by tokenizer.c (load, encode), pretok.c (split regexes) and detok.c
 * (decode, incremental detokenizer). Not a public header.
 *
 * tokenizer.json is compiled at load into flat tables: per-id strings and flags, a string
 * hash map for the model vocabulary, a pair hash map for merges, and small enums for the
 * normalizer / pre-tokenizer / decoder steps that the supported models use. */
#ifndef PD_TOKENIZER_TOK_INTERNAL_H
#define PD_TOKENIZER_TOK_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tokenizer/tokenizer.h"
#include "util/arena.h"

enum {
    TOKF_USED = 1,    /* id has a token */
    TOKF_ADDED = 2,   /* from added_tokens */
    TOKF_SPECIAL = 4, /* added token with "special": true */
    TOKF_BYTE = 8,    /* "<0xNN>" byte-fallback token (value in id_byte) */
};

enum { TOK_MODE_CHARS = 0, TOK_MODE_BYTELEVEL = 1 };

enum { NORM_PREPEND, NORM_REPLACE, NORM_NFC };
typedef struct {
    int kind;
    const char *a; /* Prepend: text; Replace: pattern */
    size_t alen;
    const char *b; /* Replace: content */
    size_t blen;
} pd_tok_norm;

enum { PRE_SPLIT, PRE_BYTELEVEL, PRE_METASPACE };
enum { RX_GPT2, RX_LLAMA3, RX_QWEN2 };
enum { PREPEND_ALWAYS, PREPEND_FIRST, PREPEND_NEVER };
typedef struct {
    int kind;
    int regex;             /* PRE_SPLIT: RX_*; PRE_BYTELEVEL: RX_GPT2 when use_regex, else -1 */
    bool add_prefix_space; /* PRE_BYTELEVEL */
    int prepend_scheme;    /* PRE_METASPACE */
    bool split;            /* PRE_METASPACE */
    const char *repl;      /* PRE_METASPACE replacement (UTF-8) */
    size_t repl_len;
} pd_tok_pre;

enum { DEC_NONE, DEC_BYTELEVEL, DEC_SPM };

typedef struct {
    const char *s; /* content (raw) */
    uint32_t len;
    const char *ns; /* content after the normalizer (normalized tokens only) */
    uint32_t nlen;
    int32_t id;
    bool special, lstrip, rstrip, single_word, normalized;
} pd_tok_added;

typedef struct {
    uint64_t key; /* (left id << 32) | right id; UINT64_MAX = empty */
    int32_t rank; /* merge priority: index in model.merges */
    int32_t id;   /* id of the merged token */
} pd_tok_merge;

struct pd_tok {
    pd_arena *arena; /* owns every string below */
    json_t *config;  /* tokenizer_config.json, NULL when absent */

    int32_t n_ids;
    const char **id_str;    /* (n_ids) raw token strings, NULL for unused ids */
    uint32_t *id_len;       /* (n_ids) bytes */
    uint8_t *id_flags;      /* (n_ids) TOKF_* */
    uint8_t *id_byte;       /* (n_ids) byte value of TOKF_BYTE tokens */
    const uint8_t **id_dec; /* (n_ids) bytes the decoder maps the token to (see detok.c) */
    uint32_t *id_dec_len;   /* (n_ids) */

    int32_t *vmap; /* open-addressing string map over the model vocab: slot -> id, -1 empty */
    uint32_t vmap_mask;
    pd_tok_merge *mmap;
    uint32_t mmap_mask;

    /* model */
    int mode; /* TOK_MODE_* */
    bool byte_fallback, fuse_unk, ignore_merges;
    bool spm_split; /* CHARS mode: no vocab token has "▁" after another char, so words can
                       be cut before each "▁" that follows a non-"▁" without changing BPE */
    int32_t model_unk_id;
    int32_t byte_tok[256];  /* BYTELEVEL: id of the 1-char token for byte b; CHARS: <0xNN> */
    int32_t ascii_tok[128]; /* CHARS: id of the token that is exactly the ASCII char c, or -1 */
    uint8_t bl_enc[256][2]; /* byte -> UTF-8 of its byte-level char */
    uint8_t bl_enc_len[256];

    pd_tok_norm *norm;
    int n_norm;
    pd_tok_pre *pre;
    int n_pre;

    pd_tok_added *added; /* sorted by content length, longest first */
    int n_added;
    bool any_normalized_added;
    uint8_t added_first[32]; /* bitmap of first bytes of raw-matched added tokens */

    int32_t post_pre[4], post_suf[4]; /* ids added around the sequence by add_special_tokens */
    int n_post_pre, n_post_suf;

    int dec_mode;           /* DEC_* */
    bool dec_byte_fallback; /* DEC_SPM: <0xNN> runs become bytes */
    int dec_strip;          /* DEC_SPM: leading spaces stripped from the whole text */
    bool dec_meta_first;    /* DEC_SPM with a Metaspace decoder: drop "▁" in the first token */

    int32_t bos_id, eos_id, unk_id, pad_id;
    const char *bos_tok, *eos_tok;
    bool add_bos, add_eos;
};

/* Slot hash of a merge key (left id << 32 | right id). */
static inline uint64_t merge_hash(uint64_t key)
{
    key ^= key >> 31;
    key *= 0x9E3779B97F4A7C15ull;
    key ^= key >> 29;
    return key;
}

/* Runs the normalizer steps over s[0..n); *out is a malloc'd copy (caller frees). */
int pd_tok_normalize(const pd_tok *t, const uint8_t *s, size_t n, uint8_t **out, size_t *out_len);

/* Hash of a byte string (also used by the encoder's word cache). */
uint64_t pd_tok_hash(const void *p, size_t n);
/* Model-vocab lookup (no added tokens), -1 when absent. */
int32_t pd_tok_vocab_find(const pd_tok *t, const char *s, size_t n);

/* End (exclusive byte index) of the pre-tokenizer regex match that starts at s[i]; i < n.
 * The supported regexes match at every position, so the result is always > i. s is valid
 * UTF-8. */
size_t pd_tok_rx_match(int regex, const uint8_t *s, size_t n, size_t i);

/* Decoder tables (detok.c): fills id_dec/id_dec_len once the vocab and decoder are known. */
int pd_tok_build_decoder(pd_tok *t);

#endif
