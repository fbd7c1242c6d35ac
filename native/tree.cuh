// tree.cuh: a draft tree's shape (oj_verify_tree) as the kernels take it: one 64-bit word passed by
// value. Byte i is node i's parent + 1 (the root's byte is 0), for up to OJ_MAX_TREE_NODES = 8 nodes
// in topological order (parent < node). The word 0 is a chain (oj_verify): every kernel then runs
// its chain code, so a chain costs nothing and gives what it gave before trees.
#pragma once

#include <cstdint>

namespace oj {

// Node i's parent, -1 for the root (a chain's word 0 reads -1 everywhere: not for chains).
__host__ __device__ __forceinline__ int tree_parent(uint64_t tree, int i) {
    return (int)((tree >> (8 * i)) & 0xffu) - 1;
}

// Node i's depth: its position is pos0 + depth (i for a chain).
__host__ __device__ __forceinline__ int tree_depth(uint64_t tree, int i) {
    if (tree == 0) return i;
    int d = 0;
    for (int a = tree_parent(tree, i); a >= 0; a = tree_parent(tree, a)) ++d;
    return d;
}

// Node i's path, root first, as nibbles: nibble d is the node at depth d (its K/V cache row is
// pos0 + that node). The attention of node i reads position pos0 + d from that row, which is what
// one-token-at-a-time decoding of the path would read there. A chain: the identity 0x76543210.
__host__ __device__ __forceinline__ uint32_t tree_path_rows(uint64_t tree, int i) {
    if (tree == 0) return 0x76543210u;
    uint32_t rows = 0;
    for (int a = i, d = tree_depth(tree, i); a >= 0; a = tree_parent(tree, a), --d) rows |= (uint32_t)a << (4 * d);
    return rows;
}

}  // namespace oj
