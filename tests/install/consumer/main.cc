// Out-of-tree consumer of an installed kvwire, using only the public API: two engines in
// one process; one WRITEs 1 MiB into the other's exported region with a notification, and
// the other checks the bytes and the notification. Prints "consumer ok" on success.
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

#include "kvwire/engine.h"

namespace {

int Fail(const char* what, const absl::Status& status) {
  std::fprintf(stderr, "consumer: %s: %s\n", what, status.ToString().c_str());
  return 1;
}

int Fail(const char* what) {
  std::fprintf(stderr, "consumer: %s\n", what);
  return 1;
}

}  // namespace

int main() {
  constexpr size_t kBytes = 1 << 20;
  const absl::Duration kTimeout = absl::Seconds(30);
  const std::string kPayload = "consumer: 1 MiB written";

  // The buffers outlive the engines that register them.
  std::vector<std::byte> source(kBytes);
  std::vector<std::byte> target(kBytes);
  for (size_t i = 0; i < kBytes; ++i) source[i] = static_cast<std::byte>((i * 131 + 7) & 0xff);

  auto sender = kvwire::Engine::Create(kvwire::EngineOptions());
  if (!sender.ok()) return Fail("create sender engine", sender.status());
  auto receiver = kvwire::Engine::Create(kvwire::EngineOptions());
  if (!receiver.ok()) return Fail("create receiver engine", receiver.status());

  kvwire::RegionOptions exported;
  exported.export_to_all_peers = true;
  auto source_region = (*sender)->RegisterMemory(source.data(), source.size(), exported);
  if (!source_region.ok()) return Fail("register source", source_region.status());
  auto target_region = (*receiver)->RegisterMemory(target.data(), target.size(), exported);
  if (!target_region.ok()) return Fail("register target", target_region.status());

  auto peer = (*sender)->Connect((*receiver)->address());
  if (!peer.ok()) return Fail("connect", peer.status());
  absl::Status status = (*sender)->WaitForRemoteRegion(*peer, *target_region, kTimeout);
  if (!status.ok()) return Fail("wait for the remote region", status);

  kvwire::Op op;
  op.local_region = *source_region;
  op.remote_region = *target_region;
  op.length = kBytes;
  kvwire::TransferOptions options;
  options.notification = kPayload;
  auto transfer =
      (*sender)->Transfer(*peer, kvwire::OpKind::kWrite, absl::MakeConstSpan(&op, 1), options);
  if (!transfer.ok()) return Fail("submit the write", transfer.status());
  status = (*sender)->Wait(*transfer, kTimeout);
  if (!status.ok()) return Fail("write", status);

  auto note = (*receiver)->WaitNotification(kTimeout);
  if (!note.ok()) return Fail("wait for the notification", note.status());
  if (note->payload != kPayload) return Fail("notification payload differs");
  if (note->transfer_id != *transfer) return Fail("notification names another transfer");
  if (std::memcmp(source.data(), target.data(), kBytes) != 0) {
    return Fail("bytes at the target differ from the source");
  }

  std::printf("consumer ok\n");
  return 0;
}
