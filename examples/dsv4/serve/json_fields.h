// Typed, bounded reads of JSON that an HTTP client (or an upstream server) sent the dsv4
// servers. nlohmann's value()/get() throw on a wrong type, and a throw on the HTTP or worker
// thread ends the process; these return an InvalidArgument status naming the field instead.
//
// Local to examples/dsv4/serve for now: src/util is getting a helper of the same kind for the
// connector's peer messages, and the two should become one.
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_JSON_FIELDS_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_JSON_FIELDS_H_

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace dsv4::serve {

// Bounds of one parsed document. A 4 MiB body of brackets would otherwise nest a million
// levels deep, and copying or printing such a value recurses once per level.
struct JsonLimits {
  int max_depth = 32;
  uint64_t max_values = 100000;  // scalars, arrays and objects, all levels together
};

// Parses `text`; errors say what `what` (e.g. "request body") is not.
absl::StatusOr<nlohmann::json> ParseJsonBounded(absl::string_view text, absl::string_view what,
                                                const JsonLimits& limits = {});

// Reads the fields of one JSON object. A field that is missing or null leaves the output
// alone and is not an error; any other type, or a value out of range, is an error naming
// `where` + the field and quoting (the start of) the value found.
class JsonFields {
 public:
  // `object` must outlive this. `where` prefixes field names in errors ("kv_transfer_params.").
  JsonFields(const nlohmann::json& object, std::string where);

  // Present and not null.
  bool Has(absl::string_view name) const;

  absl::Status Bool(absl::string_view name, bool* out) const;
  absl::Status String(absl::string_view name, size_t max_bytes, std::string* out) const;
  // Integers only (1.0 is not one); [min, max] inclusive.
  absl::Status Int(absl::string_view name, int64_t min, int64_t max, int64_t* out) const;
  absl::Status Int(absl::string_view name, int64_t min, int64_t max,
                   std::optional<int64_t>* out) const;
  absl::Status Uint(absl::string_view name, uint64_t max, uint64_t* out) const;
  // Any JSON number in [min, max].
  absl::Status Number(absl::string_view name, double min, double max, double* out) const;
  // *out points into the object, or stays null when the field is missing or null.
  absl::Status Object(absl::string_view name, const nlohmann::json** out) const;

  // An InvalidArgument error for `name`: "'<where><name>' must be <want>, not <value>".
  absl::Status Bad(absl::string_view name, absl::string_view want) const;

 private:
  // The field, or null when missing or JSON null.
  const nlohmann::json* Find(absl::string_view name) const;

  const nlohmann::json& object_;
  const std::string where_;
};

// A short, printable rendering of `value` for error messages.
std::string JsonSnippet(const nlohmann::json& value);

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_JSON_FIELDS_H_
