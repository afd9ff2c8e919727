// Typed, bounded access to JSON that came from outside the process (a peer's message, an HTTP
// body, kv_transfer_params, a layout): nothing here throws, every value is checked for its type
// and range before it is read, strings and arrays have a size cap, and an error names the
// field ("kv_transfer_params: 'remote_port' must be an integer in [0, 65535], got \"x\"").
//
// nlohmann's own `value()`, `at()` and `get<T>()` throw on a wrong type (and `value()` on a
// non-object), and a throw on a progress or I/O thread ends the process: input from a peer
// goes through this reader instead.
//
//   absl::StatusOr<nlohmann::json> j = ParseJsonObject(text, "kv_transfer_params");
//   if (!j.ok()) return j.status();
//   JsonFields f(*j, "kv_transfer_params");
//   std::string host = f.OptString("remote_host");
//   int64_t port = f.OptInt("remote_port", 0, 65535, 0);
//   if (!f.ok()) return f.status();
//
// A null field counts as missing: optional fields take their fallback (Python's None, as
// vLLM's proxies send it), required ones are an error. Errors are sticky: the first one is
// kept and later reads return their fallback, so a parser reads every field and checks once.
#ifndef KVWIRE_UTIL_JSON_FIELDS_H_
#define KVWIRE_UTIL_JSON_FIELDS_H_

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvwire {

// Limits a reader applies unless a call names its own.
inline constexpr size_t kJsonMaxStringBytes = 4096;
inline constexpr size_t kJsonMaxArrayItems = 1 << 20;
// Nesting deeper than this is refused before parsing.
inline constexpr int kJsonMaxDepth = 32;

// Bounds of one document, checked by a first pass that builds nothing: copying or printing
// a value recurses once per level, so depth is stack, and each parsed value costs far more
// memory than its bytes of text (a 4 MiB body of "0," is two million values).
struct JsonLimits {
  size_t max_bytes = 16 << 20;
  int max_depth = kJsonMaxDepth;
  // Scalars, arrays and objects at all levels together (keys are not counted).
  uint64_t max_values = std::numeric_limits<uint64_t>::max();
};

// Parses `text`, which must be one JSON object within `limits`; errors start with
// `context`. Never throws.
absl::StatusOr<nlohmann::json> ParseJsonObject(absl::string_view text, absl::string_view context,
                                               const JsonLimits& limits = {});

// j.dump() that never throws: strings that are not valid UTF-8 (a caller's request id, say)
// are written with U+FFFD in place of the bad bytes instead of throwing type_error 316.
std::string DumpJson(const nlohmann::json& j);

class JsonFields {
 public:
  // Reads the fields of `object` (which must outlive the reader); a non-object is an error
  // at once. `context` starts every error message.
  JsonFields(const nlohmann::json& object, std::string context);
  JsonFields(const JsonFields&) = delete;
  JsonFields& operator=(const JsonFields&) = delete;
  JsonFields(JsonFields&&) = default;

  // OK, or the first error of this reader and of the readers made from it (Nested, Item).
  bool ok() const { return error_->ok(); }
  const absl::Status& status() const { return *error_; }
  // Present and not null.
  bool Has(absl::string_view field) const;
  // Records `problem` about `field` (checks the caller makes itself); the first error wins.
  void Fail(absl::string_view field, absl::string_view problem);
  // The same, showing the value found (a short rendering, never a hostile value whole).
  void Fail(absl::string_view field, absl::string_view problem, const nlohmann::json& got);

  // Required fields: missing, null or of another type is an error (and the fallback-less
  // reads return "", 0 or false then).
  std::string String(absl::string_view field, size_t max_bytes = kJsonMaxStringBytes);
  int64_t Int(absl::string_view field, int64_t lo, int64_t hi);
  uint64_t Uint(absl::string_view field, uint64_t hi = std::numeric_limits<uint64_t>::max());
  bool Bool(absl::string_view field);
  // Any JSON number (integer or not) in [lo, hi].
  double Number(absl::string_view field, double lo, double hi);

  // Optional fields: missing or null gives `fallback`; present with another type is an error.
  std::string OptString(absl::string_view field, std::string fallback = "",
                        size_t max_bytes = kJsonMaxStringBytes);
  int64_t OptInt(absl::string_view field, int64_t lo, int64_t hi, int64_t fallback);
  uint64_t OptUint(absl::string_view field, uint64_t hi, uint64_t fallback);
  bool OptBool(absl::string_view field, bool fallback);
  double OptNumber(absl::string_view field, double lo, double hi, double fallback);

  // An array field with at most `max_items` items: nullptr when optional and missing/null,
  // or on error.
  const nlohmann::json* Array(absl::string_view field, bool required,
                              size_t max_items = kJsonMaxArrayItems);
  // An array of integers in [lo, hi].
  std::vector<int64_t> IntArray(absl::string_view field, bool required, int64_t lo, int64_t hi,
                                size_t max_items = kJsonMaxArrayItems);
  std::vector<uint64_t> UintArray(absl::string_view field, bool required, uint64_t hi,
                                  size_t max_items = kJsonMaxArrayItems);
  // An object field: nullptr when optional and missing/null, or on error.
  const nlohmann::json* Object(absl::string_view field, bool required);
  // A reader of the object `field` that shares this reader's error; an optional one that is
  // missing reads as an empty object (every Opt read gives its fallback).
  JsonFields Nested(absl::string_view field, bool required);
  // A reader of `value` (e.g. an array item) named `name` in errors, sharing this reader's
  // error.
  JsonFields Item(const nlohmann::json& value, absl::string_view name);

  // Checks one value (an array item, a map value) named `name` in errors.
  int64_t IntValue(const nlohmann::json& value, absl::string_view name, int64_t lo, int64_t hi);
  // IntValue of item `index` of array `array`, whose name ("array[index]") is built only for an
  // error: arrays of thousands of block ids go through it.
  int64_t IntItem(const nlohmann::json& value, absl::string_view array, size_t index, int64_t lo,
                  int64_t hi);
  uint64_t UintValue(const nlohmann::json& value, absl::string_view name,
                     uint64_t hi = std::numeric_limits<uint64_t>::max());
  std::string StringValue(const nlohmann::json& value, absl::string_view name,
                          size_t max_bytes = kJsonMaxStringBytes);
  double NumberValue(const nlohmann::json& value, absl::string_view name, double lo, double hi);

 private:
  JsonFields(const nlohmann::json& object, std::string context,
             std::shared_ptr<absl::Status> error);
  // The field when present and not null (nullptr otherwise, or when this reader failed).
  const nlohmann::json* Find(absl::string_view field, bool required);

  const nlohmann::json* object_;
  std::string context_;
  std::shared_ptr<absl::Status> error_;
};

}  // namespace kvwire

#endif  // KVWIRE_UTIL_JSON_FIELDS_H_
