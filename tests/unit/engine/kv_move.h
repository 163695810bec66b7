/* The KV hand-over of a split deployment without the nodes, for engine tests: the K/V of
 * n_blocks blocks of engine P (pblocks) written into blocks dblocks of engine D, layer by layer
 * through the host (the backends' kv_export / kv_import, rank 0, every KV head). Both engines
 * serve the same model with float32 KV. */
#ifndef PD_TESTS_UNIT_ENGINE_KV_MOVE_H
#define PD_TESTS_UNIT_ENGINE_KV_MOVE_H

#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"

int kv_move(pd_engine *P, const int32_t *pblocks, pd_engine *D, const int32_t *dblocks,
            size_t n_blocks);

#endif
