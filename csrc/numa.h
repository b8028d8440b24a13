// The calling thread's NUMA memory policy (set_mempolicy / get_mempolicy), without libnuma.
// Pure C++ (no Python headers), Linux only.
#pragma once

#include <utility>
#include <vector>

namespace fastfeed::numa {

// Prefer `node` for the calling thread's future allocations (MPOL_PREFERRED); node < 0
// restores the default (allocate locally). Throws OsError (e.g. EINVAL: no such node).
void prefer_node(int node);

// The calling thread's policy, or with `address` the policy of the memory there (for shared
// memory, the segment's own): (mode, nodes in its mask). Mode as the kernel numbers it:
// 0 default, 1 preferred, 2 bind, 3 interleave, 4 local. Throws OsError.
std::pair<int, std::vector<int>> policy(const void* address = nullptr);

}  // namespace fastfeed::numa
