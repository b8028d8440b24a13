#include "copy.h"

#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>  // SSE2: part of the x86-64 baseline, so no -m flags are needed
#define FASTFEED_HAVE_STREAM 1
#endif

namespace fastfeed {
namespace {

// Below this, streaming stores lose to memcpy (the line may be read again soon).
constexpr std::size_t kStreamMin = 16 * 1024;

void copy_one(std::uint8_t* dst, const std::uint8_t* src, std::size_t n) {
#ifdef FASTFEED_HAVE_STREAM
  if (n >= kStreamMin) {
    std::size_t head = (16 - (reinterpret_cast<std::uintptr_t>(dst) & 15)) & 15;
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    std::size_t i = 0;
    for (; i + 64 <= n; i += 64) {
      __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    std::memcpy(dst + i, src + i, n - i);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

}  // namespace

void gather(std::uint8_t* dst, const std::vector<std::pair<std::uintptr_t, std::size_t>>& srcs) {
  for (const auto& [addr, n] : srcs) {
    if (n == 0) continue;  // an empty tensor's address may be null, and memcpy(.., null, 0) is UB
    copy_one(dst, reinterpret_cast<const std::uint8_t*>(addr), n);
    dst += n;
  }
#ifdef FASTFEED_HAVE_STREAM
  _mm_sfence();  // streamed stores are weakly ordered: make them visible before we report done
#endif
}

}  // namespace fastfeed
