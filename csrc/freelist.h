// A free list of ring slots shared by several processes: one bit per slot, in shared
// memory, set while the slot is free (pure C++, no Python). A worker claims a slot only
// when it has a batch to write, so the ring holds as many slots as batches really exist
// at once; the main process sets the bit again when the batch's last view dies.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fastfeed {

// Clears the lowest set bit of words[0..nwords) and returns its index, or -1 when no bit
// is set. The lowest first: the slots used last are warm in caches and TLBs.
// Acquire ordering: what the releaser wrote before setting the bit is visible after it.
long claim_bit(std::uint64_t* words, std::size_t nwords);

// Sets bit `bit` (release ordering: everything written before is visible to its claimer).
void release_bit(std::uint64_t* words, std::size_t bit);

// Adds `delta` to a counter that several processes update; returns the new value.
std::uint64_t add_count(std::uint64_t* counter, std::uint64_t delta);

}  // namespace fastfeed
