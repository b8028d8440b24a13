// Gathering copies into slot memory (pure C++, no Python).
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace fastfeed {

// Copies each (source address, byte count) in turn to consecutive bytes from dst.
// Large copies use non-temporal stores: a slot is written once and next read by
// another process (or a DMA engine), so pulling it into this core's cache first
// (read-for-ownership) only doubles the memory traffic and evicts the dataset.
void gather(std::uint8_t* dst, const std::vector<std::pair<std::uintptr_t, std::size_t>>& srcs);

}  // namespace fastfeed
