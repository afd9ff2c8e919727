// The safetensors reader (examples/dsv4/model/safetensors.cc): model weights come from files
// an operator downloads, so the reader validates everything. Whatever parses must hold
// tensors whose bytes lie inside the file and match their shape and dtype, and must
// serialise and parse back to the same tensors.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "examples/dsv4/model/safetensors.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<uint8_t> contents(data, data + size);
  absl::StatusOr<dsv4::SafetensorsFile> file = dsv4::SafetensorsFile::Parse(contents, "fuzz");
  if (!file.ok()) {
    KVWIRE_FUZZ_CHECK(file.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  std::vector<dsv4::TensorToWrite> tensors;
  for (const auto& [name, view] : file->tensors()) {
    absl::StatusOr<dsv4::TensorView> got = file->Get(name);
    KVWIRE_FUZZ_CHECK(got.ok());
    const int64_t numel = view.numel();
    KVWIRE_FUZZ_CHECK(numel >= 0);
    KVWIRE_FUZZ_CHECK(view.bytes.size() ==
                      static_cast<uint64_t>(numel) * dsv4::DtypeBytes(view.dtype));
    // Touch the first and last byte: ASan reports a view outside the parsed buffer.
    if (!view.bytes.empty()) {
      volatile uint8_t sink = view.bytes.front() ^ view.bytes.back();
      (void)sink;
    }
    tensors.push_back({name, view.dtype, view.shape, view.bytes});
  }
  absl::StatusOr<std::vector<uint8_t>> bytes =
      dsv4::SerializeSafetensors(tensors, file->metadata());
  KVWIRE_FUZZ_CHECK(bytes.ok());
  absl::StatusOr<dsv4::SafetensorsFile> again = dsv4::SafetensorsFile::Parse(*bytes, "again");
  KVWIRE_FUZZ_CHECK(again.ok());
  KVWIRE_FUZZ_CHECK(again->tensors().size() == file->tensors().size());
  KVWIRE_FUZZ_CHECK(again->metadata() == file->metadata());
  for (const auto& [name, view] : file->tensors()) {
    absl::StatusOr<dsv4::TensorView> other = again->Get(name);
    KVWIRE_FUZZ_CHECK(
        other.ok() && other->dtype == view.dtype && other->shape == view.shape &&
        std::equal(view.bytes.begin(), view.bytes.end(), other->bytes.begin(), other->bytes.end()));
  }
  return 0;
}
