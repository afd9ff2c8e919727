#include "examples/dsv4/serve/json_fields.h"

#include <cmath>
#include <string_view>

#include "absl/strings/str_cat.h"

namespace dsv4::serve {

using nlohmann::json;

namespace {

// A first pass that builds nothing: it stops at the first level or value over the limits,
// before the DOM parser (whose result is copied and printed recursively) sees the document.
class LimitScan : public nlohmann::json_sax<json> {
 public:
  explicit LimitScan(const JsonLimits& limits) : limits_(limits) {}

  bool null() override { return Value(); }
  bool boolean(bool) override { return Value(); }
  bool number_integer(number_integer_t) override { return Value(); }
  bool number_unsigned(number_unsigned_t) override { return Value(); }
  bool number_float(number_float_t, const string_t&) override { return Value(); }
  bool string(string_t&) override { return Value(); }
  bool binary(binary_t&) override { return Value(); }
  bool start_object(std::size_t) override { return Open(); }
  bool key(string_t&) override { return true; }
  bool end_object() override { return Close(); }
  bool start_array(std::size_t) override { return Open(); }
  bool end_array() override { return Close(); }
  bool parse_error(std::size_t position, const std::string&,
                   const nlohmann::detail::exception&) override {
    error_ = absl::StrCat("is not valid JSON (syntax error at byte ", position, ")");
    return false;
  }

  const std::string& error() const { return error_; }

 private:
  bool Value() {
    if (++values_ <= limits_.max_values) return true;
    error_ = absl::StrCat("has more than ", limits_.max_values, " JSON values");
    return false;
  }
  bool Open() {
    if (!Value()) return false;
    if (++depth_ <= limits_.max_depth) return true;
    error_ = absl::StrCat("nests deeper than ", limits_.max_depth, " levels");
    return false;
  }
  bool Close() {
    --depth_;
    return true;
  }

  const JsonLimits limits_;
  int depth_ = 0;
  uint64_t values_ = 0;
  std::string error_;
};

}  // namespace

absl::StatusOr<json> ParseJsonBounded(absl::string_view text, absl::string_view what,
                                      const JsonLimits& limits) {
  LimitScan scan(limits);
  if (!json::sax_parse(text.begin(), text.end(), &scan)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", scan.error().empty() ? "is not valid JSON" : scan.error()));
  }
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(what, " is not valid JSON"));
  return j;
}

std::string JsonSnippet(const json& value) {
  constexpr size_t kMax = 48;
  std::string s = value.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > kMax) s = absl::StrCat(s.substr(0, kMax), "...");
  return s;
}

JsonFields::JsonFields(const json& object, std::string where)
    : object_(object), where_(std::move(where)) {}

const json* JsonFields::Find(absl::string_view name) const {
  if (!object_.is_object()) return nullptr;
  const auto it = object_.find(std::string_view(name.data(), name.size()));
  if (it == object_.end() || it->is_null()) return nullptr;
  return &*it;
}

bool JsonFields::Has(absl::string_view name) const { return Find(name) != nullptr; }

absl::Status JsonFields::Bad(absl::string_view name, absl::string_view want) const {
  const json* v = Find(name);
  return absl::InvalidArgumentError(absl::StrCat("'", where_, name, "' must be ", want,
                                                 v == nullptr ? "" : ", not ",
                                                 v == nullptr ? "" : JsonSnippet(*v)));
}

absl::Status JsonFields::Bool(absl::string_view name, bool* out) const {
  const json* v = Find(name);
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_boolean()) return Bad(name, "true or false");
  *out = v->get<bool>();
  return absl::OkStatus();
}

absl::Status JsonFields::String(absl::string_view name, size_t max_bytes, std::string* out) const {
  const json* v = Find(name);
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_string()) return Bad(name, "a string");
  const std::string& s = v->get_ref<const std::string&>();
  if (s.size() > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("'", where_, name, "' is ", s.size(),
                                                   " bytes long (at most ", max_bytes, ")"));
  }
  *out = s;
  return absl::OkStatus();
}

absl::Status JsonFields::Int(absl::string_view name, int64_t min, int64_t max,
                             std::optional<int64_t>* out) const {
  const json* v = Find(name);
  if (v == nullptr) return absl::OkStatus();
  const std::string want = absl::StrCat("an integer in [", min, ", ", max, "]");
  if (v->is_number_unsigned()) {
    const uint64_t u = v->get<uint64_t>();
    if (max < 0 || u > static_cast<uint64_t>(max)) return Bad(name, want);
    if (static_cast<int64_t>(u) < min) return Bad(name, want);
    *out = static_cast<int64_t>(u);
    return absl::OkStatus();
  }
  if (!v->is_number_integer()) return Bad(name, want);
  const int64_t i = v->get<int64_t>();
  if (i < min || i > max) return Bad(name, want);
  *out = i;
  return absl::OkStatus();
}

absl::Status JsonFields::Int(absl::string_view name, int64_t min, int64_t max, int64_t* out) const {
  std::optional<int64_t> v;
  if (absl::Status s = Int(name, min, max, &v); !s.ok()) return s;
  if (v) *out = *v;
  return absl::OkStatus();
}

absl::Status JsonFields::Uint(absl::string_view name, uint64_t max, uint64_t* out) const {
  const json* v = Find(name);
  if (v == nullptr) return absl::OkStatus();
  // A negative integer is number_integer, never number_unsigned.
  if (!v->is_number_unsigned() || v->get<uint64_t>() > max) {
    return Bad(name, absl::StrCat("an integer in [0, ", max, "]"));
  }
  *out = v->get<uint64_t>();
  return absl::OkStatus();
}

absl::Status JsonFields::Number(absl::string_view name, double min, double max, double* out) const {
  const json* v = Find(name);
  if (v == nullptr) return absl::OkStatus();
  const std::string want = absl::StrCat("a number in [", min, ", ", max, "]");
  if (!v->is_number()) return Bad(name, want);
  const double d = v->get<double>();
  if (!std::isfinite(d) || d < min || d > max) return Bad(name, want);
  *out = d;
  return absl::OkStatus();
}

absl::Status JsonFields::Object(absl::string_view name, const json** out) const {
  const json* v = Find(name);
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_object()) return Bad(name, "an object");
  *out = v;
  return absl::OkStatus();
}

}  // namespace dsv4::serve
