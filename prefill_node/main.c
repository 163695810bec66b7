/* pd-prefill: runs prompts and hands their KV cache to decode instances (common/node). */
#include "node/node.h"

int main(int argc, char **argv)
{
    return pd_node_main(argc, argv, RT_ROLE_PREFILL);
}
