#include "transport/tcp/tcp_gather.h"

#include "transport/tcp/tcp_socket.h"

namespace kvwire::transport {

void GatherList::Reserve(size_t entries) {
  iov_.reserve(entries);
  devices_.reserve(entries);
}

void GatherList::Clear() {
  iov_.clear();
  devices_.clear();
  staged_ = false;
  sent_ = 0;
}

void GatherList::AddHeader(const std::byte* data, size_t length) {
  if (!iov_.empty() && devices_.back() < 0 &&
      static_cast<std::byte*>(iov_.back().iov_base) + iov_.back().iov_len == data) {
    iov_.back().iov_len += length;
    return;
  }
  iov_.push_back({const_cast<std::byte*>(data), length});
  devices_.push_back(-1);
}

void GatherList::AddPayload(const std::byte* data, uint64_t length, int device) {
  iov_.push_back({const_cast<std::byte*>(data), length});
  devices_.push_back(device < 0 ? -1 : device);
  staged_ = staged_ || device >= 0;
}

absl::Status GatherList::Send(int fd, StagedSender& staging) {
  if (!staged_) return SendAll(fd, iov_.data(), iov_.size());
  pieces_.clear();
  for (size_t i = 0; i < iov_.size(); ++i) {
    pieces_.push_back(
        {static_cast<const std::byte*>(iov_[i].iov_base), iov_[i].iov_len, devices_[i]});
  }
  return staging.Send(fd, pieces_);
}

absl::StatusOr<bool> GatherList::SendSome(int fd) {
  while (sent_ < iov_.size()) {
    absl::StatusOr<size_t> n = transport::SendSome(fd, iov_.data() + sent_, iov_.size() - sent_);
    if (!n.ok()) return n.status();
    if (*n == 0) return false;
    size_t left = *n;
    while (sent_ < iov_.size() && left >= iov_[sent_].iov_len) {
      left -= iov_[sent_].iov_len;
      ++sent_;
    }
    if (left > 0) {
      iov_[sent_].iov_base = static_cast<char*>(iov_[sent_].iov_base) + left;
      iov_[sent_].iov_len -= left;
    }
  }
  return true;
}

}  // namespace kvwire::transport
