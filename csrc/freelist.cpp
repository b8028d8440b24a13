#include "freelist.h"

namespace fastfeed {

long claim_bit(std::uint64_t* words, std::size_t nwords) {
  for (std::size_t w = 0; w < nwords; ++w) {
    std::uint64_t seen = __atomic_load_n(&words[w], __ATOMIC_RELAXED);
    while (seen != 0) {
      std::uint64_t lowest = seen & (~seen + 1);
      // On failure `seen` is reloaded: another claimer took a bit of this word first.
      if (__atomic_compare_exchange_n(&words[w], &seen, seen & ~lowest, /*weak=*/false, __ATOMIC_ACQUIRE,
                                      __ATOMIC_RELAXED)) {
        return static_cast<long>(w * 64 + static_cast<std::size_t>(__builtin_ctzll(lowest)));
      }
    }
  }
  return -1;
}

void release_bit(std::uint64_t* words, std::size_t bit) {
  __atomic_fetch_or(&words[bit / 64], std::uint64_t{1} << (bit % 64), __ATOMIC_RELEASE);
}

std::uint64_t add_count(std::uint64_t* counter, std::uint64_t delta) {
  return __atomic_add_fetch(counter, delta, __ATOMIC_RELAXED);
}

}  // namespace fastfeed
