#include "segment.h"

#include "cuda.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <system_error>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14+; older kernels answer EINVAL and we touch pages
#endif
#ifndef MPOL_PREFERRED
#define MPOL_PREFERRED 1  // from <linux/mempolicy.h>; we avoid a libnuma dependency
#endif

namespace fastfeed {

namespace {

std::string describe(int err, const std::string& doing) {
  return std::generic_category().message(err) + ": " + doing;  // thread-safe strerror
}

// A name with a '/' after the first character is a file path (FASTFEED_SHM_DIR puts
// segments on another tmpfs or hugetlbfs mount); any other name is a POSIX shm name.
bool is_path(const std::string& name) { return name.find('/', 1) != std::string::npos; }

int open_segment(const std::string& name, int flags, mode_t mode) {
  // O_NOFOLLOW: in a shared directory, a planted symlink must not redirect us.
  return is_path(name) ? ::open(name.c_str(), flags | O_CLOEXEC | O_NOFOLLOW, mode)
                       : ::shm_open(name.c_str(), flags, mode);
}

int remove_segment(const std::string& name) {
  return is_path(name) ? ::unlink(name.c_str()) : ::shm_unlink(name.c_str());
}

// Closes the descriptor on every path out of create/attach.
struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// Undo a half-made create: the caller sees an exception and must not find a stray name.
[[noreturn]] void fail_create(const std::string& name, void* addr, std::size_t size, int err,
                              const std::string& doing) {
  if (addr != nullptr) ::munmap(addr, size);
  remove_segment(name);
  throw OsError(err, doing);
}

// Prefer `node` for this range. For shmem the policy is stored on the file, so it also
// governs pages allocated later by fallocate. Failure is reported, never raised.
bool bind_to_node(void* addr, std::size_t size, int node) {
  constexpr int kBits = 8 * sizeof(unsigned long);
  constexpr int kMaxNodes = 1024;
  if (node >= kMaxNodes) return false;
  unsigned long mask[kMaxNodes / kBits] = {};
  mask[node / kBits] = 1UL << (node % kBits);
  // maxnode counts one past the last bit the kernel should read (as libnuma passes it).
  return ::syscall(SYS_mbind, addr, size, MPOL_PREFERRED, mask, kMaxNodes + 1, 0) == 0;
}

// Put every page in our page tables now, not on first touch inside the training loop.
void prefault(void* addr, std::size_t size) {
  if (::madvise(addr, size, MADV_POPULATE_WRITE) == 0) return;
  // Old kernel: one write per page. The segment was just created, so its pages are zero.
  const long page = ::sysconf(_SC_PAGESIZE);
  volatile unsigned char* p = static_cast<unsigned char*>(addr);
  for (std::size_t off = 0; off < size; off += static_cast<std::size_t>(page)) p[off] = 0;
}

}  // namespace

OsError::OsError(int err, const std::string& doing)
    : std::runtime_error(describe(err, doing)), err_(err) {}

std::string normalize_name(const std::string& name) {
  std::string n = (!name.empty() && name[0] == '/') ? name : "/" + name;
  if (n.size() < 2 || n.back() == '/' || (is_path(n) && name[0] != '/'))
    throw std::invalid_argument("invalid shared memory segment name '" + name +
                                "': it must be a name without '/', or an absolute file path");
  return n;
}

std::unique_ptr<Segment> Segment::create(const std::string& name_in, std::int64_t size_in,
                                         int numa_node, bool hugepage) {
  const std::string name = normalize_name(name_in);
  if (size_in <= 0)
    throw std::invalid_argument("segment size must be > 0, got " + std::to_string(size_in) +
                                " for segment " + name);
  const auto size = static_cast<std::size_t>(size_in);
  const std::string cannot = "cannot allocate " + std::to_string(size) +
                             " bytes of shared memory for segment " + name;

  // O_EXCL: a name is never silently shared with a stale or foreign segment.
  Fd fd{open_segment(name, O_CREAT | O_EXCL | O_RDWR, 0600)};
  if (fd.fd < 0) {
    const int err = errno;
    throw OsError(err, err == EEXIST ? "shared memory segment " + name + " already exists"
                                     : "cannot create shared memory segment " + name);
  }
  if (::ftruncate(fd.fd, static_cast<off_t>(size)) != 0)
    fail_create(name, nullptr, size, errno, cannot);

  void* addr = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd.fd, 0);
  if (addr == MAP_FAILED) fail_create(name, nullptr, size, errno, cannot);

  // The NUMA policy and hugepage advice must come before fallocate, which allocates the pages.
  const bool bound = numa_node >= 0 && bind_to_node(addr, size, numa_node);
  if (hugepage) ::madvise(addr, size, MADV_HUGEPAGE);  // advice only; EINVAL without THP

  // ftruncate alone makes a sparse file: if /dev/shm is too small, a later first touch
  // dies of SIGBUS. fallocate reserves the pages now, so a full /dev/shm is an error here.
  int err;
  do err = ::posix_fallocate(fd.fd, 0, static_cast<off_t>(size));  // returns the errno
  while (err == EINTR);
  if (err != 0) fail_create(name, addr, size, err, cannot);

  // The mapping keeps the memory; holding the fd would only spend one per segment.
  ::close(fd.fd);
  fd.fd = -1;
  prefault(addr, size);
  return std::unique_ptr<Segment>(new Segment(name, addr, size, bound));
}

std::unique_ptr<Segment> Segment::attach(const std::string& name_in, bool populate) {
  const std::string name = normalize_name(name_in);
  Fd fd{open_segment(name, O_RDWR, 0)};
  if (fd.fd < 0) {
    const int err = errno;
    throw OsError(err, err == ENOENT ? "no shared memory segment named " + name
                                     : "cannot open shared memory segment " + name);
  }
  struct stat st;
  if (::fstat(fd.fd, &st) != 0) {
    const int err = errno;
    throw OsError(err, "cannot stat segment " + name);
  }
  // Shared memory is a security boundary: map only what this user made, private to it.
  if (st.st_uid != ::geteuid())
    throw OsError(EACCES, "refusing to attach segment " + name + ": it is owned by uid " +
                              std::to_string(st.st_uid) + ", not by this process (euid " +
                              std::to_string(::geteuid()) + ")");
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    throw OsError(EACCES, "refusing to attach segment " + name + ": its mode " + mode +
                              " gives access to group or others (expected 0600)");
  }
  if (!S_ISREG(st.st_mode) || st.st_size <= 0)
    throw OsError(EINVAL, "cannot attach segment " + name + ": it is empty or not a file");

  const auto size = static_cast<std::size_t>(st.st_size);
  void* addr =
      ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | (populate ? MAP_POPULATE : 0), fd.fd, 0);
  if (addr == MAP_FAILED) {
    const int err = errno;
    throw OsError(err, "cannot map " + std::to_string(size) + " bytes of segment " + name);
  }
  return std::unique_ptr<Segment>(new Segment(name, addr, size, false));
}

void Segment::pin(int device) {
  if (pinned()) return;
  cuda::host_register(data_, size_, device);
  pinned_.store(true, std::memory_order_release);
}

int Segment::unpin() noexcept {
  if (!pinned_.exchange(false, std::memory_order_acq_rel)) return 0;
  return cuda::host_unregister(data_);
}

Segment::~Segment() {
  // The driver must let go of the pages before they are unmapped; a failure here cannot be
  // reported (destructor) and the unmap is still right.
  unpin();
  ::munmap(data_, size_);
}

bool unlink_segment(const std::string& name_in) {
  const std::string name = normalize_name(name_in);
  if (remove_segment(name) == 0) return true;
  const int err = errno;
  if (err == ENOENT) return false;
  throw OsError(err, "cannot unlink shared memory segment " + name);
}

}  // namespace fastfeed
