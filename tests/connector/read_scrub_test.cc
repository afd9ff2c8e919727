// Read grants cover whole pages, so the rows of a held request's blocks that the request did
// not fill must hold nothing of another request when its reader is granted them. Here every
// block of the prefill's pool holds a marker (the KV of earlier requests that used and freed
// them), a new request of 70 tokens is computed into some of them (its rows written, the rest
// left as they were, as an engine does), and its legitimate reader — a hand-driven decode —
// READs every granted page whole over the engine (tcp; with shm forced, grant-guarded regions
// go over tcp too): the request's rows are intact, every other byte is zero, the marker is
// nowhere. Host KV memory, and GPU KV memory (the emulated GPU, whose device memory faults on
// CPU access and whose copies are slowed, so an unsynchronized clear reads as a failure).
// Also: a layout whose page placement is unknown, and a hold that does not say its token
// count, get a clear "fail" instead of a grant.
//
// Write mode pushes whole pages the other way: ReadScrubTest.AWriteModeDecode* hands the same
// request off to a real decode connector in write mode (its KV host memory, every byte a
// third value first), the prefill computing it layer by layer while the push is under way:
// the decode's received pages hold the request's rows and zeros elsewhere, and nothing of the
// marker lands anywhere in the decode's memory.
#include <cstring>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unistd.h>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

#include "kvwire/connector.h"
#include "kvwire/deepseek.h"
#include "kvwire/engine.h"
#include "kvwire/layout.h"
#include "kvwire/memory.h"
#include "src/gpu/runtime.h"
#include "tests/support/emulated_gpu.h"

namespace kvwire::testing {
namespace {

using nlohmann::json;

constexpr char kTopic[] = "kvwire.connector";
constexpr uint64_t kTokens = 70;
constexpr uint64_t kBlocks = 4, kStateBlocks = 2;
constexpr uint8_t kOld = 0xA5, kMine = 0x3C, kDecodeInit = 0x77;
constexpr absl::Duration kWait = absl::Seconds(60);

// A DeepSeek-V4-shaped model of three layers: window only, c4a, c128a (every group of V4).
Layout TestLayout() { return DeepSeekV4Layout("scrub-test", {0, 4, 128}); }

// Where each row of a page lies, as DESIGN.md 7 describes DeepSeek-V4's pages (written out
// here, not taken from the code under test): KV pages hold all 576-byte data rows, then all
// 8-byte scale rows; the indexer K 128-byte rows, then 4-byte scales; compressor states are
// token-major ring slots.
std::vector<uint64_t> Sections(const CacheGroup& g) {
  if (g.per_request_state) return {g.page_bytes / g.tokens_per_block};
  if (g.name == "c4a_indexer_k") return {128, 4};
  return {576, 8};
}

// Whether a request of kTokens tokens wrote row `r` of its logical block `lb`: ring slot r
// holds token r; an entry is written once all its tokens are there.
bool Filled(const CacheGroup& g, uint64_t lb, uint64_t r) {
  if (g.per_request_state) return r < kTokens;
  const uint64_t entry = lb * g.entries_per_block() + r;
  return (entry + 1) * static_cast<uint64_t>(g.tokens_per_entry) <= kTokens;
}

// A page of logical block `lb` after the request's compute: its rows kMine (none when
// `lb` is kNoRequest), the other rows `rest`; the padding after the rows (never written by
// anyone) zero.
constexpr uint64_t kNoRequest = ~uint64_t{0};
std::vector<uint8_t> Page(const CacheGroup& g, uint64_t lb, uint8_t rest) {
  std::vector<uint8_t> page(g.page_bytes, 0);
  const uint64_t rows =
      g.per_request_state ? static_cast<uint64_t>(g.tokens_per_block) : g.entries_per_block();
  uint64_t at = 0;
  for (uint64_t row : Sections(g)) {
    for (uint64_t r = 0; r < rows; ++r) {
      const bool mine = lb != kNoRequest && Filled(g, lb, r);
      std::memset(page.data() + at + r * row, mine ? kMine : rest, row);
    }
    at += rows * row;
  }
  return page;
}

// The request's blocks: logical block i of a history group is block kBlocks - 1 - i; the
// state rings use block 1.
BlockTable Blocks(const Layout& l) {
  BlockTable t;
  for (const CacheGroup& g : l.groups) {
    if (g.per_request_state) {
      t[g.name] = {1};
      continue;
    }
    const uint64_t n = (kTokens + g.tokens_per_block - 1) / g.tokens_per_block;
    for (uint64_t i = 0; i < n; ++i) t[g.name].push_back(static_cast<int64_t>(kBlocks - 1 - i));
  }
  return t;
}

struct Param {
  std::string transport;
  bool gpu = false;
};

class ReadScrubTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    if (GetParam().gpu) {
      // Device memory faults on CPU access; copies are slowed (a clear that is not waited for
      // before the grant is read as the marker).
      gpu_.emplace(EmulatedGpuOptions{.copy_delay = absl::Milliseconds(20)});
      gpu::SetDefaultRuntime(&gpu_->runtime());
    }
  }
  void TearDown() override {
    decode_.reset();
    inbox_.reset();
    reader_.reset();
    connector_.reset();
    device_ = gpu::DeviceBuffer();
    host_.reset();
    if (gpu_) gpu::SetDefaultRuntime(nullptr);
  }

  // The prefill: `layout` backed by host or device memory in which every byte is kOld (every
  // block was used and freed by earlier requests), then the request's rows written (unless
  // not `computed`: ComputeLayer writes them later).
  void StartPrefill(Layout layout, bool computed = true) {
    layout_ = std::move(layout);
    bytes_ = AssignBacking(&layout_, 0, kBlocks, kStateBlocks);
    void* base = nullptr;
    if (gpu_) {
      auto d = gpu::DeviceBuffer::Allocate(gpu_->runtime(), 0, bytes_);
      ASSERT_TRUE(d.ok()) << d.status();
      device_ = std::move(*d);
      base = device_.data();
    } else {
      auto h = ShareableBuffer::Create(bytes_, "scrub-test");
      ASSERT_TRUE(h.ok()) << h.status();
      host_.emplace(std::move(*h));
      base = host_->data();
    }
    base_ = reinterpret_cast<uint64_t>(base);
    AssignBacking(&layout_, base_, kBlocks, kStateBlocks);
    blocks_ = Blocks(layout_);
    // Every row of every page holds an earlier request's KV (the padding after the rows is
    // zero, as the allocation left it: no request writes there).
    std::vector<uint8_t> image(bytes_, 0);
    for (const CacheGroup& g : layout_.groups) {
      const std::vector<uint8_t> old = Page(g, kNoRequest, kOld);
      for (size_t l = 0; l < g.layers.size(); ++l) {
        for (int c = 0; c < g.components; ++c) {
          for (uint64_t b = 0; b < g.num_blocks; ++b) {
            std::memcpy(image.data() + (g.BlockAddress(l, b, c) - base_), old.data(), old.size());
          }
        }
      }
    }
    for (const CacheGroup& g : layout_.groups) {
      const std::vector<int64_t>& ids = blocks_.at(g.name);
      for (size_t lb = 0; computed && lb < ids.size(); ++lb) {
        const std::vector<uint8_t> page = Page(g, lb, kOld);
        for (size_t l = 0; l < g.layers.size(); ++l) {
          for (int c = 0; c < g.components; ++c) {
            std::memcpy(image.data() + (g.BlockAddress(l, ids[lb], c) - base_), page.data(),
                        page.size());
          }
        }
      }
    }
    if (gpu_) {
      ASSERT_TRUE(gpu_->WriteDevice(base, image.data(), bytes_).ok());
    } else {
      std::memcpy(base, image.data(), bytes_);
    }
    ConnectorOptions o;
    o.role = "prefill";
    o.engine.name = absl::StrCat("scrub-prefill-", getpid());
    o.engine.transport = GetParam().transport;
    o.engine.peer_lease = absl::Seconds(3);
    o.engine.heartbeat_interval = absl::Milliseconds(200);
    o.request_timeout = kWait;
    o.handshake_timeout = absl::Seconds(20);
    auto c = Connector::Create(o);
    ASSERT_TRUE(c.ok()) << c.status();
    connector_ = std::move(*c);
    KvMemory m{base, bytes_};
    if (gpu_) {
      m.kind = MemoryKind::kGpu;
      m.gpu_device = 0;
    }
    absl::Status s = connector_->RegisterKvCaches(layout_, {m});
    ASSERT_TRUE(s.ok()) << s;
  }

  // Holds the request for a reader: its transfer id.
  std::string Hold(uint64_t tokens) {
    auto done = connector_->RequestFinished("b", blocks_, tokens, R"({"do_remote_decode":true})");
    EXPECT_TRUE(done.ok()) << done.status();
    if (!done.ok()) return "";
    auto params = KvTransferParams::FromJson(done->kv_transfer_params);
    EXPECT_TRUE(params.ok()) << params.status();
    return params.ok() ? params->transfer_id : "";
  }

  // The reader: an engine with a host buffer as large as the prefill's KV, the connector
  // handshake done by hand.
  void StartReader() {
    EngineOptions o;
    o.name = absl::StrCat("scrub-reader-", getpid());
    o.transport = GetParam().transport;
    o.peer_lease = absl::Seconds(3);
    o.heartbeat_interval = absl::Milliseconds(200);
    auto e = Engine::Create(o);
    ASSERT_TRUE(e.ok()) << e.status();
    reader_ = std::move(*e);
    auto inbox = reader_->OpenInbox(kTopic);
    ASSERT_TRUE(inbox.ok()) << inbox.status();
    inbox_ = std::move(*inbox);
    auto buf = ShareableBuffer::Create(bytes_, "scrub-reader");
    ASSERT_TRUE(buf.ok()) << buf.status();
    into_.emplace(std::move(*buf));
    RegionOptions ro;
    ro.export_to_all_peers = true;
    auto region = reader_->RegisterMemory(into_->data(), bytes_, ro);
    ASSERT_TRUE(region.ok()) << region.status();
    into_region_ = *region;
    auto peer = reader_->Connect(connector_->engine().address());
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
    Layout mine = TestLayout();
    AssignBacking(&mine, reinterpret_cast<uint64_t>(into_->data()), kBlocks, kStateBlocks);
    json hello = {{"t", "hello"},
                  {"engine_id", o.name},
                  {"mode", "auto"},
                  {"layout", json::parse(LayoutToJson(mine))},
                  {"regions", json::array({json::array({reinterpret_cast<uint64_t>(into_->data()),
                                                        bytes_, into_region_})})}};
    ASSERT_TRUE(reader_->SendMessage(peer_, kTopic, hello.dump()).ok());
    auto ack = Next("hello_ack");
    ASSERT_TRUE(ack.ok()) << ack.status();
    for (const json& r : (*ack)["regions"]) {
      remote_.push_back({r[0].get<uint64_t>(), r[1].get<uint64_t>(), r[2].get<uint64_t>()});
      ASSERT_TRUE(reader_->WaitForRemoteRegion(peer_, remote_.back().id, kWait).ok());
    }
  }

  // The next connector message for `tid` (read_ok or fail), or of type `type` when tid is "".
  absl::StatusOr<json> Next(const std::string& type, const std::string& tid = "") {
    const absl::Time deadline = absl::Now() + kWait;
    while (absl::Now() < deadline) {
      for (InboxEvent& e : inbox_->Wait(absl::Milliseconds(20))) {
        if (e.kind == InboxEvent::Kind::kPeerClosed) {
          return absl::AbortedError(absl::StrCat("the prefill closed the reader: ", e.payload));
        }
        if (e.kind != InboxEvent::Kind::kMessage) continue;
        json m = json::parse(e.payload, nullptr, false);
        if (!m.is_object()) continue;
        if (tid.empty() ? m.value("t", "") == type : m.value("transfer_id", "") == tid) return m;
      }
    }
    return absl::DeadlineExceededError(absl::StrCat("no '", type, "' message"));
  }

  // read_start: the grant, or FailedPrecondition with the reason of the prefill's "fail".
  absl::StatusOr<GrantId> ReadStart(const std::string& tid) {
    json start = {{"t", "read_start"}, {"transfer_id", tid}};
    if (absl::Status s = reader_->SendMessage(peer_, kTopic, start.dump()); !s.ok()) return s;
    absl::StatusOr<json> m = Next("read_ok", tid);
    if (!m.ok()) return m.status();
    if (m->value("t", "") != "read_ok") {
      return absl::FailedPreconditionError(m->value("reason", "?"));
    }
    return (*m)["grant"].get<GrantId>();
  }

  // READs every granted page whole, into the reader's buffer at the prefill's offsets.
  absl::Status ReadAllPages(GrantId grant) {
    for (const CacheGroup& g : layout_.groups) {
      std::vector<Op> ops;
      for (int64_t block : blocks_.at(g.name)) {
        for (size_t l = 0; l < g.layers.size(); ++l) {
          for (int c = 0; c < g.components; ++c) {
            const uint64_t addr = g.BlockAddress(l, block, c);
            const Span* r = nullptr;
            for (const Span& s : remote_) {
              if (addr >= s.base && addr + g.page_bytes <= s.base + s.length) r = &s;
            }
            if (r == nullptr) return absl::InternalError("a page outside the prefill's regions");
            ops.push_back({into_region_, addr - base_, r->id, addr - r->base, g.page_bytes});
          }
        }
      }
      TransferOptions to;
      to.grant = grant;
      auto id = reader_->Transfer(peer_, OpKind::kRead, ops, to);
      if (!id.ok()) return id.status();
      if (absl::Status s = reader_->Wait(*id, kWait); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // "" when every page read holds the request's rows and zeros elsewhere.
  std::string CheckPages() {
    const auto* got = reinterpret_cast<const uint8_t*>(into_->data());
    for (const CacheGroup& g : layout_.groups) {
      const std::vector<int64_t>& ids = blocks_.at(g.name);
      for (size_t lb = 0; lb < ids.size(); ++lb) {
        const std::vector<uint8_t> want = Page(g, lb, 0);
        for (size_t l = 0; l < g.layers.size(); ++l) {
          const uint8_t* p = got + (g.BlockAddress(l, ids[lb], 0) - base_);
          for (uint64_t i = 0; i < g.page_bytes; ++i) {
            if (p[i] == want[i]) continue;
            return absl::StrCat("group ", g.name, " layer ", g.layers[l], " logical block ", lb,
                                " byte ", i, ": got ", p[i], " want ", want[i],
                                p[i] == kOld ? " (another request's KV)" : "");
          }
        }
      }
    }
    return "";
  }

  void Release(const std::string& tid) {
    json release = {{"t", "release"}, {"transfer_id", tid}, {"ok", true}, {"reason", ""}};
    ASSERT_TRUE(reader_->SendMessage(peer_, kTopic, release.dump()).ok());
    const absl::Time deadline = absl::Now() + kWait;
    while (connector_->LiveRequests() != 0 && absl::Now() < deadline) {
      (void)connector_->GetFinished();
      absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_EQ(connector_->LiveRequests(), 0u) << "the prefill never let go of the request";
  }

  // The engine's compute of model layer `layer`: the request's rows of it, and nothing else
  // (each section's filled rows are its first ones: one write per section of a page).
  void ComputeLayer(int layer) {
    for (const CacheGroup& g : layout_.groups) {
      const uint64_t rows =
          g.per_request_state ? static_cast<uint64_t>(g.tokens_per_block) : g.entries_per_block();
      const std::vector<int64_t>& ids = blocks_.at(g.name);
      for (size_t l = 0; l < g.layers.size(); ++l) {
        if (g.layers[l] != layer) continue;
        for (size_t lb = 0; lb < ids.size(); ++lb) {
          uint64_t filled = 0;
          while (filled < rows && Filled(g, lb, filled)) ++filled;
          for (int c = 0; c < g.components; ++c) {
            uint64_t at = g.BlockAddress(l, ids[lb], c);
            for (uint64_t row : Sections(g)) {
              const std::vector<uint8_t> mine(filled * row, kMine);
              if (!mine.empty()) {
                if (gpu_) {
                  ASSERT_TRUE(
                      gpu_->WriteDevice(reinterpret_cast<void*>(at), mine.data(), mine.size())
                          .ok());
                } else {
                  std::memcpy(reinterpret_cast<void*>(at), mine.data(), mine.size());
                }
              }
              at += rows * row;
            }
          }
        }
      }
    }
  }

  // A decode connector in write mode, its KV in host memory (the prefill's layout and blocks,
  // its own memory), every byte kDecodeInit.
  void StartDecode() {
    auto buf = ShareableBuffer::Create(bytes_, "scrub-decode");
    ASSERT_TRUE(buf.ok()) << buf.status();
    decode_kv_.emplace(std::move(*buf));
    std::memset(decode_kv_->data(), kDecodeInit, bytes_);
    decode_layout_ = layout_;
    AssignBacking(&decode_layout_, reinterpret_cast<uint64_t>(decode_kv_->data()), kBlocks,
                  kStateBlocks);
    ConnectorOptions o;
    o.role = "decode";
    o.mode = KvMode::kWrite;
    o.engine.name = absl::StrCat("scrub-decode-", getpid());
    o.engine.transport = GetParam().transport;
    o.engine.peer_lease = absl::Seconds(3);
    o.engine.heartbeat_interval = absl::Milliseconds(200);
    o.request_timeout = kWait;
    o.handshake_timeout = absl::Seconds(20);
    auto c = Connector::Create(o);
    ASSERT_TRUE(c.ok()) << c.status();
    decode_ = std::move(*c);
    absl::Status s =
        decode_->RegisterKvCaches(decode_layout_, {KvMemory{decode_kv_->data(), bytes_}});
    ASSERT_TRUE(s.ok()) << s;
  }

  // A write-mode hand-off of kTokens tokens, the prefill's compute layer by layer (each layer
  // saved as it is done) after both sides scheduled the request: "" when the decode loaded it,
  // else the decode's reason.
  std::string WriteHandOff() {
    const std::string tid = absl::StrCat("scrub-write-", getpid());
    KvTransferParams in;
    in.do_remote_decode = true;
    in.mode = KvMode::kWrite;
    in.transfer_id = tid;
    const std::string prefill_params = in.ToJson();
    if (auto m = connector_->GetNumNewMatchedTokens("p", kTokens, 0, prefill_params); !m.ok()) {
      return absl::StrCat("prefill match: ", m.status().message());
    }
    if (absl::Status s = connector_->UpdateStateAfterAlloc("p", blocks_, 0); !s.ok()) {
      return absl::StrCat("prefill alloc: ", s.message());
    }
    if (absl::Status s = connector_->BindConnectorMeta(connector_->BuildConnectorMeta()); !s.ok()) {
      return absl::StrCat("prefill bind: ", s.message());
    }
    KvTransferParams out;
    const std::string address = connector_->engine().address();
    const size_t colon = address.rfind(':');
    out.host = address.substr(0, colon);
    out.port = std::stoi(address.substr(colon + 1));
    out.transfer_id = tid;
    out.mode = KvMode::kWrite;
    out.num_tokens = kTokens;
    out.do_remote_prefill = true;
    auto match = decode_->GetNumNewMatchedTokens("d", kTokens, 0, out.ToJson());
    if (!match.ok()) return absl::StrCat("decode match: ", match.status().message());
    if (absl::Status s = decode_->UpdateStateAfterAlloc("d", blocks_, match->num_external_tokens);
        !s.ok()) {
      return absl::StrCat("decode alloc: ", s.message());
    }
    if (absl::Status s = decode_->BindConnectorMeta(decode_->BuildConnectorMeta()); !s.ok()) {
      return absl::StrCat("decode bind: ", s.message());
    }
    if (absl::Status s = decode_->StartLoadKv(); !s.ok()) {
      return absl::StrCat("decode start: ", s.message());
    }
    std::set<int> layers;
    for (const CacheGroup& g : layout_.groups) layers.insert(g.layers.begin(), g.layers.end());
    for (int layer : layers) {
      ComputeLayer(layer);
      if (::testing::Test::HasFatalFailure()) return "compute failed";
      if (absl::Status s = connector_->SaveKvLayer(layer); !s.ok()) {
        return absl::StrCat("save layer ", layer, ": ", s.message());
      }
    }
    auto done = connector_->RequestFinished("p", blocks_, kTokens, prefill_params);
    if (!done.ok()) return absl::StrCat("prefill finished: ", done.status().message());
    std::optional<std::string> result;
    bool sent = !done->delay_free;
    const absl::Time deadline = absl::Now() + kWait;
    while ((!result || !sent) && absl::Now() < deadline) {
      FinishedRequests d = decode_->GetFinished();
      for (const std::string& r : d.finished_recving) {
        if (r == "d") result = "";
      }
      for (const FailedLoad& f : d.failed_loads) {
        if (f.request_id == "d") result = f.reason;
      }
      for (const std::string& r : connector_->GetFinished().finished_sending) {
        if (r == "p") sent = true;
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    if (!result) return "the decode never finished loading";
    EXPECT_TRUE(sent) << "the prefill never let go of the request";
    return *result;
  }

  // "" when every page the decode received (the history blocks the request moves: the
  // selection of its tokens) holds the request's rows and zeros elsewhere, and no byte of the
  // decode's memory holds the marker.
  std::string CheckDecode() {
    for (const CacheGroup& g : decode_layout_.groups) {
      if (g.per_request_state) continue;  // ring slots of the request's tokens only
      const std::vector<int64_t>& ids = blocks_.at(g.name);
      for (uint64_t lb : SelectBlocks(g, kTokens, 0).logical_blocks) {
        const std::vector<uint8_t> want = Page(g, lb, 0);
        for (size_t l = 0; l < g.layers.size(); ++l) {
          for (int c = 0; c < g.components; ++c) {
            const auto* p = reinterpret_cast<const uint8_t*>(g.BlockAddress(l, ids[lb], c));
            for (uint64_t i = 0; i < g.page_bytes; ++i) {
              if (p[i] == want[i]) continue;
              return absl::StrCat("group ", g.name, " layer ", g.layers[l], " logical block ", lb,
                                  " byte ", i, ": got ", p[i], " want ", want[i],
                                  p[i] == kOld ? " (another request's KV)" : "");
            }
          }
        }
      }
    }
    const auto* all = reinterpret_cast<const uint8_t*>(decode_kv_->data());
    for (uint64_t i = 0; i < bytes_; ++i) {
      if (all[i] == kOld) return absl::StrCat("decode KV byte ", i, " holds the marker");
    }
    return "";
  }

  struct Span {
    uint64_t base, length;
    RegionId id;
  };
  std::optional<EmulatedGpu> gpu_;
  std::optional<ShareableBuffer> host_;
  gpu::DeviceBuffer device_;
  Layout layout_;
  uint64_t bytes_ = 0, base_ = 0;
  BlockTable blocks_;
  std::unique_ptr<Connector> connector_;
  std::unique_ptr<Engine> reader_;
  std::unique_ptr<Inbox> inbox_;
  std::optional<ShareableBuffer> into_;
  RegionId into_region_ = 0;
  PeerId peer_ = 0;
  std::vector<Span> remote_;
  std::optional<ShareableBuffer> decode_kv_;
  Layout decode_layout_;
  std::unique_ptr<Connector> decode_;
};

TEST_P(ReadScrubTest, AReaderFindsNothingOfAnEarlierRequestInItsGrantedPages) {
  ASSERT_NO_FATAL_FAILURE(StartPrefill(TestLayout()));
  const std::string tid = Hold(kTokens);
  ASSERT_FALSE(tid.empty());
  ASSERT_NO_FATAL_FAILURE(StartReader());
  absl::StatusOr<GrantId> grant = ReadStart(tid);
  ASSERT_TRUE(grant.ok()) << grant.status();
  absl::Status read = ReadAllPages(*grant);
  ASSERT_TRUE(read.ok()) << read;
  EXPECT_EQ(CheckPages(), "");
  Release(tid);
}

// No placement for a group whose request ends part way into a block: no grant, a reason that
// names the group and the field, and the reader stays connected.
TEST_P(ReadScrubTest, UnknownPlacementIsRefusedNotGuessed) {
  Layout l = TestLayout();
  for (CacheGroup& g : l.groups) {
    if (g.name == "swa_kv") g.section_row_bytes.clear();
  }
  ASSERT_NO_FATAL_FAILURE(StartPrefill(l));
  const std::string tid = Hold(kTokens);
  ASSERT_FALSE(tid.empty());
  ASSERT_NO_FATAL_FAILURE(StartReader());
  absl::StatusOr<GrantId> grant = ReadStart(tid);
  ASSERT_FALSE(grant.ok());
  EXPECT_TRUE(absl::StrContains(grant.status().message(), "'swa_kv'")) << grant.status();
  EXPECT_TRUE(absl::StrContains(grant.status().message(), "section_row_bytes")) << grant.status();
  absl::SleepFor(absl::Milliseconds(200));  // a close would have come with the "fail"
  bool alive = false;
  for (const PeerInfo& p : reader_->Peers()) alive = alive || (p.id == peer_ && p.alive);
  EXPECT_TRUE(alive) << "the refusal closed the reader";
}

TEST_P(ReadScrubTest, AHoldWithoutItsTokenCountIsRefused) {
  ASSERT_NO_FATAL_FAILURE(StartPrefill(TestLayout()));
  const std::string tid = Hold(0);
  ASSERT_FALSE(tid.empty());
  ASSERT_NO_FATAL_FAILURE(StartReader());
  absl::StatusOr<GrantId> grant = ReadStart(tid);
  ASSERT_FALSE(grant.ok());
  EXPECT_TRUE(absl::StrContains(grant.status().message(), "num_tokens 0")) << grant.status();
}

// Write mode: the prefill WRITEs whole pages into the decode's blocks; the rows the request
// did not fill arrive zeroed, not as an earlier request's KV.
TEST_P(ReadScrubTest, AWriteModeDecodeReceivesNothingOfAnEarlierRequest) {
  ASSERT_NO_FATAL_FAILURE(StartPrefill(TestLayout(), /*computed=*/false));
  ASSERT_NO_FATAL_FAILURE(StartDecode());
  EXPECT_EQ(WriteHandOff(), "");
  EXPECT_EQ(CheckDecode(), "");
  EXPECT_EQ(decode_->LiveRequests(), 0u);
  EXPECT_EQ(connector_->LiveRequests(), 0u);
}

// Write mode, placement unknown for a group whose request ends part way into a block: the
// hand-off fails with a reason naming the group and the field; nothing of the group's last
// page was pushed.
TEST_P(ReadScrubTest, AWriteModeDecodeOfAnUnknownPlacementFailsClearly) {
  Layout l = TestLayout();
  for (CacheGroup& g : l.groups) {
    if (g.name == "swa_kv") g.section_row_bytes.clear();
  }
  ASSERT_NO_FATAL_FAILURE(StartPrefill(l, /*computed=*/false));
  ASSERT_NO_FATAL_FAILURE(StartDecode());
  const std::string reason = WriteHandOff();
  EXPECT_TRUE(absl::StrContains(reason, "'swa_kv'")) << reason;
  EXPECT_TRUE(absl::StrContains(reason, "section_row_bytes")) << reason;
  const auto* all = reinterpret_cast<const uint8_t*>(decode_kv_->data());
  for (uint64_t i = 0; i < bytes_; ++i) {
    ASSERT_NE(all[i], kOld) << "decode KV byte " << i << " holds the marker";
  }
}

INSTANTIATE_TEST_SUITE_P(All, ReadScrubTest,
                         ::testing::Values(Param{"tcp", false}, Param{"shm", false},
                                           Param{"tcp", true}, Param{"shm", true}),
                         [](const ::testing::TestParamInfo<Param>& p) {
                           return absl::StrCat(p.param.transport, p.param.gpu ? "_gpu" : "_host");
                         });

}  // namespace
}  // namespace kvwire::testing
