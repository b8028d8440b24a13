// The CUDA runtime, loaded at run time with dlopen, so that one build of the extension
// serves machines with and without CUDA. Only host-memory registration is needed here:
// copies and streams belong to torch. Pure C++ (no Python headers).
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

namespace fastfeed {

// A CUDA runtime call failed; what() names the call, the error code and CUDA's own text.
class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace cuda {

// Loads the runtime library at `path` (the libcudart that torch loaded) and resolves what we
// call. Returns "" on success, or why it failed; a failure leaves any earlier load in place.
// A loaded runtime is never unloaded: pinned segments may outlive any owner of it.
std::string load(const std::string& path);

bool loaded() noexcept;

// cudaHostRegister(ptr, size, cudaHostRegisterPortable): page-locks the range for every CUDA
// context. With device >= 0, cudaSetDevice(device) first, on the calling thread, and it stays
// set: registration needs a context, and on the current device it would be made on GPU 0 for a
// process that targets another (pytorch#21081). Call it from a thread of your own, never from
// the user's. Throws CudaError (also when no runtime is loaded).
void host_register(void* ptr, std::size_t size, int device = -1);

// cudaHostUnregister. Returns the CUDA error code (0: success); never throws, because it
// runs in destructors. A no-op returning -1 when no runtime is loaded.
int host_unregister(void* ptr) noexcept;

}  // namespace cuda
}  // namespace fastfeed
