/* pd-decode: receives prompts' KV caches and streams generated tokens (common/node). */
#include "node/node.h"

int main(int argc, char **argv)
{
    return pd_node_main(argc, argv, RT_ROLE_DECODE);
}
