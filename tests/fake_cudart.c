/* A stand-in for libcudart's host-registration calls, for tests on machines without CUDA.
 *
 * It keeps the registered ranges, so a test can check that every ring segment is registered
 * once and unregistered before it is unmapped: cudaHostUnregister of a range that is no
 * longer mapped (msync fails with ENOMEM) is counted as a fault, as is unregistering a
 * pointer that was never registered. It also records, for each registration, the device
 * current on the calling thread (cudaSetDevice is per thread, as in CUDA; a thread that never
 * set one is on device 0, where a real runtime would make a context) and the thread, and it
 * can hold registrations until the test lets them go, so a test can show that the loop never
 * waits for one. Built by tests/test_pinning.py with `cc -shared`. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_RANGES 4096
#define MAX_DEVICES 8

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER; /* registration runs on a thread of its own */
static void* g_ptr[MAX_RANGES];
static size_t g_size[MAX_RANGES];
static long g_registered, g_register_calls, g_unregister_calls, g_faults;
static long g_on_device[MAX_DEVICES];
static long g_last_tid;
static int g_fail_next;
static volatile int g_hold;
static __thread int t_device; /* 0 until cudaSetDevice, as CUDA's default device */

static int mapped(void* p) {
  uintptr_t page = (uintptr_t)p & ~(uintptr_t)(sysconf(_SC_PAGESIZE) - 1);
  return msync((void*)page, 1, MS_ASYNC) == 0 || errno != ENOMEM;
}

int cudaSetDevice(int device) {
  if (device < 0 || device >= MAX_DEVICES) return 101; /* cudaErrorInvalidDevice */
  t_device = device;
  return 0;
}

int cudaHostRegister(void* ptr, size_t size, unsigned flags) {
  (void)flags;
  while (g_hold) usleep(1000);
  pthread_mutex_lock(&g_lock);
  int err = 0;
  g_register_calls++;
  g_on_device[t_device]++;
  g_last_tid = (long)syscall(SYS_gettid);
  if (g_fail_next) {
    err = g_fail_next;
    g_fail_next = 0;
    goto out;
  }
  for (int i = 0; i < MAX_RANGES; i++) {
    if (g_ptr[i] == ptr) {
      err = 712; /* cudaErrorHostMemoryAlreadyRegistered */
      goto out;
    }
  }
  err = 2; /* cudaErrorMemoryAllocation, unless a free entry is found */
  for (int i = 0; i < MAX_RANGES; i++) {
    if (g_ptr[i] == NULL) {
      g_ptr[i] = ptr;
      g_size[i] = size;
      g_registered++;
      err = 0;
      break;
    }
  }
out:
  pthread_mutex_unlock(&g_lock);
  return err;
}

int cudaHostUnregister(void* ptr) {
  pthread_mutex_lock(&g_lock);
  int err = 713; /* cudaErrorHostMemoryNotRegistered, unless found */
  g_unregister_calls++;
  if (!mapped(ptr)) g_faults++;
  for (int i = 0; i < MAX_RANGES; i++) {
    if (g_ptr[i] == ptr) {
      g_ptr[i] = NULL;
      g_registered--;
      err = 0;
      break;
    }
  }
  if (err) g_faults++;
  pthread_mutex_unlock(&g_lock);
  return err;
}

const char* cudaGetErrorString(int err) {
  return err == 2     ? "out of memory"
         : err == 712 ? "part or all of the requested memory range is already mapped"
         : err == 101 ? "invalid device ordinal"
                      : "fake error";
}

/* What the tests read back (through ctypes). */
long fake_registered(void) { return g_registered; }
long fake_register_calls(void) { return g_register_calls; }
long fake_unregister_calls(void) { return g_unregister_calls; }
long fake_faults(void) { return g_faults; }
long fake_registered_on(int device) { return device >= 0 && device < MAX_DEVICES ? g_on_device[device] : -1; }
long fake_last_register_tid(void) { return g_last_tid; }
int fake_is_registered(void* ptr) {
  int found = 0;
  pthread_mutex_lock(&g_lock);
  for (int i = 0; i < MAX_RANGES; i++)
    if (g_ptr[i] == ptr) found = 1;
  pthread_mutex_unlock(&g_lock);
  return found;
}
void fake_fail_next(int err) { g_fail_next = err; }
void fake_hold(int on) { g_hold = on; }
