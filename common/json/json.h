/* Typed reads over jansson that report the JSON path of a bad field.
 *
 * Every getter takes the path of the containing object ("" for the root) and a key, and
 * on failure sets a message such as "messages[2].content: expected string". Numbers are
 * read with json_number_value, so 3.0 is accepted where an integer is expected (3.5 is
 * not), and NaN/Inf are rejected. Getters return 1 when the field was read, 0 when it is
 * absent (or null with PDJ_NULL_IS_ABSENT) and optional, negative status on error.
 */
#ifndef PD_JSON_JSON_H
#define PD_JSON_JSON_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum {
    PDJ_OPTIONAL = 0,
    PDJ_REQUIRED = 1,       /* absent -> "path.key: required" */
    PDJ_NULL_IS_ABSENT = 2, /* a JSON null counts as absent (OpenAI clients send nulls) */
};

/* Path builders: pdj_path_key(buf, n, "messages[2]", "content") -> "messages[2].content";
 * pdj_path_index(buf, n, "messages", 2) -> "messages[2]". Always NUL-terminate. */
const char *pdj_path_key(char *buf, size_t n, const char *path, const char *key);
const char *pdj_path_index(char *buf, size_t n, const char *path, size_t index);

/* JSON type name for messages: "string", "integer", "number", "object", ... */
const char *pdj_type_name(const json_t *v);

/* Conversions of a value already in hand; path names it in the message. */
int pdj_as_int(const json_t *v, const char *path, int64_t *out);
int pdj_as_double(const json_t *v, const char *path, double *out);
int pdj_as_bool(const json_t *v, const char *path, bool *out);
int pdj_as_string(const json_t *v, const char *path, const char **out);

/* Field getters (see the header comment for return values). obj must be an object. */
int pdj_get_int(const json_t *obj, const char *path, const char *key, int flags, int64_t *out);
int pdj_get_double(const json_t *obj, const char *path, const char *key, int flags, double *out);
int pdj_get_bool(const json_t *obj, const char *path, const char *key, int flags, bool *out);
int pdj_get_string(const json_t *obj, const char *path, const char *key, int flags,
                   const char **out);
/* Object/array fields: out borrows the reference. */
int pdj_get_object(const json_t *obj, const char *path, const char *key, int flags, json_t **out);
int pdj_get_array(const json_t *obj, const char *path, const char *key, int flags, json_t **out);

/* Integer with bounds: "path.key: must be between lo and hi, got v". */
int pdj_get_int_range(const json_t *obj, const char *path, const char *key, int flags, int64_t lo,
                      int64_t hi, int64_t *out);
int pdj_get_double_range(const json_t *obj, const char *path, const char *key, int flags, double lo,
                         double hi, double *out);

/* Parsing with line/column in the message: "<what>: line 3 column 7: <jansson text>".
 * pdj_loads (request bodies): a duplicate key is accepted, the last value wins.
 * pdj_load_file (configuration files) names the file and rejects duplicate keys; a file with
 * an integer beyond int64 (tokenizer_config.json's model_max_length = 1e30) is read with every
 * integer as a real number.
 * *out is a new reference on success. */
int pdj_loads(const char *text, size_t len, const char *what, json_t **out);
int pdj_load_file(const char *file, json_t **out);

/* json_loadb(text, len, flags, err) that also reads a document holding an integer beyond int64
 * (a JSON Schema's `"maximum": 9223372036854776000`, which Python's json reads as an int): on
 * jansson's "too big integer" the text is read again with every integer as a real, and then the
 * whole reals within int64 are made integers again, so only the big ones stay reals. */
json_t *pdj_loadb(const char *text, size_t len, size_t flags, json_error_t *err);

/* Compact serialization with doubles printed at 15 significant digits (0.7, not
 * 0.69999999999999996). Caller frees the result with free(). NULL on out of memory. */
char *pdj_dumps(const json_t *v);
/* Writes v to file (indent spaces; 0 = compact) with a trailing newline, atomically. */
int pdj_dump_file(const json_t *v, const char *file, int indent);

#endif
