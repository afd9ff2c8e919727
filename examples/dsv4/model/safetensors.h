// A safetensors reader and writer (the real format: 8-byte little-endian header length, a
// JSON header mapping tensor names to dtype / shape / data_offsets plus an optional
// __metadata__ object of strings, then the data). The reader validates everything it is
// given and names the offending tensor in its errors.
#ifndef KVWIRE_EXAMPLES_DSV4_MODEL_SAFETENSORS_H_
#define KVWIRE_EXAMPLES_DSV4_MODEL_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dsv4 {

// Bytes per element of a safetensors dtype name (F32, BF16, I32, ...); 0 if unknown.
int DtypeBytes(const std::string& dtype);

struct TensorView {
  std::string dtype;
  std::vector<int64_t> shape;
  std::span<const uint8_t> bytes;
  int64_t numel() const;
};

class SafetensorsFile {
 public:
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);
  static absl::StatusOr<SafetensorsFile> Parse(std::vector<uint8_t> contents,
                                               const std::string& source = "buffer");

  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // NotFound naming the tensor when absent.
  absl::StatusOr<TensorView> Get(const std::string& name) const;

 private:
  std::vector<uint8_t> contents_;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

struct TensorToWrite {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::span<const uint8_t> bytes;
};

// Serialises tensors (in the given order) to the safetensors byte format.
absl::StatusOr<std::vector<uint8_t>> SerializeSafetensors(
    const std::vector<TensorToWrite>& tensors,
    const std::map<std::string, std::string>& metadata = {});
// Writes atomically (temporary file, then rename).
absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace dsv4

#endif  // KVWIRE_EXAMPLES_DSV4_MODEL_SAFETENSORS_H_
