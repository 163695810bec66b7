/* Backend instances: the generic wrapper around an implementation's op table and state.
 *
 * Design: pd_backend is a two-field box (ops, impl) so every backend is used the same way and
 * the forward pass never knows which one it drives; implementations allocate their state and
 * call pd_backend_wrap. */
#include "backend/backend.h"

#include <stdlib.h>
#include <string.h>

#include "util/status.h"

struct pd_backend {
    const pd_backend_ops *ops;
    void *impl;
};

pd_backend_params pd_backend_default_params(void)
{
    pd_backend_params p = {
        .n_threads = 0,
        .cpu_isa = PD_CPU_ISA_AUTO,
        .device = 0,
        .weight_dtype = -1,
        .compute_dtype = -1,
        .max_tokens = 8192,
        .max_seqs = 256,
        .max_blocks = 65536,
        .max_rope_dim = 256,
    };
    return p;
}

int pd_cpu_isa_parse(const char *s, pd_cpu_isa *out)
{
    static const struct {
        const char *name;
        pd_cpu_isa isa;
    } names[] = {{"auto", PD_CPU_ISA_AUTO},
                 {"scalar", PD_CPU_ISA_SCALAR},
                 {"avx512", PD_CPU_ISA_AVX512},
                 {"avx512bf16", PD_CPU_ISA_AVX512_BF16}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(s, names[i].name)) {
            *out = names[i].isa;
            return PD_OK;
        }
    return pd_error(PD_EINVAL, "cpu isa '%s': expected auto, scalar, avx512 or avx512bf16", s);
}

pd_backend *pd_backend_wrap(const pd_backend_ops *ops, void *impl)
{
    pd_backend *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    b->ops = ops;
    b->impl = impl;
    return b;
}

void *pd_backend_impl(const pd_backend *b)
{
    return b->impl;
}

void pd_backend_free(pd_backend *b)
{
    if (!b) return;
    if (b->ops && b->ops->free) b->ops->free(b);
    free(b);
}

const pd_backend_ops *pd_backend_get_ops(const pd_backend *b)
{
    return b->ops;
}

const char *pd_backend_name(const pd_backend *b)
{
    return b->ops->name;
}

pd_dtype pd_backend_act_dtype(const pd_backend *b)
{
    return b->ops->act_dtype(b);
}

int pd_backend_host_alloc(pd_backend *b, size_t bytes, void **out)
{
    *out = NULL;
    if (b->ops->host_alloc) return b->ops->host_alloc(b, bytes, out);
    *out = malloc(bytes ? bytes : 1);
    if (!*out) return pd_error(PD_ENOMEM, "out of memory for %zu bytes of host staging", bytes);
    return PD_OK;
}

void pd_backend_host_free(pd_backend *b, void *p)
{
    if (!p) return;
    if (b->ops->host_free)
        b->ops->host_free(b, p);
    else
        free(p);
}
