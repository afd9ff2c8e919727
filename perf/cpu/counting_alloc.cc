// Replaces the global operator new / delete (every form the C++20 library declares) with
// malloc/free plus relaxed counters. Only the perf/cpu benchmark binaries link this file.
#include "perf/cpu/counting_alloc.h"

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <new>

namespace kvwire::perf::cpu {
namespace {

std::atomic<uint64_t> g_news{0}, g_deletes{0}, g_bytes{0};
thread_local uint64_t t_news = 0, t_deletes = 0, t_bytes = 0;

void* Allocate(std::size_t n, std::size_t align, bool nothrow) {
  if (n == 0) n = 1;
  void* p = nullptr;
  if (align > alignof(std::max_align_t)) {
    // aligned_alloc wants a size that is a multiple of the alignment.
    p = std::aligned_alloc(align, (n + align - 1) / align * align);
  } else {
    p = std::malloc(n);
  }
  if (p == nullptr) {
    if (nothrow) return nullptr;
    throw std::bad_alloc();
  }
  g_news.fetch_add(1, std::memory_order_relaxed);
  g_bytes.fetch_add(n, std::memory_order_relaxed);
  ++t_news;
  t_bytes += n;
  return p;
}

void Release(void* p) {
  if (p == nullptr) return;
  g_deletes.fetch_add(1, std::memory_order_relaxed);
  ++t_deletes;
  std::free(p);
}

}  // namespace

AllocCounts ProcessAllocs() {
  return {g_news.load(std::memory_order_relaxed), g_deletes.load(std::memory_order_relaxed),
          g_bytes.load(std::memory_order_relaxed)};
}

AllocCounts ThreadAllocs() { return {t_news, t_deletes, t_bytes}; }

}  // namespace kvwire::perf::cpu

using kvwire::perf::cpu::Allocate;
using kvwire::perf::cpu::Release;

void* operator new(std::size_t n) { return Allocate(n, 0, false); }
void* operator new[](std::size_t n) { return Allocate(n, 0, false); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return Allocate(n, 0, true); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return Allocate(n, 0, true); }
void* operator new(std::size_t n, std::align_val_t a) {
  return Allocate(n, static_cast<std::size_t>(a), false);
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return Allocate(n, static_cast<std::size_t>(a), false);
}
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return Allocate(n, static_cast<std::size_t>(a), true);
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return Allocate(n, static_cast<std::size_t>(a), true);
}
void operator delete(void* p) noexcept { Release(p); }
void operator delete[](void* p) noexcept { Release(p); }
void operator delete(void* p, std::size_t) noexcept { Release(p); }
void operator delete[](void* p, std::size_t) noexcept { Release(p); }
void operator delete(void* p, std::align_val_t) noexcept { Release(p); }
void operator delete[](void* p, std::align_val_t) noexcept { Release(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { Release(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { Release(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { Release(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { Release(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { Release(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { Release(p); }
