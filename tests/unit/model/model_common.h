/* Unit tests for common/model (dtypes, config.json, generation_config.json, RoPE frequencies,
 * safetensors reader/writer, model loading) and for pd-mkmodel (determinism, sharding,
 * tokenizer/config consistency). Malformed checkpoints are built byte by byte here.
 *
 * One executable (test_model) of several files: this header declares the helpers they share
 * (model_common.c), and each test_model_*.c holds the tests of one part, linked in the order
 * the tests run. */
#ifndef PD_TESTS_UNIT_MODEL_COMMON_H
#define PD_TESTS_UNIT_MODEL_COMMON_H

#include <stddef.h>

#include "harness.h"

/* pdt_tmp_dir()/name (one of 8 rotating static buffers). */
const char *tmp_path(const char *name);
int write_file(const char *path, const void *data, size_t n);
int write_text(const char *path, const char *text);
/* The whole file, NUL-terminated (malloc'd), its size in *n; NULL when it cannot be read. */
char *read_all(const char *path, size_t *n);

#endif
