// Prefill: the rows of a request's blocks that the request did not fill are zeroed, once per
// request, before a peer gets any of its pages whole:
// - read mode: before the first grant of a held request, so that a reader of the request (who
//   is granted whole pages) finds nothing of an earlier request in them (GrantReadLocked);
// - write mode: before the first WRITE of the request's pages into the decode's blocks (the
//   plan moves whole pages too), so that the decode receives nothing of an earlier request
//   (MaybeSendLayersLocked). Layers may still be being computed then; the rows cleared are
//   past the request's num_tokens (GetNumNewMatchedTokens), which the compute never writes
//   when that is the count it computes (the vLLM plugin passes the prompt), so the clear and
//   the compute never touch the same bytes. An engine that hands off fewer tokens than it
//   computes (the dsv4 example hands off n - 1 of n: the decode recomputes the last) gets the
//   extra tokens' rows cleared as well, before or after they are written: the request's own
//   KV, which the decode recomputes; such an engine must not read those rows after the first
//   WRITE (a later layer's attention racing the clear, a prefix cache keeping the block).
// (The file keeps its first name; it serves both modes.)
//
// A block comes back to the engine's free list with the KV of the request that last used it;
// a new request that ends part way into it leaves that KV in the rest of the page. Which bytes
// those are is the layout's business (UnfilledPageSpans: the rows past the request's last
// complete entry in every section of the page, plus the padding); here they are cleared:
// host memory with memset, GPU memory with copies of a host buffer of zeros on a stream of the
// connector's GPU runtime (the runtime shim has no memset), synchronized before the grant or
// the first WRITE.
//
// Cost: the partly filled block of each group, every layer and component, once per request;
// e.g. DeepSeek-V4-Pro with 8,192 prompt tokens (a multiple of every block size, and its rings
// full) clears nothing; with 8,100 tokens the tails of one page per history group and layer,
// 62 x 16,416 + 30 x 13,496 + 31 x 1,144 + 30 x 3,228 bytes = 1.55 MB, on the read_start
// path (read mode) or at the first WRITE (write mode), under the connector lock
// (host: memset; GPU: one copy per range, then one wait).
#include <algorithm>
#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

#include "src/connector/connector_impl.h"
#include "src/util/log.h"

namespace kvwire {

absl::Status Connector::Impl::ScrubUnfilledLocked(Request& r) {
  // Without read grants every block is readable by every peer anyway (a decode too, in
  // write mode, can READ any of them): nothing to protect.
  if (r.scrubbed || !options_.read_grants) return absl::OkStatus();
  const bool write = r.mode == KvMode::kWrite;
  // The tokens the request filled: read mode, what RequestFinished said (the hold's
  // params.num_tokens); write mode, the prompt the scheduler matched (r.num_tokens, what the
  // write plan moves; the params' num_tokens of a write-mode prefill is the router's, not
  // necessarily what was computed, and clearing by a smaller count would zero rows it sends).
  const uint64_t tokens = write ? r.num_tokens : r.params.num_tokens;
  if (tokens == 0) {
    return absl::FailedPreconditionError(
        write ? "the write-mode request does not say how many tokens its blocks hold "
                "(GetNumNewMatchedTokens with num_tokens 0): its WRITEs need it to clear the "
                "rows the request did not fill"
              : "the hand-off does not say how many tokens its blocks hold (RequestFinished "
                "with num_tokens 0): a read grant needs it to clear the rows the request did "
                "not fill");
  }
  // Absolute ranges to zero, contiguous ones merged.
  std::vector<std::pair<uint64_t, uint64_t>> zero;
  uint64_t longest = 0, bytes = 0;
  for (const CacheGroup& g : layout_.groups) {
    auto blocks = r.blocks.find(g.name);
    if (blocks == r.blocks.end()) continue;
    for (size_t lb = 0; lb < blocks->second.size(); ++lb) {
      const int64_t block = blocks->second[lb];
      if (block < 0) continue;
      if (static_cast<uint64_t>(block) >= g.num_blocks) {
        return absl::InvalidArgumentError(
            absl::StrCat("cache group '", g.name, "': block ", block, " of ", g.num_blocks));
      }
      absl::StatusOr<std::vector<PageSpan>> spans = UnfilledPageSpans(g, lb, tokens);
      if (!spans.ok()) return spans.status();
      if (spans->empty()) continue;
      for (size_t l = 0; l < g.layers.size(); ++l) {
        for (int c = 0; c < g.components; ++c) {
          const uint64_t page = g.BlockAddress(l, static_cast<uint64_t>(block), c);
          for (const PageSpan& s : *spans) {
            if (!zero.empty() && zero.back().first + zero.back().second == page + s.offset) {
              zero.back().second += s.length;
            } else {
              zero.emplace_back(page + s.offset, s.length);
            }
            longest = std::max(longest, zero.back().second);
            bytes += s.length;
          }
        }
      }
    }
  }
  std::vector<uint8_t> zeros;          // source of GPU copies, alive until they synchronized
  std::map<int, gpu::Stream> streams;  // per device
  absl::Status status;
  for (const auto& [addr, length] : zero) {
    const KvMemory* in = nullptr;
    for (const KvMemory& m : local_memory_) {
      const uint64_t base = reinterpret_cast<uint64_t>(m.ptr);
      if (addr >= base && length <= m.length && addr - base <= m.length - length) {
        in = &m;
        break;
      }
    }
    if (in == nullptr) {
      status = absl::InternalError(
          absl::StrCat("[", addr, ", +", length, ") is in no registered KV memory"));
      break;
    }
    if (in->kind != MemoryKind::kGpu) {
      std::memset(reinterpret_cast<void*>(addr), 0, length);
      continue;
    }
    if (zeros.empty()) zeros.assign(longest, 0);
    auto s = streams.find(in->gpu_device);
    if (s == streams.end()) {
      absl::StatusOr<gpu::Stream> created = gpu::Stream::Create(*gpu_runtime_, in->gpu_device);
      if (!created.ok()) {
        status = created.status();
        break;
      }
      s = streams.emplace(in->gpu_device, std::move(*created)).first;
    }
    status = s->second.CopyAsync(reinterpret_cast<void*>(addr), zeros.data(), length);
    if (!status.ok()) break;
  }
  // Every copy queued ends before `zeros` goes, failed or not.
  for (auto& entry : streams) {
    if (absl::Status st = entry.second.Synchronize(); status.ok()) status = st;
  }
  if (!status.ok()) {
    return absl::Status(status.code(),
                        absl::StrCat("clearing the rows the request did not fill before ",
                                     write ? "writing its pages to the decode" : "the read grant",
                                     ": ", status.message()));
  }
  r.scrubbed = true;
  KVW_LOG(kDebug, kLog) << "cleared unfilled rows before handing out whole pages"
                        << Kv("request", r.id) << Kv("mode", write ? "write" : "read")
                        << Kv("bytes", bytes) << Kv("ranges", zero.size());
  return absl::OkStatus();
}

}  // namespace kvwire
