// Unit tests of fastfeed's pure C++ core (segment.cpp, copy.cpp, freelist.cpp), meant to be built with
// sanitizers by csrc/tests/run.sh. No framework: CHECK counts, main prints "N passed, M failed"
// (N and M count checks) and returns non-zero on any failure.
//
// Segment names are "/ffcc-test-<tag>-<pid>-<random hex>", <tag> from $FASTFEED_CCTEST_TAG
// (run.sh sets one per run, so it can sweep up after a crash). Every name a test makes is
// registered; the last test unlinks whatever is left and counts it as a failure.

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../copy.h"
#include "../cuda.h"
#include "../freelist.h"
#include "../segment.h"

#if defined(__SANITIZE_ADDRESS__)
#define FF_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FF_ASAN 1
#endif
#endif
#ifdef FF_ASAN
#include <sanitizer/asan_interface.h>
#define FF_POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define FF_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define FF_POISON(p, n) ((void)(p), (void)(n))
#define FF_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

using fastfeed::OsError;
using fastfeed::Segment;

// --- checks --------------------------------------------------------------------------------

namespace {

std::atomic<long> g_passed{0};
std::atomic<long> g_failed{0};
std::mutex g_print_mutex;
constexpr long kMaxFailureLines = 50;  // a broken gather would otherwise print thousands

bool check_impl(bool ok, const char* expr, const char* file, int line, const std::string& info) {
  if (ok) {
    g_passed.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  const long n = g_failed.fetch_add(1, std::memory_order_relaxed) + 1;
  if (n <= kMaxFailureLines) {
    std::lock_guard<std::mutex> lock(g_print_mutex);
    std::fprintf(stderr, "%s:%d: CHECK failed: %s%s%s\n", file, line, expr,
                 info.empty() ? "" : "  -- ", info.c_str());
  } else if (n == kMaxFailureLines + 1) {
    std::lock_guard<std::mutex> lock(g_print_mutex);
    std::fprintf(stderr, "(further failures are counted, not printed)\n");
  }
  return false;
}

template <typename A, typename B>
std::string describe_pair(const A& a, const B& b) {
  std::ostringstream s;
  s << "left: " << a << ", right: " << b;
  return s.str();
}

}  // namespace

#define CHECK(cond) check_impl(static_cast<bool>(cond), #cond, __FILE__, __LINE__, "")
#define CHECK_MSG(cond, info) check_impl(static_cast<bool>(cond), #cond, __FILE__, __LINE__, (info))
#define CHECK_EQ(a, b)                                                                     \
  [&] {                                                                                    \
    const auto& va_ = (a);                                                                 \
    const auto& vb_ = (b);                                                                 \
    return check_impl(va_ == vb_, #a " == " #b, __FILE__, __LINE__, describe_pair(va_, vb_)); \
  }()

// Runs `expr`; passes if it throws OsError with err() == expected_errno. Evaluates to the
// message (empty if nothing or something else was thrown).
#define CHECK_OS_ERROR(expr, expected_errno)                                                 \
  [&]() -> std::string {                                                                     \
    try {                                                                                    \
      (void)(expr);                                                                          \
    } catch (const OsError& e_) {                                                            \
      check_impl(e_.err() == (expected_errno), #expr " throws OsError(" #expected_errno ")", \
                 __FILE__, __LINE__,                                                         \
                 "err()=" + std::to_string(e_.err()) + " what()=" + e_.what());              \
      return e_.what();                                                                      \
    } catch (const std::exception& e_) {                                                     \
      check_impl(false, #expr " throws OsError(" #expected_errno ")", __FILE__, __LINE__,    \
                 std::string("threw another exception: ") + e_.what());                      \
      return "";                                                                             \
    }                                                                                        \
    check_impl(false, #expr " throws OsError(" #expected_errno ")", __FILE__, __LINE__,      \
               "nothing was thrown");                                                        \
    return "";                                                                               \
  }()

#define CHECK_THROWS_AS(expr, type)                                                         \
  [&] {                                                                                     \
    try {                                                                                   \
      (void)(expr);                                                                         \
    } catch (const type&) {                                                                 \
      return check_impl(true, "", __FILE__, __LINE__, "");                                  \
    } catch (const std::exception& e_) {                                                    \
      return check_impl(false, #expr " throws " #type, __FILE__, __LINE__,                  \
                        std::string("threw another exception: ") + e_.what());              \
    }                                                                                       \
    return check_impl(false, #expr " throws " #type, __FILE__, __LINE__, "nothing thrown"); \
  }()

// --- helpers -------------------------------------------------------------------------------

namespace {

std::string random_hex(std::size_t nbytes) {
  std::vector<unsigned char> buf(nbytes);
  const int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("cannot open /dev/urandom");
  std::size_t got = 0;
  while (got < nbytes) {
    const ssize_t r = ::read(fd, buf.data() + got, nbytes - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      ::close(fd);
      throw std::runtime_error("cannot read /dev/urandom");
    }
    got += static_cast<std::size_t>(r);
  }
  ::close(fd);
  static const char digits[] = "0123456789abcdef";
  std::string s;
  for (unsigned char c : buf) {
    s += digits[c >> 4];
    s += digits[c & 15];
  }
  return s;
}

std::string name_prefix() {
  static const std::string prefix = [] {
    const char* tag = std::getenv("FASTFEED_CCTEST_TAG");
    return std::string("/ffcc-test-") + (tag != nullptr && *tag != '\0' ? tag : "notag") + "-" +
           std::to_string(::getpid()) + "-";
  }();
  return prefix;
}

std::mutex g_names_mutex;
std::vector<std::string> g_names;  // every name handed out, for the final sweep

// A fresh, registered segment name (with the leading '/').
std::string fresh_name() {
  std::string name = name_prefix() + random_hex(8);
  std::lock_guard<std::mutex> lock(g_names_mutex);
  g_names.push_back(name);
  return name;
}

// Whether a segment of this name exists, asked of shm_open rather than of /dev/shm.
bool shm_exists(const std::string& name) {
  const int fd = ::shm_open(name.c_str(), O_RDONLY, 0);
  if (fd >= 0) {
    ::close(fd);
    return true;
  }
  return errno != ENOENT;  // EACCES etc.: it is there
}

bool set_mode(const std::string& name, mode_t mode) {
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return false;
  const bool ok = ::fchmod(fd, mode) == 0;
  ::close(fd);
  return ok;
}

int count_open_fds() {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int n = 0;
  while (dirent* e = ::readdir(dir))
    if (e->d_name[0] != '.') ++n;
  ::closedir(dir);
  return n;  // includes the directory's own fd, the same on every call
}

// Whether /proc/self/maps lists a mapping of this segment (its path is /dev/shm/<name>).
bool is_mapped(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  const std::string needle = "/dev/shm" + name;  // name starts with '/'
  while (std::getline(maps, line)) {
    const auto pos = line.find(needle);
    if (pos == std::string::npos) continue;
    const auto end = pos + needle.size();
    if (end == line.size() || line[end] == ' ') return true;  // not merely a longer name
  }
  return false;
}

// Deterministic bytes that differ between (seed, index), so misplaced copies show.
void fill_pattern(std::uint8_t* p, std::size_t n, std::uint32_t seed) {
  std::uint32_t x = seed * 2654435761u + 0x9e3779b9u;
  for (std::size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    p[i] = static_cast<std::uint8_t>(x);
  }
}

struct Test {
  const char* name;
  void (*fn)();
};

}  // namespace

// --- Segment -------------------------------------------------------------------------------

namespace {

void test_create_attach_share_bytes() {
  const std::string name = fresh_name();
  const long page = ::sysconf(_SC_PAGESIZE);
  const std::size_t size = 3 * static_cast<std::size_t>(page) + 5;  // not a page multiple
  auto a = Segment::create(name, static_cast<std::int64_t>(size));
  CHECK_EQ(a->name(), name);
  CHECK_EQ(a->size(), size);
  CHECK(a->data() != nullptr);
  CHECK(!a->numa_bound());  // numa_node = -1 asks for nothing
  // A fresh segment reads as zeros everywhere (fallocate + prefault must not leave garbage).
  const auto* pa = static_cast<const std::uint8_t*>(a->data());
  CHECK(std::all_of(pa, pa + size, [](std::uint8_t b) { return b == 0; }));

  auto b = Segment::attach(name);
  CHECK_EQ(b->size(), size);
  CHECK(b->data() != a->data());  // a second, distinct mapping of the same pages
  static_cast<std::uint8_t*>(a->data())[page + 1] = 42;
  static_cast<std::uint8_t*>(a->data())[size - 1] = 7;
  CHECK_EQ(static_cast<int>(static_cast<std::uint8_t*>(b->data())[page + 1]), 42);
  CHECK_EQ(static_cast<int>(static_cast<std::uint8_t*>(b->data())[size - 1]), 7);
  static_cast<std::uint8_t*>(b->data())[0] = 9;
  CHECK_EQ(static_cast<int>(static_cast<std::uint8_t*>(a->data())[0]), 9);

  auto c = Segment::attach(name, /*populate=*/false);  // the lazy mapping sees them too
  CHECK_EQ(static_cast<int>(static_cast<std::uint8_t*>(c->data())[page + 1]), 42);

  // A name without the leading '/' means the same segment.
  auto d = Segment::attach(name.substr(1));
  CHECK_EQ(d->name(), name);
  CHECK_EQ(static_cast<int>(static_cast<std::uint8_t*>(d->data())[size - 1]), 7);

  CHECK(fastfeed::unlink_segment(name));
  // Unlinking removes the name, not the memory: existing mappings still share bytes.
  static_cast<std::uint8_t*>(a->data())[2] = 11;
  CHECK_EQ(static_cast<int>(static_cast<std::uint8_t*>(b->data())[2]), 11);
}

void test_create_options() {
  // hugepage=false, a NUMA node that cannot exist, node 0 (best effort: bound or not).
  for (int node : {-1, 0, 5000}) {
    for (bool huge : {false, true}) {
      const std::string name = fresh_name();
      auto s = Segment::create(name, 8192, node, huge);
      CHECK_EQ(s->size(), std::size_t{8192});
      if (node != 0) CHECK(!s->numa_bound());
      static_cast<std::uint8_t*>(s->data())[8191] = 1;
      CHECK(fastfeed::unlink_segment(name));
    }
  }
}

void test_create_is_exclusive() {
  const std::string name = fresh_name();
  auto a = Segment::create(name, 4096);
  static_cast<std::uint8_t*>(a->data())[0] = 77;
  const std::string what = CHECK_OS_ERROR(Segment::create(name, 4096), EEXIST);
  CHECK_MSG(what.find(name) != std::string::npos, what);
  // The failed create must not have removed (or resized) the existing segment.
  CHECK(shm_exists(name));
  auto b = Segment::attach(name);
  CHECK_EQ(b->size(), std::size_t{4096});
  CHECK_EQ(static_cast<int>(static_cast<std::uint8_t*>(b->data())[0]), 77);
  CHECK(fastfeed::unlink_segment(name));
}

void test_mode_0600() {
  const mode_t old_umask = ::umask(0);  // a permissive umask must not widen the mode
  const std::string name = fresh_name();
  auto s = Segment::create(name, 4096);
  ::umask(old_umask);
  const int fd = ::shm_open(name.c_str(), O_RDONLY, 0);
  CHECK(fd >= 0);
  struct stat st {};
  CHECK(::fstat(fd, &st) == 0);
  ::close(fd);
  CHECK_EQ(static_cast<unsigned>(st.st_mode & 07777), 0600u);
  CHECK(S_ISREG(st.st_mode));
  CHECK_EQ(st.st_uid, ::geteuid());
  CHECK_EQ(static_cast<long long>(st.st_size), 4096LL);
  CHECK(fastfeed::unlink_segment(name));
}

void test_unlink_true_then_false() {
  const std::string name = fresh_name();
  { auto s = Segment::create(name, 4096); }
  CHECK(shm_exists(name));
  CHECK(fastfeed::unlink_segment(name));
  CHECK(!shm_exists(name));
  CHECK(!fastfeed::unlink_segment(name));
  CHECK(!fastfeed::unlink_segment(name.substr(1)));  // same name without the '/'
}

// Without a CUDA runtime (this test never loads a real one): loading reports why, pinning
// throws CudaError and leaves the segment unpinned, and neither unpin() nor its destructor unregisters.
void test_cuda_runtime_absent() {
  CHECK(!fastfeed::cuda::loaded());
  const std::string missing = fastfeed::cuda::load("/nonexistent/libcudart.so.12");
  CHECK_MSG(missing.find("nonexistent") != std::string::npos, missing);
  const std::string not_cuda = fastfeed::cuda::load("libc.so.6");
  CHECK_MSG(not_cuda.find("has no symbol cudaHostRegister") != std::string::npos, not_cuda);
  CHECK(!fastfeed::cuda::loaded());
  CHECK(fastfeed::cuda::host_unregister(nullptr) == -1);
  const std::string name = fresh_name();
  {
    auto s = Segment::create(name, 4096);
    bool threw = false;
    try {
      s->pin();
    } catch (const fastfeed::CudaError& e) {
      threw = std::string(e.what()).find("not loaded") != std::string::npos;
    }
    CHECK(threw);
    CHECK(!s->pinned());
    CHECK(s->unpin() == 0);  // nothing registered: nothing to undo, and no runtime is called
  }
  CHECK(fastfeed::unlink_segment(name));
}

void test_attach_missing() {
  const std::string name = fresh_name();
  const std::string what = CHECK_OS_ERROR(Segment::attach(name), ENOENT);
  CHECK_MSG(what.find(name) != std::string::npos, what);
  CHECK(!shm_exists(name));  // attach never creates
}

void test_attach_refuses_foreign_mode() {
  const std::string name = fresh_name();
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0644);
  if (!CHECK(fd >= 0)) return;
  CHECK(::fchmod(fd, 0644) == 0);  // whatever the umask took away
  CHECK(::ftruncate(fd, 4096) == 0);
  ::close(fd);
  const std::string what = CHECK_OS_ERROR(Segment::attach(name), EACCES);
  CHECK_MSG(what.find("0644") != std::string::npos, what);
  // 0660 and 0604 are refused as well; 0600 attaches.
  for (mode_t mode : {0660, 0604, 0701}) {
    CHECK(set_mode(name, mode));
    CHECK_OS_ERROR(Segment::attach(name), EACCES);
  }
  CHECK(set_mode(name, 0600));
  {
    auto s = Segment::attach(name);
    CHECK_EQ(s->size(), std::size_t{4096});
  }
  CHECK(fastfeed::unlink_segment(name));
}

void test_attach_refuses_empty() {
  const std::string name = fresh_name();
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (!CHECK(fd >= 0)) return;
  ::close(fd);  // size 0: created but never sized, e.g. a creator that died half-way
  CHECK_OS_ERROR(Segment::attach(name), EINVAL);
  CHECK(fastfeed::unlink_segment(name));
}

void test_bad_sizes_and_names() {
  for (std::int64_t size : {std::int64_t{0}, std::int64_t{-1}, INT64_MIN}) {
    const std::string name = fresh_name();
    CHECK_THROWS_AS(Segment::create(name, size), std::invalid_argument);
    CHECK(!shm_exists(name));
  }
  // Invalid both as POSIX shm names and as absolute file paths (a relative path, a
  // trailing '/').
  for (const char* bad : {"", "/", "//", "a/b", "x/", "/x/"}) {
    CHECK_THROWS_AS(Segment::create(bad, 4096), std::invalid_argument);
    CHECK_THROWS_AS(Segment::attach(bad), std::invalid_argument);
    CHECK_THROWS_AS(fastfeed::unlink_segment(bad), std::invalid_argument);
  }
  CHECK_EQ(fastfeed::normalize_name("x"), std::string("/x"));
  CHECK_EQ(fastfeed::normalize_name("/x"), std::string("/x"));
}

// Each OS failure inside create must throw OsError and remove the name it had made.
void test_create_failure_paths() {
  // mmap (and, on some kernels, ftruncate) fails for an absurd size: 2^60 bytes.
  {
    const std::string name = fresh_name();
    bool threw = false;
    try {
      Segment::create(name, std::int64_t{1} << 60);
    } catch (const OsError& e) {
      threw = true;
      CHECK_MSG(e.err() == ENOMEM || e.err() == EFBIG || e.err() == ENOSPC ||
                    e.err() == EINVAL,
                e.what());
      CHECK_MSG(std::string(e.what()).find(name) != std::string::npos, e.what());
    }
    CHECK(threw);
    CHECK(!shm_exists(name));
  }
  // ftruncate fails: RLIMIT_FSIZE below the size (EFBIG; SIGXFSZ ignored meanwhile).
  {
    const std::string name = fresh_name();
    struct rlimit old {};
    CHECK(::getrlimit(RLIMIT_FSIZE, &old) == 0);
    struct rlimit small = old;
    small.rlim_cur = 4096;
    struct sigaction ign {}, prev {};
    ign.sa_handler = SIG_IGN;
    CHECK(::sigaction(SIGXFSZ, &ign, &prev) == 0);
    CHECK(::setrlimit(RLIMIT_FSIZE, &small) == 0);
    std::string what;
    int err = 0;
    try {
      Segment::create(name, 1 << 20);
    } catch (const OsError& e) {
      err = e.err();
      what = e.what();
    }
    CHECK(::setrlimit(RLIMIT_FSIZE, &old) == 0);
    CHECK(::sigaction(SIGXFSZ, &prev, nullptr) == 0);
    CHECK_MSG(err == EFBIG, "err=" + std::to_string(err) + " what=" + what);
    CHECK(!shm_exists(name));
  }
  // fallocate fails: more than the whole tmpfs holds (tmpfs answers ENOSPC at once,
  // without allocating, when the request exceeds its size). The mapping itself succeeds.
  {
    struct statvfs vfs {};
    const bool have = ::statvfs("/dev/shm", &vfs) == 0 && vfs.f_blocks > 0;
    const unsigned long long total =
        have ? static_cast<unsigned long long>(vfs.f_blocks) * vfs.f_frsize : 0;
    const unsigned long long ask = total + (1ULL << 30);
    if (!have || ask > (1ULL << 40)) {
      std::printf("  note: fallocate failure path skipped (/dev/shm size %llu unknown or > 1 TiB)\n",
                  total);
    } else {
      const std::string name = fresh_name();
      const int fds_before = count_open_fds();
      int err = 0;
      std::string what;
      try {
        Segment::create(name, static_cast<std::int64_t>(ask));
      } catch (const OsError& e) {
        err = e.err();
        what = e.what();
      }
      CHECK_MSG(err == ENOSPC, "err=" + std::to_string(err) + " what=" + what);
      CHECK_MSG(what.find(name) != std::string::npos, what);
      CHECK(!shm_exists(name));
      CHECK(!is_mapped(name));  // fail_create unmapped it
      CHECK_EQ(count_open_fds(), fds_before);
    }
  }
}

void test_no_leaked_fds_and_destructor_unmaps() {
  const int before = count_open_fds();
  CHECK(before > 0);
  const std::string name = fresh_name();
  {
    auto a = Segment::create(name, 65536);
    CHECK_EQ(count_open_fds(), before);  // create keeps no descriptor
    auto b = Segment::attach(name);
    auto c = Segment::attach(name, false);
    CHECK_EQ(count_open_fds(), before);  // nor does attach
    CHECK(is_mapped(name));
    b.reset();
    c.reset();
    CHECK(is_mapped(name));  // a's mapping is still there
  }
  CHECK(!is_mapped(name));  // every destructor unmapped
  CHECK_EQ(count_open_fds(), before);
  // Error paths close their descriptors too.
  CHECK_OS_ERROR(Segment::attach(name + "x"), ENOENT);
  CHECK_OS_ERROR(Segment::create(name, 4096), EEXIST);  // the name still exists
  CHECK_THROWS_AS(Segment::create(name, 0), std::invalid_argument);
  CHECK_EQ(count_open_fds(), before);
  for (int i = 0; i < 50; ++i) {
    auto a = Segment::attach(name);
    CHECK_OS_ERROR(Segment::create(name, 4096), EEXIST);
  }
  CHECK_EQ(count_open_fds(), before);
  CHECK(fastfeed::unlink_segment(name));
  CHECK(!is_mapped(name));
}

// --- gather --------------------------------------------------------------------------------

using Srcs = std::vector<std::pair<std::uintptr_t, std::size_t>>;
using GatherFn = void (*)(std::uint8_t*, const Srcs&);

constexpr std::size_t kGuard = 64;
constexpr std::uint8_t kGuardByte = 0xA5;
constexpr std::uint8_t kFreshByte = 0x5A;
const std::size_t kSizes[] = {0, 1, 15, 16, 63, 64, 65, 16383, 16384, 16385, 100003};

// A source buffer of exactly n bytes at `misalign` bytes past a 64-byte boundary. Under ASan
// the bytes before it are poisoned, and the heap redzone follows it, so over-reads report.
class Source {
 public:
  Source(std::size_t n, std::size_t misalign, std::uint32_t seed)
      : storage_(static_cast<std::uint8_t*>(::operator new(64 + misalign + n, std::align_val_t{64}))),
        begin_(storage_ + 64 + misalign), n_(n), cap_(64 + misalign + n) {
    FF_POISON(storage_, 64 + misalign);
    fill_pattern(begin_, n, seed);
  }
  ~Source() {
    FF_UNPOISON(storage_, cap_);
    ::operator delete(storage_, std::align_val_t{64});
  }
  Source(const Source&) = delete;
  Source& operator=(const Source&) = delete;
  Source(Source&& o) noexcept : storage_(o.storage_), begin_(o.begin_), n_(o.n_), cap_(o.cap_) {
    o.storage_ = nullptr;
    o.cap_ = 0;
  }
  const std::uint8_t* data() const { return begin_; }
  std::size_t size() const { return n_; }

 private:
  std::uint8_t* storage_;
  std::uint8_t* begin_;
  std::size_t n_;
  std::size_t cap_;
};

// Gathers `sources` into a destination `dst_misalign` bytes past a 64-byte boundary, with
// kGuard guard bytes on both sides (poisoned under ASan), and compares with memcpy.
bool gather_and_compare(GatherFn fn, const std::vector<const Source*>& sources,
                        std::size_t dst_misalign, const std::string& what) {
  std::size_t total = 0;
  Srcs srcs;
  for (const Source* s : sources) {
    srcs.emplace_back(reinterpret_cast<std::uintptr_t>(s->data()), s->size());
    total += s->size();
  }
  std::vector<std::uint8_t> expected(total + 1);
  std::size_t off = 0;
  for (const Source* s : sources) {
    if (s->size() != 0) std::memcpy(expected.data() + off, s->data(), s->size());
    off += s->size();
  }

  const std::size_t cap = kGuard + dst_misalign + total + kGuard;
  auto* storage = static_cast<std::uint8_t*>(::operator new(cap, std::align_val_t{64}));
  std::memset(storage, kGuardByte, cap);
  std::uint8_t* dst = storage + kGuard + dst_misalign;
  std::memset(dst, kFreshByte, total);
  FF_POISON(storage, kGuard + dst_misalign);
  FF_POISON(dst + total, kGuard);

  fn(dst, srcs);

  FF_UNPOISON(storage, cap);
  bool ok = CHECK_MSG(total == 0 || std::memcmp(dst, expected.data(), total) == 0, what);
  if (!ok) {
    for (std::size_t i = 0; i < total; ++i)
      if (dst[i] != expected[i]) {
        std::fprintf(stderr, "    first difference at byte %zu of %zu: got 0x%02x, want 0x%02x\n",
                     i, total, dst[i], expected[i]);
        break;
      }
  }
  const bool before_ok = std::all_of(storage, dst, [](std::uint8_t b) { return b == kGuardByte; });
  const bool after_ok =
      std::all_of(dst + total, storage + cap, [](std::uint8_t b) { return b == kGuardByte; });
  ok &= CHECK_MSG(before_ok, "guard bytes before the destination changed: " + what);
  ok &= CHECK_MSG(after_ok, "guard bytes after the destination changed: " + what);
  ::operator delete(storage, std::align_val_t{64});
  return ok;
}

void gather_matrix(GatherFn fn) {
  std::uint32_t seed = 1;
  for (std::size_t dmis = 0; dmis <= 17; ++dmis) {
    for (std::size_t smis = 0; smis <= 3; ++smis) {
      // Singly.
      for (std::size_t n : kSizes) {
        Source s(n, smis, seed++);
        gather_and_compare(fn, {&s}, dmis, "single n=" + std::to_string(n) + " dst_misalign=" +
                                               std::to_string(dmis) + " src_misalign=" +
                                               std::to_string(smis));
      }
      // Back to back: every size in one call, each source at its own misalignment, so that
      // later sources start at every offset the earlier sizes leave; then in reverse order.
      std::vector<Source> owned;
      owned.reserve(std::size(kSizes));
      std::size_t k = 0;
      for (std::size_t n : kSizes) owned.emplace_back(n, (smis + k++) % 4, seed++);
      std::vector<const Source*> all;
      for (const Source& s : owned) all.push_back(&s);
      const std::string where =
          " dst_misalign=" + std::to_string(dmis) + " src_misalign=" + std::to_string(smis);
      gather_and_compare(fn, all, dmis, "all sizes ascending" + where);
      std::reverse(all.begin(), all.end());
      gather_and_compare(fn, all, dmis, "all sizes descending" + where);
      // Several large ones in a row (each streamed, with odd lengths between).
      gather_and_compare(fn, {&owned[8], &owned[10], &owned[9], &owned[1], &owned[10]}, dmis,
                         "large run" + where);
    }
  }
  // Degenerate calls: nothing at all; only empty sources.
  {
    Source empty(0, 1, 0);
    gather_and_compare(fn, {}, 3, "no sources");
    gather_and_compare(fn, {&empty, &empty, &empty}, 5, "only empty sources");
  }
}

void test_gather_matrix() { gather_matrix(&fastfeed::gather); }

// gather into and out of shared memory, i.e. the way fastfeed uses it.
void test_gather_into_segment() {
  const std::string name = fresh_name();
  const std::size_t n1 = 100003, n2 = 16385, n3 = 7;
  auto seg = Segment::create(name, 3 * 65536);
  auto peer = Segment::attach(name);
  std::vector<std::uint8_t> a(n1), b(n2), c(n3);
  fill_pattern(a.data(), n1, 11);
  fill_pattern(b.data(), n2, 12);
  fill_pattern(c.data(), n3, 13);
  auto* dst = static_cast<std::uint8_t*>(seg->data()) + 3;
  fastfeed::gather(dst, {{reinterpret_cast<std::uintptr_t>(a.data()), n1},
                         {reinterpret_cast<std::uintptr_t>(b.data()), n2},
                         {reinterpret_cast<std::uintptr_t>(c.data()), n3}});
  const auto* seen = static_cast<const std::uint8_t*>(peer->data()) + 3;
  CHECK(std::memcmp(seen, a.data(), n1) == 0);
  CHECK(std::memcmp(seen + n1, b.data(), n2) == 0);
  CHECK(std::memcmp(seen + n1 + n2, c.data(), n3) == 0);
  CHECK_EQ(static_cast<int>(seen[-1]), 0);
  CHECK_EQ(static_cast<int>(seen[n1 + n2 + n3]), 0);
  // Segment to segment.
  const std::string name2 = fresh_name();
  auto seg2 = Segment::create(name2, 65536);
  fastfeed::gather(static_cast<std::uint8_t*>(seg2->data()),
                   {{reinterpret_cast<std::uintptr_t>(seen + n1), n2}});
  CHECK(std::memcmp(seg2->data(), b.data(), n2) == 0);
  CHECK(fastfeed::unlink_segment(name));
  CHECK(fastfeed::unlink_segment(name2));
}

// --- threads -------------------------------------------------------------------------------

// 4 threads, each creating, attaching, filling (gather), checking and unlinking 200 segments,
// and hitting the error paths, all concurrently. The library keeps no shared mutable state;
// under TSan this shows it (strerror-style messages, exceptions, mmap bookkeeping included).
void test_threads() {
  constexpr int kThreads = 4;
  constexpr int kPerThread = 200;
  // One read-only source every thread gathers from at once.
  std::vector<std::uint8_t> shared_src(40000);
  fill_pattern(shared_src.data(), shared_src.size(), 99);
  std::atomic<int> ready{0};
  std::atomic<int> failures{0};

  auto worker = [&](int t) {
    ready.fetch_add(1);
    while (ready.load() < kThreads) std::this_thread::yield();  // start together
    std::vector<std::uint8_t> own(20000);
    fill_pattern(own.data(), own.size(), static_cast<std::uint32_t>(1000 + t));
    for (int i = 0; i < kPerThread; ++i) {
      const std::string name = fresh_name();
      const std::size_t n_shared = 1 + static_cast<std::size_t>((i * 7919 + t * 104729) % 39999);
      const std::size_t n_own = (i % 3 == 0) ? 16384 + static_cast<std::size_t>(i) : static_cast<std::size_t>(i);
      const std::size_t size = n_shared + n_own + 1 + static_cast<std::size_t>(t);
      try {
        auto seg = Segment::create(name, static_cast<std::int64_t>(size), -1, i % 2 == 0);
        auto peer = Segment::attach(name, i % 2 == 1);
        auto* dst = static_cast<std::uint8_t*>(seg->data()) + 1;
        fastfeed::gather(dst, {{reinterpret_cast<std::uintptr_t>(shared_src.data()), n_shared},
                               {reinterpret_cast<std::uintptr_t>(own.data()), n_own}});
        const auto* seen = static_cast<const std::uint8_t*>(peer->data()) + 1;
        bool ok = std::memcmp(seen, shared_src.data(), n_shared) == 0 &&
                  std::memcmp(seen + n_shared, own.data(), n_own) == 0;
        ok = CHECK_MSG(ok, "thread " + std::to_string(t) + " iteration " + std::to_string(i)) && ok;
        if (i % 10 == 0) {
          CHECK_OS_ERROR(Segment::create(name, 4096), EEXIST);
          CHECK_OS_ERROR(Segment::attach(name + "-missing"), ENOENT);
        }
        CHECK(fastfeed::unlink_segment(name));
        if (i % 10 == 5) CHECK(!fastfeed::unlink_segment(name));
        if (!ok) failures.fetch_add(1);
      } catch (const std::exception& e) {
        CHECK_MSG(false, std::string("thread ") + std::to_string(t) + ": " + e.what());
        failures.fetch_add(1);
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  CHECK_EQ(failures.load(), 0);
}

// --- free list ---------------------------------------------------------------------------

void test_freelist_claims_lowest_and_empties() {
  std::uint64_t words[2] = {0, 0};
  CHECK_EQ(fastfeed::claim_bit(words, 2), -1L);
  fastfeed::release_bit(words, 70);
  fastfeed::release_bit(words, 3);
  fastfeed::release_bit(words, 64);
  CHECK_EQ(fastfeed::claim_bit(words, 2), 3L);
  CHECK_EQ(fastfeed::claim_bit(words, 2), 64L);
  CHECK_EQ(fastfeed::claim_bit(words, 2), 70L);
  CHECK_EQ(fastfeed::claim_bit(words, 2), -1L);
  CHECK_EQ(words[0] | words[1], std::uint64_t{0});
}

void test_freelist_threads_never_share_a_slot() {
  // Threads claim, hold, check exclusivity and release 128 bits for a while: no bit is ever
  // held twice, and at the end every bit is free again.
  constexpr int kThreads = 4;
  constexpr int kRounds = 20000;
  constexpr std::size_t kBits = 128;
  std::uint64_t words[kBits / 64] = {~std::uint64_t{0}, ~std::uint64_t{0}};
  std::vector<std::atomic<int>> holders(kBits);
  std::atomic<int> doubled{0};
  auto worker = [&]() {
    for (int i = 0; i < kRounds; ++i) {
      long bit = fastfeed::claim_bit(words, kBits / 64);
      if (bit < 0) continue;
      if (holders[static_cast<std::size_t>(bit)].fetch_add(1) != 0) doubled.fetch_add(1);
      holders[static_cast<std::size_t>(bit)].fetch_sub(1);
      fastfeed::release_bit(words, static_cast<std::size_t>(bit));
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker);
  for (auto& th : threads) th.join();
  CHECK_EQ(doubled.load(), 0);
  CHECK_EQ(words[0] & words[1], ~std::uint64_t{0});
}

void test_add_count_from_threads() {
  std::uint64_t counter = 5;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&counter]() {
      for (int i = 0; i < 10000; ++i) fastfeed::add_count(&counter, 1);
    });
  }
  for (auto& th : threads) th.join();
  CHECK_EQ(counter, std::uint64_t{40005});
  CHECK_EQ(fastfeed::add_count(&counter, 0), std::uint64_t{40005});
}

// --- final sweep ---------------------------------------------------------------------------

void test_every_name_cleaned_up() {
  std::lock_guard<std::mutex> lock(g_names_mutex);
  std::size_t left = 0;
  for (const std::string& name : g_names) {
    if (::shm_unlink(name.c_str()) == 0) {
      ++left;
      check_impl(false, "segment name cleaned up", __FILE__, __LINE__, name + " was left behind");
    }
  }
  CHECK_EQ(left, std::size_t{0});
  std::printf("  (%zu segment names used)\n", g_names.size());
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const Test tests[] = {
      {"create_attach_share_bytes", test_create_attach_share_bytes},
      {"create_options", test_create_options},
      {"create_is_exclusive", test_create_is_exclusive},
      {"mode_0600", test_mode_0600},
      {"unlink_true_then_false", test_unlink_true_then_false},
      {"attach_missing", test_attach_missing},
      {"cuda_runtime_absent", test_cuda_runtime_absent},
      {"attach_refuses_foreign_mode", test_attach_refuses_foreign_mode},
      {"attach_refuses_empty", test_attach_refuses_empty},
      {"bad_sizes_and_names", test_bad_sizes_and_names},
      {"create_failure_paths", test_create_failure_paths},
      {"no_leaked_fds_and_destructor_unmaps", test_no_leaked_fds_and_destructor_unmaps},
      {"gather_matrix", test_gather_matrix},
      {"gather_into_segment", test_gather_into_segment},
      {"threads", test_threads},
      {"freelist_claims_lowest_and_empties", test_freelist_claims_lowest_and_empties},
      {"freelist_threads_never_share_a_slot", test_freelist_threads_never_share_a_slot},
      {"add_count_from_threads", test_add_count_from_threads},
      {"every_name_cleaned_up", test_every_name_cleaned_up},
  };
  for (const Test& t : tests) {
    const long failed_before = g_failed.load();
    try {
      t.fn();
    } catch (const std::exception& e) {
      check_impl(false, t.name, __FILE__, __LINE__, std::string("uncaught exception: ") + e.what());
    }
    std::printf("%s %s\n", g_failed.load() == failed_before ? "ok  " : "FAIL", t.name);
  }
  std::printf("%ld passed, %ld failed\n", g_passed.load(), g_failed.load());
  return g_failed.load() == 0 ? 0 : 1;
}
