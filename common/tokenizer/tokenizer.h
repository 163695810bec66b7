/* Hugging Face tokenizers (tokenizer.json + tokenizer_config.json) and an incremental
 * detokenizer.
 *
 * Supported: model.type "BPE" in its two published flavours — byte-level BPE (GPT-2,
 * Llama-3, Qwen2/3: Split pre-tokenizers with their regexes, ByteLevel pre-tokenizer and
 * decoder) and SentencePiece-style BPE with byte fallback (Llama-2, Mistral, TinyLlama:
 * Prepend/Replace normalizers or a Metaspace pre-tokenizer, "▁", "<0xNN>" tokens) — with
 * added/special tokens, the NFC normalizer, and TemplateProcessing/ByteLevel
 * post-processors. Anything else in tokenizer.json is refused at load with an error naming
 * the file and the field.
 *
 * Design: the tokenizer is immutable after pd_tok_load(), so one pd_tok is shared by every
 * thread (encode/decode take it const and keep their scratch in per-call buffers). Text is
 * UTF-8 with an explicit length. Encode of invalid UTF-8 never fails: each maximal invalid
 * subsequence is read as one U+FFFD (as Rust's String::from_utf8_lossy would) before
 * tokenization.
 *
 * Where Hugging Face's Rust tokenizers and the JS port disagree, the Rust behaviour is kept
 * (a <0xNN> run that is not valid UTF-8 decodes to one U+FFFD per byte; the Metaspace
 * decoder drops every "▁" of the first token). Decode does not apply transformers'
 * clean_up_tokenization_spaces (neither does vLLM's streaming detokenizer). Unicode
 * classes and NFC follow Python's unicodedata tables (Unicode 14).
 *
 * Token ids are int32_t; -1 means "none".
 */
#ifndef PD_TOKENIZER_TOKENIZER_H
#define PD_TOKENIZER_TOKENIZER_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct pd_tok pd_tok;
typedef struct pd_detok pd_detok;

/* ---- loading ------------------------------------------------------------------------ */

/* Loads model_dir/tokenizer.json and, when present, model_dir/tokenizer_config.json
 * (bos/eos/unk/pad tokens, add_bos_token/add_eos_token, the rest kept for the chat
 * template). Errors name the file and the JSON field ("tokenizer.json: model.merges[3]:
 * ..."). *out is owned by the caller; free with pd_tok_free. */
int pd_tok_load(const char *model_dir, pd_tok **out);
/* Same with explicit paths; config_json may be NULL (no tokenizer_config.json). */
int pd_tok_load_files(const char *tokenizer_json, const char *config_json, pd_tok **out);
void pd_tok_free(pd_tok *t);

/* ---- encode / decode ------------------------------------------------------------------ */

/* Encodes len bytes of UTF-8 text. Special/added token text in the input becomes their ids
 * (as Hugging Face does by default). add_special_tokens applies the post-processor
 * (e.g. Llama-2's BOS) and tokenizer_config's add_bos_token/add_eos_token.
 * On success *ids is a malloc'd array of *n_ids token ids (caller frees with free(); may be
 * non-NULL even when *n_ids is 0). Thread-safe. */
int pd_tok_encode(const pd_tok *t, const char *text, size_t len, bool add_special_tokens,
                  int32_t **ids, size_t *n_ids);
/* pd_tok_encode that stops early on a text of more than max_ids tokens, so a huge text costs
 * about what max_ids tokens do: it encodes growing prefixes of the text (cut after a space or
 * newline where there is one), each 4 times the last, starting at about 8 bytes a token.
 * *more false: *ids / *n_ids are the whole text's, as pd_tok_encode gives them. *more true: the
 * text has more than max_ids tokens, at least *n_ids (> max_ids), and *ids is NULL. */
int pd_tok_encode_max(const pd_tok *t, const char *text, size_t len, bool add_special_tokens,
                      size_t max_ids, int32_t **ids, size_t *n_ids, bool *more);

/* Decodes ids to UTF-8 text exactly as Hugging Face's tokenizer.decode(ids,
 * skip_special_tokens) does (decoder pipeline, U+FFFD for invalid bytes).
 * *text is malloc'd and NUL-terminated, *text_len excludes the NUL (text_len may be NULL).
 * An id outside [0, vocab size) is PD_EINVAL. Thread-safe. */
int pd_tok_decode(const pd_tok *t, const int32_t *ids, size_t n_ids, bool skip_special_tokens,
                  char **text, size_t *text_len);

/* ---- vocabulary ------------------------------------------------------------------------ */

/* Number of ids: max(model vocab, added tokens) + 1. */
int32_t pd_tok_vocab_size(const pd_tok *t);
/* Raw token string of id as stored in tokenizer.json ("Ġhello", "▁the", "<0x0A>",
 * "<|im_end|>"); NULL when id is out of range or unused. Valid until pd_tok_free. */
const char *pd_tok_id_to_token(const pd_tok *t, int32_t id);
/* Id of a raw token string (model vocab or added token), -1 when absent. */
int32_t pd_tok_token_to_id(const pd_tok *t, const char *token, size_t len);
/* True for added tokens marked "special": true (skipped by skip_special_tokens). */
bool pd_tok_is_special(const pd_tok *t, int32_t id);

/* Special ids from tokenizer_config.json (falling back to tokenizer.json's post-processor
 * for BOS); -1 when the model has none. */
int32_t pd_tok_bos_id(const pd_tok *t);
int32_t pd_tok_unk_id(const pd_tok *t);
int32_t pd_tok_pad_id(const pd_tok *t);
/* EOS ids (tokenizer_config eos_token; the engine adds generation_config's). Returns the
 * count; *ids points into t (may be NULL when the count is 0). */
size_t pd_tok_eos_ids(const pd_tok *t, const int32_t **ids);
/* Special token strings from tokenizer_config.json ({"content": ...} objects resolved);
 * NULL when absent. Valid until pd_tok_free. */
const char *pd_tok_bos_token(const pd_tok *t);
const char *pd_tok_eos_token(const pd_tok *t);
/* tokenizer_config's add_bos_token / add_eos_token as they apply to encode. */
bool pd_tok_add_bos(const pd_tok *t);
bool pd_tok_add_eos(const pd_tok *t);

/* The parsed tokenizer_config.json, read-only (chat_template, special token strings), or
 * NULL when the file was absent. Borrowed: valid until pd_tok_free. */
const json_t *pd_tok_config(const pd_tok *t);

/* ---- incremental detokenizer (one per generated sequence) ---------------------------- */

/* Creates a detokenizer for tok (which must outlive it). The prompt ids (may be NULL/0)
 * set the context, so the first generated token gets the right leading space; their text is
 * not emitted. Contract: the concatenation of every delta from push() and the final
 * flush() equals the suffix that the output ids add to pd_tok_decode(prompt + output)
 * — with no prompt, exactly pd_tok_decode(output, skip_special_tokens). */
int pd_detok_create(const pd_tok *tok, bool skip_special_tokens, const int32_t *prompt_ids,
                    size_t n_prompt, pd_detok **out);
void pd_detok_free(pd_detok *d);

/* Adds one generated id. *delta and *delta_len receive the new text (possibly empty; never a
 * split UTF-8 character: incomplete byte sequences are held back until complete or proven
 * invalid, then written as U+FFFD). *delta points into d and stays valid until the next
 * call on d. No allocation once the buffers have grown to the sequence's size (they
 * grow geometrically). An out-of-range id is PD_EINVAL and leaves d unchanged. */
int pd_detok_push(pd_detok *d, int32_t id, const char **delta, size_t *delta_len);

/* Ends the sequence: returns whatever text was held back (an incomplete UTF-8 tail
 * becomes U+FFFD). Same pointer rules as push. */
int pd_detok_flush(pd_detok *d, const char **delta, size_t *delta_len);

/* Makes dst's state src's (text so far, bytes held back), so that dst goes on as src would;
 * both made for the same tokenizer and skip_special_tokens (a beam search decodes each
 * candidate on a copy of its beam's detokenizer). Allocates only while dst's buffers grow. */
int pd_detok_copy_state(pd_detok *dst, const pd_detok *src);

/* All text emitted so far (NUL-terminated, borrowed, valid until the next call on d). */
const char *pd_detok_text(const pd_detok *d, size_t *len);

#endif
