/* Byte-level BPE training for pd-mkmodel's synthetic tokenizers.
 *
 * Trains GPT-2 style byte-level BPE (256 byte tokens, then merges) on the built-in corpus,
 * extended with deterministic pseudo-words when a large vocabulary needs more distinct words
 * than the corpus has, and writes a standard Hugging Face tokenizer.json. Deterministic: the
 * same text and vocabulary size give the same merges, byte for byte.
 */
#ifndef PD_MKMODEL_BPE_TRAIN_H
#define PD_MKMODEL_BPE_TRAIN_H

#include <stddef.h>
#include <stdint.h>

/* The built-in English training text (NUL-terminated, ASCII). */
extern const char pd_mkmodel_corpus[];

typedef struct bpe_model bpe_model;

/* Trains on text[0..len) until the model has n_tokens tokens (256 bytes + merges).
 * n_tokens must be >= 256. PD_ERANGE when even the pseudo-word extension runs out of pairs. */
int bpe_train(const char *text, size_t len, int64_t n_tokens, bpe_model **out);
void bpe_free(bpe_model *m);
/* Tokens in the model (256 + distinct merges). */
int64_t bpe_size(const bpe_model *m);
/* Number of merges (can exceed bpe_size - 256 when two merges give the same string). */
int64_t bpe_merge_count(const bpe_model *m);

/* Writes tokenizer.json: model.type BPE with vocab and merges ("a b" strings), ByteLevel
 * pre-tokenizer (add_prefix_space false, use_regex true), ByteLevel decoder and post-processor,
 * and specials as added_tokens (special: true) with ids bpe_size .. bpe_size + n_special - 1. */
int bpe_write_tokenizer_json(const bpe_model *m, const char *const *specials, int n_special,
                             const char *file);

#endif
