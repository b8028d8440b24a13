// POSIX shared-memory segments: create, attach, unlink. Pure C++ (no Python headers),
// Linux only. Policy (naming, sizing, when to unlink) belongs to the Python side.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

namespace fastfeed {

// An OS call failed. err() is the errno; what() reads "<strerror>: <what we were doing>".
// The bindings turn it into OSError(err, what()), which Python maps to FileExistsError etc.
class OsError : public std::runtime_error {
 public:
  OsError(int err, const std::string& doing);
  int err() const noexcept { return err_; }

 private:
  int err_;
};

// One MAP_SHARED mapping of a named segment. Destruction unmaps; there is deliberately no
// close(): unmapping under a live tensor would segfault, so owners just drop references.
class Segment {
 public:
  // Creates `name` (O_EXCL, mode 0600), allocates all of its tmpfs pages and maps them
  // prefaulted. numa_node >= 0 asks for the pages on that node (best effort: numa_bound()).
  // Throws std::invalid_argument for a bad name or size <= 0, OsError otherwise; on any
  // error the name is removed again and nothing leaks.
  static std::unique_ptr<Segment> create(const std::string& name, std::int64_t size,
                                         int numa_node = -1, bool hugepage = true);
  // Maps an existing segment, which must belong to this euid and be mode 0600-like.
  // populate: map every page now (for memory about to be written or read in full).
  static std::unique_ptr<Segment> attach(const std::string& name, bool populate = true);

  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  const std::string& name() const noexcept { return name_; }
  void* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  bool numa_bound() const noexcept { return numa_bound_; }
  bool pinned() const noexcept { return pinned_.load(std::memory_order_acquire); }

  // Page-locks the whole mapping with cudaHostRegister, once (later calls do nothing), so
  // copies to a GPU are DMA from it; under `device` when >= 0 (see cuda::host_register: it
  // sets the calling thread's device). Destruction unregisters before it unmaps. Throws
  // CudaError. Not to be called concurrently with unpin() on the same segment.
  void pin(int device = -1);
  // Unregisters now, if pinned (so that a thread of the caller's choosing pays for it, not
  // the destructor's). Returns CUDA's error code, 0 when there was nothing to do.
  int unpin() noexcept;

 private:
  Segment(std::string name, void* data, std::size_t size, bool numa_bound)
      : name_(std::move(name)), data_(data), size_(size), numa_bound_(numa_bound) {}

  std::string name_;
  void* data_;
  std::size_t size_;
  bool numa_bound_;
  std::atomic<bool> pinned_{false};  // read by any thread (ring owners poll it)
};

// "/x" or "x" -> "/x", a POSIX shm name. An absolute path ("/dir/x") names a file-backed
// segment instead (FASTFEED_SHM_DIR). Throws std::invalid_argument for an empty name, a
// relative path or one ending in '/'. Callers pass only names they made themselves.
std::string normalize_name(const std::string& name);

// shm_unlink (or unlink, for a path): true if removed, false if it did not exist; other
// errors throw OsError.
bool unlink_segment(const std::string& name);

}  // namespace fastfeed
