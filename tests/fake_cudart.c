/* A stand-in for libcudart's host-registration calls, for tests on machines without CUDA.
 *
 * It keeps the registered ranges, so a test can check that every ring segment is registered
 * once and unregistered before it is unmapped: cudaHostUnregister of a range that is no
 * longer mapped (msync fails with ENOMEM) is counted as a fault, as is unregistering a
 * pointer that was never registered. Built by tests/test_pinning.py with `cc -shared`. */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#define MAX_RANGES 4096

static void* g_ptr[MAX_RANGES];
static size_t g_size[MAX_RANGES];
static long g_registered, g_register_calls, g_unregister_calls, g_faults;
static int g_fail_next;

static int mapped(void* p) {
  uintptr_t page = (uintptr_t)p & ~(uintptr_t)(sysconf(_SC_PAGESIZE) - 1);
  return msync((void*)page, 1, MS_ASYNC) == 0 || errno != ENOMEM;
}

int cudaHostRegister(void* ptr, size_t size, unsigned flags) {
  (void)flags;
  g_register_calls++;
  if (g_fail_next) {
    int err = g_fail_next;
    g_fail_next = 0;
    return err;
  }
  for (int i = 0; i < MAX_RANGES; i++) {
    if (g_ptr[i] == ptr) return 712; /* cudaErrorHostMemoryAlreadyRegistered */
  }
  for (int i = 0; i < MAX_RANGES; i++) {
    if (g_ptr[i] == NULL) {
      g_ptr[i] = ptr;
      g_size[i] = size;
      g_registered++;
      return 0;
    }
  }
  return 2; /* cudaErrorMemoryAllocation */
}

int cudaHostUnregister(void* ptr) {
  g_unregister_calls++;
  if (!mapped(ptr)) g_faults++;
  for (int i = 0; i < MAX_RANGES; i++) {
    if (g_ptr[i] == ptr) {
      g_ptr[i] = NULL;
      g_registered--;
      return 0;
    }
  }
  g_faults++;
  return 713; /* cudaErrorHostMemoryNotRegistered */
}

const char* cudaGetErrorString(int err) {
  return err == 2 ? "out of memory" : err == 712 ? "part or all of the requested memory range is already mapped"
                                                 : "fake error";
}

/* What the tests read back (through ctypes). */
long fake_registered(void) { return g_registered; }
long fake_register_calls(void) { return g_register_calls; }
long fake_unregister_calls(void) { return g_unregister_calls; }
long fake_faults(void) { return g_faults; }
int fake_is_registered(void* ptr) {
  for (int i = 0; i < MAX_RANGES; i++)
    if (g_ptr[i] == ptr) return 1;
  return 0;
}
void fake_fail_next(int err) { g_fail_next = err; }
