#include "transport/shm/shareable_registry.h"

#include <cstdint>
#include <map>

#include "src/util/mutex.h"

namespace kvwire::transport {
namespace {

struct Entry {
  size_t size = 0;
  int fd = -1;
};

class Registry {
 public:
  void Add(uintptr_t base, size_t size, int fd) {
    MutexLock lock(&mu_);
    entries_[base] = Entry{size, fd};
  }
  void Remove(uintptr_t base) {
    MutexLock lock(&mu_);
    entries_.erase(base);
  }
  std::optional<ShareableBacking> Find(uintptr_t ptr, size_t length) {
    MutexLock lock(&mu_);
    // The last buffer starting at or below `ptr` is the only one that can contain it: live
    // buffers are distinct mappings and never overlap.
    auto it = entries_.upper_bound(ptr);
    if (it == entries_.begin()) return std::nullopt;
    --it;
    const uintptr_t offset = ptr - it->first;
    const Entry& entry = it->second;
    if (offset >= entry.size || length > entry.size - offset) return std::nullopt;
    return ShareableBacking{entry.fd, offset};
  }

 private:
  Mutex mu_;
  std::map<uintptr_t, Entry> entries_ ABSL_GUARDED_BY(mu_);
};

Registry& GetRegistry() {
  // Never destroyed (static objects must be trivially destructible): buffers released by
  // other static destructors at exit can still unregister.
  static Registry* const registry = new Registry();
  return *registry;
}

}  // namespace

std::optional<ShareableBacking> FindShareable(const void* ptr, size_t length) {
  return GetRegistry().Find(reinterpret_cast<uintptr_t>(ptr), length);
}

namespace shm {

void RegisterShareable(const void* base, size_t size, int fd) {
  GetRegistry().Add(reinterpret_cast<uintptr_t>(base), size, fd);
}

void UnregisterShareable(const void* base) {
  GetRegistry().Remove(reinterpret_cast<uintptr_t>(base));
}

}  // namespace shm
}  // namespace kvwire::transport
