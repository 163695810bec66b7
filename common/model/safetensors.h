/* safetensors checkpoints: a memory-mapped reader for one file, a directory holding
 * model.safetensors, or a sharded directory with model.safetensors.index.json; and a writer.
 *
 * Format: 8-byte little-endian header length N, N bytes of JSON
 * {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
 *  "__metadata__": {...}}, then the data region. The reader maps each file read-only and checks
 * everything before handing out a pointer: N within the file, the header parses, every dtype is
 * F32/F16/BF16, or I32/I8/U8/F8_E4M3 (the parts of quantized checkpoints; others:
 * PD_EUNSUPPORTED naming tensor and dtype), offsets lie inside the data
 * region, shape product x element size equals end - begin, and the tensors sorted by offset
 * cover the data region contiguously without overlap, each at a multiple of its element size.
 * Errors name the file and the tensor.
 * Tensor data stays in the mapping (zero copy) until pd_st_close.
 */
#ifndef PD_MODEL_SAFETENSORS_H
#define PD_MODEL_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "model/dtype.h"

#define PD_TENSOR_MAX_DIMS 8

/* A view of one stored tensor. Row-major; shape[0] is the outermost dimension, as in PyTorch.
 * Borrowed: name, file and data belong to the pd_st (or the caller, for the writer). An absent
 * optional weight is a zeroed pd_tensor (data == NULL, ndim == 0). */
typedef struct {
    const char *name;
    pd_dtype dtype;
    int ndim;
    int64_t shape[PD_TENSOR_MAX_DIMS];
    const void *data; /* the bytes: in the mapping, aligned to 8 (writers pad the header to
                         8 bytes; a file that is not padded has its data region copied to an
                         aligned buffer), so typed loads of any element are aligned */
    size_t nbytes;    /* product(shape) * pd_dtype_size(dtype) */
    const char *file; /* path of the file that holds it */
    /* Non-NULL: not a stored tensor but a quantized linear layer (model/quant.h) named by its
     * module prefix, shape its logical (out, in), data NULL, nbytes all its stored bytes. */
    const struct pd_qweight *quant;
} pd_tensor;

/* Number of elements (1 for ndim == 0). */
int64_t pd_tensor_numel(const pd_tensor *t);
/* "[4096, 11008]" into buf (always NUL-terminated); returns buf. */
const char *pd_tensor_shape_str(const pd_tensor *t, char *buf, size_t n);

typedef struct pd_st pd_st;

/* path: a .safetensors file, or a directory with model.safetensors.index.json (sharded: every
 * listed shard is opened, and every tensor the index names must be in the shard it names) or
 * model.safetensors. A tensor name in two files is an error. */
int pd_st_open(const char *path, pd_st **out);
void pd_st_close(pd_st *st);

/* PD_OK and *out, or PD_ENOTFOUND "<path>: tensor '<name>' not found". */
int pd_st_find(const pd_st *st, const char *name, const pd_tensor **out);
/* NULL when absent; no error message set. */
const pd_tensor *pd_st_get(const pd_st *st, const char *name);
/* Dtype classes pd_st_expect accepts: any float dtype, or exactly one dtype. */
#define PD_ST_FLOAT (-1)

/* Finds name and checks it: dtype (a pd_dtype, or PD_ST_FLOAT for F32/F16/BF16) and shape
 * (ndim dims, shape[0..ndim)). PD_ENOTFOUND "<file>: tensor '<name>' not found (expected
 * shape [..])", or PD_EINVAL "<file>: tensor '<name>': expected shape [..], got [..]" / "...:
 * expected dtype .., got ..". *out is a copy of the view. */
int pd_st_expect(const pd_st *st, const char *name, int dtype, int ndim, const int64_t *shape,
                 pd_tensor *out);

/* All tensors, in file order then header order. */
size_t pd_st_count(const pd_st *st);
const pd_tensor *pd_st_at(const pd_st *st, size_t i);
/* What was opened (the path given to pd_st_open). */
const char *pd_st_path(const pd_st *st);
/* Number of files mapped. */
size_t pd_st_file_count(const pd_st *st);

/* ---- writer ------------------------------------------------------------------------------ */

/* Fills buf (nbytes = tensors[index].nbytes) with the data of tensor index. Returns a status. */
typedef int (*pd_st_fill_fn)(void *ctx, size_t index, void *buf, size_t nbytes);

/* Writes a safetensors file with tensors in the given order (data laid out in that order,
 * header with "__metadata__": {"format": "pt"}, padded with spaces to a multiple of 8 bytes).
 * Each tensor's data comes from fill when fill != NULL (called once per tensor, in order,
 * with a buffer of its size), else from tensors[i].data. nbytes is recomputed from shape and
 * dtype. Written to a temporary name and renamed, so a crash never leaves a half file. */
int pd_st_write(const char *file, const pd_tensor *tensors, size_t n, pd_st_fill_fn fill,
                void *ctx);

#endif
