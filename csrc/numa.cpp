#include "numa.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <string>

#include "segment.h"  // OsError

namespace fastfeed::numa {
namespace {

constexpr int kBits = 8 * sizeof(unsigned long);
constexpr int kMaxNodes = 1024;
constexpr int kPreferred = 1;  // MPOL_PREFERRED; <linux/mempolicy.h> is avoided (no libnuma headers)

}  // namespace

void prefer_node(int node) {
  if (node >= kMaxNodes) throw OsError(EINVAL, "set_mempolicy: node " + std::to_string(node));
  unsigned long mask[kMaxNodes / kBits] = {};
  long rc;
  if (node < 0) {
    rc = ::syscall(SYS_set_mempolicy, 0, nullptr, 0);  // MPOL_DEFAULT
  } else {
    mask[node / kBits] = 1UL << (node % kBits);
    // maxnode counts one past the last bit the kernel should read (as libnuma passes it).
    rc = ::syscall(SYS_set_mempolicy, kPreferred, mask, kMaxNodes + 1);
  }
  if (rc != 0) throw OsError(errno, "set_mempolicy(preferred, node " + std::to_string(node) + ")");
}

std::pair<int, std::vector<int>> policy(const void* address) {
  constexpr unsigned long kAddr = 2;  // MPOL_F_ADDR
  int mode = 0;
  unsigned long mask[kMaxNodes / kBits] = {};
  if (::syscall(SYS_get_mempolicy, &mode, mask, kMaxNodes + 1, address, address ? kAddr : 0) != 0)
    throw OsError(errno, "get_mempolicy");
  std::vector<int> nodes;
  for (int n = 0; n < kMaxNodes; ++n)
    if (mask[n / kBits] & (1UL << (n % kBits))) nodes.push_back(n);
  return {mode, nodes};
}

}  // namespace fastfeed::numa
