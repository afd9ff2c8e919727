// The reference engine's KV cache on a GPU (examples/dsv4/model/gpu) against its CPU path.
//
// Every check asserts bit equality (memcmp), not a tolerance: the kernels' shared math
// (gpu/attention_math.h) repeats the CPU path's multiplies and adds in the CPU's order without
// fused multiply-adds, the softmax between the two kernels is the CPU's own code, and the
// record encode is integer arithmetic (src/gpu/kv_record.h). Any difference is a bug.
//
//  - HostKernels*: the kernels' code run by their host drivers (runs everywhere), for the
//    attention alone over contexts of 1 to 600 keys, and for the whole model decoding at
//    contexts of 1, 127, 128, 129, 300 and 600 tokens (SWA window edges, c4a and c128a
//    entries) after chunked prefills.
//  - Device*: the real kernels on device 0 for the same checks, and a whole Generate with the
//    cache in GPU memory; they skip, printing the runtime's one-line reason, without a device.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <unistd.h>
#include <vector>

#include "gtest/gtest.h"

#include "examples/dsv4/model/config.h"
#include "examples/dsv4/model/fp8.h"
#include "examples/dsv4/model/generate.h"
#include "examples/dsv4/model/gpu/kv_executor.h"
#include "examples/dsv4/model/gpu/kv_ops.h"
#include "examples/dsv4/model/kv_cache.h"
#include "examples/dsv4/model/model.h"
#include "examples/dsv4/model/ops.h"
#include "kvwire/deepseek.h"
#include "src/gpu/runtime.h"
#include "tests/dsv4/model/tiny_model.h"

namespace dsv4 {
namespace {

constexpr int kD = kKvDim;

// Empty when device 0 exists; else the runtime's one-line reason, printed for the log.
std::string NoDevice() {
  absl::StatusOr<int> n = kvwire::gpu::DefaultRuntime().DeviceCount();
  std::string why;
  if (!n.ok()) {
    why = std::string(n.status().message());
  } else if (*n < 1) {
    why = "kvwire gpu: no device";
  }
  if (!why.empty()) std::printf("%s\n", why.c_str());
  return why;
}
#define SKIP_WITHOUT_DEVICE()                             \
  if (const std::string why = NoDevice(); !why.empty()) { \
    GTEST_SKIP() << why;                                  \
  }

// --- attention alone -------------------------------------------------------------------------

// A host cache of 64-entry pages (SWA / c4a) and 2-entry pages (c128a), random records.
struct HostPages {
  static constexpr int kBig = 10, kSmall = 8;
  std::vector<uint8_t> bytes;
  uint64_t big_page = 0, small_page = 0;

  explicit HostPages(uint32_t seed) {
    big_page = kvwire::Dsv4PageBytes(64);
    small_page = kvwire::Dsv4PageBytes(2);
    bytes.assign(kBig * big_page + kSmall * small_page, 0);
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> lg(-6.0f, 6.0f);
    std::vector<float> v(kD);
    for (int p = 0; p < kBig + kSmall; ++p) {
      const int entries = p < kBig ? 64 : 2;
      for (int e = 0; e < entries; ++e) {
        for (int d = 0; d < kD; d += 64) {
          const float mag = std::exp2(lg(rng));  // every tile its own scale
          for (int j = 0; j < 64; ++j) v[d + j] = normal(rng) * mag;
        }
        EncodeKvRecord(v.data(), Page(p), entries, e);
      }
    }
  }
  uint64_t Offset(int p) const {
    return p < kBig ? p * big_page : kBig * big_page + (p - kBig) * small_page;
  }
  uint8_t* Page(int p) { return bytes.data() + Offset(p); }
  int records() const { return kBig * 64 + kSmall * 2; }
  // Record r: the first kBig * 64 in the big pages, then the small pages'.
  gpu::KeyRef Ref(int r) const {
    if (r < kBig * 64) return {Offset(r / 64), 64, static_cast<uint32_t>(r % 64)};
    r -= kBig * 64;
    return {Offset(kBig + r / 2), 2, static_cast<uint32_t>(r % 2)};
  }
};

// Queries with contexts of `sizes` keys each (random records, repeats allowed, small pages
// mixed in), their heads' queries and sinks.
struct AttentionCase {
  static constexpr uint32_t kHeads = 3;
  std::vector<std::vector<gpu::KeyRef>> keys;
  std::vector<float> q, sinks;

  AttentionCase(const HostPages& pages, const std::vector<int>& sizes, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> pick(0, pages.records() - 1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int n : sizes) {
      keys.emplace_back();
      for (int i = 0; i < n; ++i) keys.back().push_back(pages.Ref(pick(rng)));
    }
    // Queries about unit RMS, as the model's (RmsNorm'd): logits spread over a few units.
    q.resize(sizes.size() * kHeads * kD);
    for (float& x : q) x = normal(rng);
    for (uint32_t h = 0; h < kHeads; ++h) sinks.push_back(normal(rng));
  }

  // The CPU path: decode every key, AttendWithSink per (query, head).
  std::vector<float> Cpu(const HostPages& pages, float scale) const {
    std::vector<float> out(q.size());
    for (size_t t = 0; t < keys.size(); ++t) {
      std::vector<float> decoded(keys[t].size() * kD);
      std::vector<const float*> ptrs;
      for (size_t k = 0; k < keys[t].size(); ++k) {
        const gpu::KeyRef& r = keys[t][k];
        DecodeKvRecord(pages.bytes.data() + r.page_offset, r.entries, r.index, &decoded[k * kD]);
        ptrs.push_back(&decoded[k * kD]);
      }
      for (uint32_t h = 0; h < kHeads; ++h) {
        AttendWithSink(&q[(t * kHeads + h) * kD], ptrs.data(), static_cast<int>(ptrs.size()), kD,
                       scale, sinks[h], &out[(t * kHeads + h) * kD]);
      }
    }
    return out;
  }
};

const std::vector<int> kContexts = {1, 127, 128, 129, 300, 600};
const float kScale = 1.0f / std::sqrt(512.0f);

// Runs the case's attention on `executor`, the pages copied into its memory.
std::vector<float> RunAttention(gpu::KvExecutor& executor, const HostPages& pages,
                                const AttentionCase& c) {
  absl::StatusOr<std::unique_ptr<gpu::KvExecutor::Buffer>> cache =
      executor.Allocate(pages.bytes.size());
  EXPECT_TRUE(cache.ok()) << cache.status();
  if (!cache.ok()) return {};
  EXPECT_TRUE(executor.Upload((*cache)->data(), pages.bytes.data(), pages.bytes.size()).ok());
  std::vector<float> out(c.q.size(), -1.0f);
  absl::Status s = gpu::Attend(executor, static_cast<const uint8_t*>((*cache)->data()), c.q.data(),
                               AttentionCase::kHeads, c.keys, kScale, c.sinks.data(), out.data());
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

void ExpectBitEqual(const std::vector<float>& got, const std::vector<float>& want,
                    const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(float)), 0)
        << what << ": element " << i << " is " << got[i] << ", the CPU's " << want[i];
  }
}

void CheckAttention(gpu::KvExecutor& executor) {
  const HostPages pages(1);
  // One query per context size (one kernel launch), then each size as a decode of its own.
  const AttentionCase all(pages, kContexts, 2);
  ExpectBitEqual(RunAttention(executor, pages, all), all.Cpu(pages, kScale), "all contexts");
  for (int n : kContexts) {
    const AttentionCase one(pages, {n}, 100 + n);
    ExpectBitEqual(RunAttention(executor, pages, one), one.Cpu(pages, kScale),
                   "context " + std::to_string(n));
  }
}

// The KV-cache write through `executor` equals dsv4::EncodeKvRecord byte for byte, and leaves
// unmapped slots alone.
void CheckEncode(gpu::KvExecutor& executor) {
  const uint32_t entries = 64, blocks = 4, n = 150;
  const uint64_t page = kvwire::Dsv4PageBytes(entries);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> src(n * kD);
  for (float& x : src) x = normal(rng);
  std::vector<int64_t> slots(n);
  for (uint32_t i = 0; i < n; ++i) slots[i] = (i * 53 + 7) % (entries * blocks);
  slots[3] = -1;
  std::vector<uint8_t> want(page * blocks, 0x5a);
  for (uint32_t i = 0; i < n; ++i) {
    if (slots[i] >= 0) {
      EncodeKvRecord(&src[i * kD], want.data() + slots[i] / entries * page, entries,
                     static_cast<int>(slots[i] % entries));
    }
  }
  absl::StatusOr<std::unique_ptr<gpu::KvExecutor::Buffer>> cache = executor.Allocate(want.size());
  ASSERT_TRUE(cache.ok()) << cache.status();
  const std::vector<uint8_t> fill(want.size(), 0x5a);
  ASSERT_TRUE(executor.Upload((*cache)->data(), fill.data(), fill.size()).ok());
  absl::Status s = gpu::EncodeRecords(executor, static_cast<uint8_t*>((*cache)->data()), page,
                                      entries, blocks, src.data(), slots);
  ASSERT_TRUE(s.ok()) << s;
  std::vector<uint8_t> got(want.size());
  ASSERT_TRUE(executor.Download(got.data(), (*cache)->data(), got.size()).ok());
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << "byte " << i;
}

TEST(HostKernels, AttentionMatchesCpuBitForBit) { CheckAttention(*gpu::MakeHostExecutor()); }

TEST(HostKernels, RecordEncodeMatchesCpuByteForByte) { CheckEncode(*gpu::MakeHostExecutor()); }

TEST(HostKernels, AttentionOfNoKeysIsTheSinkOnly) {
  // A query with no keys (cannot happen in the model: its own token is always a key) gives 0,
  // as AttendWithSink's empty sum does.
  const HostPages pages(3);
  AttentionCase c(pages, {0, 5}, 4);
  ExpectBitEqual(RunAttention(*gpu::MakeHostExecutor(), pages, c), c.Cpu(pages, kScale),
                 "empty context");
}

// --- the whole model --------------------------------------------------------------------------

// One request through a model with its own cache of `device`; same block ids for every device
// (same allocation seed).
class Engine {
 public:
  Engine(Model& model, KvDevice device, int max_tokens) : model_(model) {
    KvCacheOptions o;
    o.device = device;
    absl::StatusOr<std::unique_ptr<KvCache>> cache =
        KvCache::Create(model.config(), max_tokens / 64 + 2, 1, 3, o);
    EXPECT_TRUE(cache.ok()) << cache.status();
    if (!cache.ok()) return;
    cache_ = std::move(*cache);
    absl::StatusOr<kvwire::BlockTable> table = cache_->Allocate(max_tokens);
    EXPECT_TRUE(table.ok()) << table.status();
    if (table.ok()) table_ = std::move(*table);
  }
  bool ok() const { return cache_ != nullptr && !table_.empty(); }
  KvCache& cache() { return *cache_; }

  std::vector<float> Forward(std::span<const int32_t> tokens, uint64_t pos) {
    absl::StatusOr<std::vector<float>> logits = model_.Forward(*cache_, table_, tokens, pos);
    EXPECT_TRUE(logits.ok()) << logits.status();
    return logits.ok() ? *logits : std::vector<float>{};
  }
  // Overwrites this cache with `other`'s bytes (same config and block ids).
  void CopyFrom(const Engine& other) {
    const std::vector<uint8_t> bytes = other.Bytes();
    const kvwire::KvMemory m = cache_->memory()[0];
    ASSERT_EQ(bytes.size(), m.length);
    if (cache_->executor() != nullptr) {
      ASSERT_TRUE(cache_->executor()->Upload(m.ptr, bytes.data(), bytes.size()).ok());
    } else {
      std::memcpy(m.ptr, bytes.data(), bytes.size());
    }
  }
  // The whole cache memory, copied to the host.
  std::vector<uint8_t> Bytes() const {
    const kvwire::KvMemory m = cache_->memory()[0];
    std::vector<uint8_t> b(m.length);
    if (cache_->executor() != nullptr) {
      EXPECT_TRUE(cache_->executor()->Download(b.data(), m.ptr, m.length).ok());
    } else {
      std::memcpy(b.data(), m.ptr, m.length);
    }
    return b;
  }

 private:
  Model& model_;
  std::unique_ptr<KvCache> cache_;
  kvwire::BlockTable table_;
};

std::vector<int32_t> Prompt(int n) {
  std::vector<int32_t> p{256};
  for (int i = 1; i < n; ++i) p.push_back(32 + (i * 41 + i / 5) % 90);
  return p;
}

// A prompt of 600 tokens in steps, so that the contexts 1, 127, 128, 129, 300 and 600 each end
// with a one-token decode: logits and the whole cache (records, compressor rings, indexer
// keys) must equal the CPU engine's after every step. Both engines run every step up to 299
// tokens (chunked prefills of 125 and 170 tokens among them, which emit c4a and c128a
// entries); the long prefill [300, 599) runs on the CPU engine only and its cache is copied
// over before the last decode (the engines' layouts are identical), which keeps the host
// drivers' share of the test short under the sanitizers.
void CheckModel(KvDevice device) {
  std::unique_ptr<Model> model = TinyModelFiles::Get().Load(2);
  const std::vector<int32_t> prompt = Prompt(600);
  Engine cpu(*model, KvDevice::kCpu, 600), other(*model, device, 600);
  ASSERT_TRUE(cpu.ok() && other.ok());
  ASSERT_EQ(other.cache().kv_device(), device);
  ASSERT_NE(other.cache().executor(), nullptr);
  uint64_t pos = 0;
  for (uint64_t end : {1, 126, 127, 128, 129, 299, 300, 599, 600}) {
    const std::span<const int32_t> chunk(prompt.data() + pos, end - pos);
    const std::vector<float> want = cpu.Forward(chunk, pos);
    if (end == 599) {
      other.CopyFrom(cpu);
    } else {
      const std::vector<float> got = other.Forward(chunk, pos);
      ExpectBitEqual(got, want, "logits after " + std::to_string(end) + " tokens");
    }
    ASSERT_TRUE(cpu.Bytes() == other.Bytes()) << "cache bytes after " << end << " tokens";
    pos = end;
  }
}

TEST(HostKernels, ModelMatchesCpuAtEveryContextSize) { CheckModel(KvDevice::kHostKernels); }

TEST(KvCacheDevice, ParseAndNames) {
  EXPECT_EQ(*ParseKvDevice("cpu"), KvDevice::kCpu);
  EXPECT_EQ(*ParseKvDevice("gpu"), KvDevice::kGpu);
  EXPECT_EQ(ParseKvDevice("tpu").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_STREQ(KvDeviceName(KvDevice::kHostKernels), "host-kernels");
  absl::StatusOr<std::unique_ptr<KvCache>> cpu =
      KvCache::Create(TinyModelFiles::Get().config(), 4, 1, 1);
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ((*cpu)->kv_device(), KvDevice::kCpu);
  EXPECT_EQ((*cpu)->gpu_device(), -1);
  EXPECT_EQ((*cpu)->executor(), nullptr);
}

TEST(KvCacheDevice, GpuCacheWithoutDeviceFailsWithTheRuntimesReason) {
  absl::StatusOr<int> n = kvwire::gpu::DefaultRuntime().DeviceCount();
  KvCacheOptions o;
  o.device = KvDevice::kGpu;
  if (n.ok()) {
    o.gpu_device = *n;  // one past the last device
    absl::StatusOr<std::unique_ptr<KvCache>> c =
        KvCache::Create(TinyModelFiles::Get().config(), 4, 1, 1, o);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
    return;
  }
  absl::StatusOr<std::unique_ptr<KvCache>> c =
      KvCache::Create(TinyModelFiles::Get().config(), 4, 1, 1, o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status(), n.status());
  std::printf("%s\n", std::string(c.status().message()).c_str());
}

// --- on a device ------------------------------------------------------------------------------

std::unique_ptr<gpu::KvExecutor> Device0() {
  absl::StatusOr<std::unique_ptr<gpu::KvExecutor>> e =
      gpu::MakeDeviceExecutor(kvwire::gpu::DefaultRuntime(), 0);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

TEST(Device, AttentionKernelsMatchCpuBitForBit) {
  SKIP_WITHOUT_DEVICE();
  std::unique_ptr<gpu::KvExecutor> dev = Device0();
  ASSERT_NE(dev, nullptr);
  CheckAttention(*dev);
}

TEST(Device, RecordEncodeKernelMatchesCpuByteForByte) {
  SKIP_WITHOUT_DEVICE();
  std::unique_ptr<gpu::KvExecutor> dev = Device0();
  ASSERT_NE(dev, nullptr);
  CheckEncode(*dev);
}

TEST(Device, ModelWithGpuCacheMatchesCpuAtEveryContextSize) {
  SKIP_WITHOUT_DEVICE();
  CheckModel(KvDevice::kGpu);
}

TEST(Device, GenerateWithGpuCacheGivesTheCpuTokens) {
  SKIP_WITHOUT_DEVICE();
  std::unique_ptr<Model> model = TinyModelFiles::Get().Load(2);
  KvCacheOptions o;
  o.device = KvDevice::kGpu;
  absl::StatusOr<std::unique_ptr<KvCache>> gpu_cache =
      KvCache::Create(model->config(), 12, 1, 1, o);
  ASSERT_TRUE(gpu_cache.ok()) << gpu_cache.status();
  EXPECT_EQ((*gpu_cache)->gpu_device(), 0);
  absl::StatusOr<std::unique_ptr<KvCache>> cpu_cache = KvCache::Create(model->config(), 12, 1, 1);
  ASSERT_TRUE(cpu_cache.ok());
  GenerateOptions g;
  g.max_tokens = 40;
  g.stop_at_eos = false;
  const std::string prompt(300, 'x');  // past the window, with compressed entries
  absl::StatusOr<GenerateResult> want = Generate(*model, **cpu_cache, prompt, g);
  absl::StatusOr<GenerateResult> got = Generate(*model, **gpu_cache, prompt, g);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->tokens, want->tokens);
  EXPECT_EQ((*gpu_cache)->UsedBlocks(), 0u);
}

}  // namespace
}  // namespace dsv4
