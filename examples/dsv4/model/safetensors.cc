// safetensors: parsing with full validation, and writing.
#include "examples/dsv4/model/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace dsv4 {
namespace {

using nlohmann::json;

// Headers beyond this are refused before they are read (the format's own limit is 100 MB).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

absl::Status TensorError(const std::string& source, const std::string& name,
                         const std::string& what) {
  return absl::InvalidArgumentError(
      absl::StrCat("safetensors ", source, ": tensor '", name, "': ", what));
}

}  // namespace

int DtypeBytes(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL" || d == "F8_E4M3" || d == "F8_E5M2") return 1;
  return 0;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return absl::NotFoundError(absl::StrCat("safetensors: cannot open ", path));
  const std::streamoff size = in.tellg();
  if (size < 0) return absl::DataLossError(absl::StrCat("safetensors: cannot size ", path));
  std::vector<uint8_t> contents(static_cast<size_t>(size));
  in.seekg(0);
  if (size > 0 && !in.read(reinterpret_cast<char*>(contents.data()), size)) {
    return absl::DataLossError(absl::StrCat("safetensors: cannot read ", path));
  }
  return Parse(std::move(contents), path);
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Parse(std::vector<uint8_t> contents,
                                                       const std::string& source) {
  auto error = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors ", source, ": ", what));
  };
  if (contents.size() < 8) {
    return error(absl::StrCat("truncated: ", contents.size(), " bytes, no 8-byte header length"));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | contents[i];
  if (header_len > kMaxHeaderBytes) {
    return error(absl::StrCat("header length ", header_len, " exceeds the ", kMaxHeaderBytes,
                              "-byte limit"));
  }
  if (header_len > contents.size() - 8) {
    return error(absl::StrCat("truncated: header of ", header_len, " bytes but only ",
                              contents.size() - 8, " follow"));
  }
  const char* hp = reinterpret_cast<const char*>(contents.data() + 8);
  json header = json::parse(hp, hp + header_len, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return error("header is not a JSON object");
  }
  SafetensorsFile file;
  const uint64_t data_begin = 8 + header_len;
  const uint64_t data_size = contents.size() - data_begin;
  std::vector<std::pair<uint64_t, uint64_t>> spans;  // (begin, end) for the overlap check
  std::vector<std::string> span_names;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return error("__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return error(absl::StrCat("__metadata__ value of '", m.key(), "' is not a string"));
        }
        file.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object()) return TensorError(source, name, "entry is not an object");
    auto dt = v.find("dtype");
    auto sh = v.find("shape");
    auto off = v.find("data_offsets");
    if (dt == v.end() || !dt->is_string()) return TensorError(source, name, "no dtype string");
    TensorView t;
    t.dtype = dt->get<std::string>();
    const int elem = DtypeBytes(t.dtype);
    if (elem == 0) return TensorError(source, name, absl::StrCat("unknown dtype ", t.dtype));
    if (sh == v.end() || !sh->is_array()) return TensorError(source, name, "no shape array");
    uint64_t numel = 1;
    for (const json& d : *sh) {
      if (!d.is_number_unsigned() && !(d.is_number_integer() && d.get<int64_t>() >= 0)) {
        return TensorError(source, name, "shape entries must be non-negative integers");
      }
      const uint64_t n = d.get<uint64_t>();
      if (n != 0 && numel > (1ull << 48) / n) return TensorError(source, name, "shape too large");
      numel *= n;
      t.shape.push_back(static_cast<int64_t>(n));
    }
    if (off == v.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned()) {
      return TensorError(source, name, "data_offsets must be two non-negative integers");
    }
    const uint64_t begin = (*off)[0].get<uint64_t>(), end = (*off)[1].get<uint64_t>();
    if (begin > end || end > data_size) {
      return TensorError(source, name,
                         absl::StrCat("data_offsets [", begin, ", ", end, ") out of range of the ",
                                      data_size, "-byte data section"));
    }
    if (end - begin != numel * elem) {
      return TensorError(
          source, name,
          absl::StrCat("data_offsets hold ", end - begin, " bytes but ", t.dtype, " shape [",
                       absl::StrJoin(t.shape, ","), "] needs ", numel * elem));
    }
    spans.emplace_back(begin, end);
    span_names.push_back(name);
    file.tensors_[name] = std::move(t);
  }
  // Overlap check on sorted spans (empty tensors overlap nothing).
  std::vector<size_t> order(spans.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return spans[a] < spans[b]; });
  uint64_t last_end = 0;
  std::string last_name;
  for (size_t i : order) {
    if (spans[i].first == spans[i].second) continue;
    if (spans[i].first < last_end) {
      return TensorError(source, span_names[i],
                         absl::StrCat("data overlaps tensor '", last_name, "'"));
    }
    last_end = spans[i].second;
    last_name = span_names[i];
  }
  file.contents_ = std::move(contents);
  for (size_t i = 0; i < spans.size(); ++i) {
    TensorView& t = file.tensors_[span_names[i]];
    t.bytes = std::span<const uint8_t>(file.contents_.data() + data_begin + spans[i].first,
                                       spans[i].second - spans[i].first);
  }
  return file;
}

absl::StatusOr<TensorView> SafetensorsFile::Get(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("safetensors: tensor '", name, "' is missing"));
  }
  return it->second;
}

absl::StatusOr<std::vector<uint8_t>> SerializeSafetensors(
    const std::vector<TensorToWrite>& tensors, const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    const int elem = DtypeBytes(t.dtype);
    if (elem == 0) return TensorError("writer", t.name, absl::StrCat("unknown dtype ", t.dtype));
    uint64_t numel = 1;
    for (int64_t d : t.shape) numel *= static_cast<uint64_t>(d);
    if (numel * elem != t.bytes.size()) {
      return TensorError("writer", t.name,
                         absl::StrCat(t.bytes.size(), " bytes for ", numel, " elements"));
    }
    if (header.contains(t.name)) return TensorError("writer", t.name, "duplicate name");
    header[t.name] = {{"dtype", t.dtype},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  std::vector<uint8_t> out(8 + text.size() + offset);
  const uint64_t len = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(len >> (8 * i));
  std::memcpy(out.data() + 8, text.data(), text.size());
  uint8_t* data = out.data() + 8 + text.size();
  for (const TensorToWrite& t : tensors) {
    if (!t.bytes.empty()) std::memcpy(data, t.bytes.data(), t.bytes.size());
    data += t.bytes.size();
  }
  return out;
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  absl::StatusOr<std::vector<uint8_t>> bytes = SerializeSafetensors(tensors, metadata);
  if (!bytes.ok()) return bytes.status();
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return absl::PermissionDeniedError(absl::StrCat("safetensors: cannot create ", tmp));
    out.write(reinterpret_cast<const char*>(bytes->data()),
              static_cast<std::streamsize>(bytes->size()));
    if (!out.flush()) return absl::DataLossError(absl::StrCat("safetensors: cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return absl::PermissionDeniedError(absl::StrCat("safetensors: cannot rename to ", path));
  }
  return absl::OkStatus();
}

}  // namespace dsv4
