#include "cuda.h"

#include <dlfcn.h>

#include <atomic>
#include <mutex>
#include <string>

namespace fastfeed::cuda {
namespace {

constexpr unsigned kHostRegisterPortable = 1;  // cudaHostRegisterPortable

struct Api {
  int (*host_register)(void*, std::size_t, unsigned);
  int (*host_unregister)(void*);
  int (*set_device)(int);
  const char* (*error_string)(int);
};

std::mutex g_load_mutex;        // one load at a time; readers use the atomic pointer only
std::atomic<const Api*> g_api{nullptr};

}  // namespace

std::string load(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_load_mutex);
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = ::dlerror();
    return why != nullptr ? why : ("cannot load " + path);
  }
  auto* api = new Api{};  // leaked on purpose, with the handle: see load() in cuda.h
  const char* missing = nullptr;
  if (!(api->host_register = reinterpret_cast<decltype(api->host_register)>(::dlsym(handle, "cudaHostRegister"))))
    missing = "cudaHostRegister";
  else if (!(api->host_unregister =
                 reinterpret_cast<decltype(api->host_unregister)>(::dlsym(handle, "cudaHostUnregister"))))
    missing = "cudaHostUnregister";
  else if (!(api->set_device = reinterpret_cast<decltype(api->set_device)>(::dlsym(handle, "cudaSetDevice"))))
    missing = "cudaSetDevice";
  else if (!(api->error_string =
                 reinterpret_cast<decltype(api->error_string)>(::dlsym(handle, "cudaGetErrorString"))))
    missing = "cudaGetErrorString";
  if (missing != nullptr) {
    delete api;
    ::dlclose(handle);
    return path + " has no symbol " + missing + ": not a CUDA runtime library";
  }
  g_api.store(api, std::memory_order_release);
  return "";
}

bool loaded() noexcept { return g_api.load(std::memory_order_acquire) != nullptr; }

namespace {

[[noreturn]] void fail(const Api* api, const std::string& call, int err) {
  const char* text = api->error_string(err);
  throw CudaError(call + " failed with error " + std::to_string(err) + ": " +
                  (text != nullptr ? text : "unknown error"));
}

}  // namespace

void host_register(void* ptr, std::size_t size, int device) {
  const Api* api = g_api.load(std::memory_order_acquire);
  if (api == nullptr) throw CudaError("cudaHostRegister: the CUDA runtime is not loaded");
  if (device >= 0) {
    const int err = api->set_device(device);
    if (err != 0) fail(api, "cudaSetDevice(" + std::to_string(device) + ")", err);
  }
  const int err = api->host_register(ptr, size, kHostRegisterPortable);
  if (err != 0) fail(api, "cudaHostRegister of " + std::to_string(size) + " bytes", err);
}

int host_unregister(void* ptr) noexcept {
  const Api* api = g_api.load(std::memory_order_acquire);
  return api == nullptr ? -1 : api->host_unregister(ptr);
}

}  // namespace fastfeed::cuda
