#include "src/util/admission.h"

namespace kvwire {

Admission::Refusal Admission::Check(const std::string& source, size_t open) const {
  if (pending_ >= limits_.max_pending) return Refusal::kPending;
  if (pending_from(source) >= limits_.max_pending_per_source) return Refusal::kPendingFromSource;
  if (open >= limits_.max_open) return Refusal::kOpen;
  return Refusal::kNone;
}

void Admission::BeginPending(const std::string& source) {
  ++pending_;
  ++pending_by_source_[source];
}

void Admission::EndPending(const std::string& source) {
  auto it = pending_by_source_.find(source);
  if (it == pending_by_source_.end()) return;  // not counted (or cleared meanwhile)
  --pending_;
  if (--it->second == 0) pending_by_source_.erase(it);
}

void Admission::Clear() {
  pending_ = 0;
  pending_by_source_.clear();
}

size_t Admission::pending_from(const std::string& source) const {
  auto it = pending_by_source_.find(source);
  return it == pending_by_source_.end() ? 0 : it->second;
}

}  // namespace kvwire
