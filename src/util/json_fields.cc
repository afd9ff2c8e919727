#include "src/util/json_fields.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvwire {
namespace {

using nlohmann::json;

// What an error shows of a wrong value: numbers and (short) strings as they are, anything
// else by its type, so that a hostile value is never dumped whole.
std::string Describe(const json* v) {
  if (v == nullptr || v->is_null()) return "null";
  switch (v->type()) {
    case json::value_t::number_integer:
      return absl::StrCat(v->get<int64_t>());
    case json::value_t::number_unsigned:
      return absl::StrCat(v->get<uint64_t>());
    case json::value_t::number_float:
      return absl::StrCat(v->get<double>());
    case json::value_t::boolean:
      return v->get<bool>() ? "true" : "false";
    case json::value_t::string: {
      const std::string& s = v->get_ref<const std::string&>();
      if (s.size() > 40) return absl::StrCat("a string of ", s.size(), " bytes");
      std::string out = "\"";
      for (char c : s) out += (static_cast<unsigned char>(c) < 0x20 || c == '"') ? '?' : c;
      return out + "\"";
    }
    default:
      return v->type_name();
  }
}

// The first pass of ParseJsonObject: it builds nothing and stops at the first level or
// value over the limits, before the DOM parser sees the document.
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
  // The parser's own message quotes the offending token: a position is all a peer gets.
  bool parse_error(std::size_t position, const std::string&,
                   const nlohmann::detail::exception&) override {
    error_ = absl::StrCat("not valid JSON (error at byte ", position, ")");
    return false;
  }

  const std::string& error() const { return error_; }

 private:
  bool Value() {
    if (++values_ <= limits_.max_values) return true;
    error_ = absl::StrCat("JSON has more than ", limits_.max_values, " values");
    return false;
  }
  bool Open() {
    if (!Value()) return false;
    if (++depth_ <= limits_.max_depth) return true;
    error_ = absl::StrCat("JSON nested deeper than ", limits_.max_depth, " levels");
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

// Whether `text` cannot break `limits` whatever it holds, so that the scan may be skipped:
// every value takes at least one byte, and every level opens with a '[' or a '{' (those
// inside strings are counted too, which only overcounts). A connector's messages are mostly
// small and flat: the scan was half the cost of parsing each.
bool WithinLimitsByItsBytes(absl::string_view text, const JsonLimits& limits) {
  if (text.size() > limits.max_values) return false;
  size_t opens = 0;
  for (const char c : text) opens += c == '[' || c == '{';
  return opens <= static_cast<size_t>(std::max(limits.max_depth, 0));
}

}  // namespace

absl::StatusOr<json> ParseJsonObject(absl::string_view text, absl::string_view context,
                                     const JsonLimits& limits) {
  if (text.size() > limits.max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        context, ": ", text.size(), " bytes of JSON is over the limit of ", limits.max_bytes));
  }
  const bool scanned = !WithinLimitsByItsBytes(text, limits);
  LimitScan scan(limits);
  if (scanned && !json::sax_parse(text.begin(), text.end(), &scan)) {
    return absl::InvalidArgumentError(
        absl::StrCat(context, ": ", scan.error().empty() ? "not valid JSON" : scan.error()));
  }
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    // Not scanned: the scan names where the text stops being JSON.
    if (!scanned && !json::sax_parse(text.begin(), text.end(), &scan) && !scan.error().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(context, ": ", scan.error()));
    }
    return absl::InvalidArgumentError(absl::StrCat(context, ": not valid JSON"));
  }
  if (!j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(context, ": not a JSON object (got ", j.type_name(), ")"));
  }
  return j;
}

std::string DumpJson(const json& j) {
  return j.dump(-1, ' ', /*ensure_ascii=*/false, json::error_handler_t::replace);
}

JsonFields::JsonFields(const json& object, std::string context)
    : JsonFields(object, std::move(context), std::make_shared<absl::Status>()) {}

JsonFields::JsonFields(const json& object, std::string context, std::shared_ptr<absl::Status> error)
    : object_(&object), context_(std::move(context)), error_(std::move(error)) {
  if (!object.is_object() && error_->ok()) {
    *error_ = absl::InvalidArgumentError(
        absl::StrCat(context_, ": not a JSON object (got ", Describe(&object), ")"));
  }
}

bool JsonFields::Has(absl::string_view field) const {
  if (!object_->is_object()) return false;
  auto it = object_->find(std::string(field));
  return it != object_->end() && !it->is_null();
}

void JsonFields::Fail(absl::string_view field, absl::string_view problem) {
  if (!error_->ok()) return;
  *error_ = absl::InvalidArgumentError(absl::StrCat(context_, ": '", field, "' ", problem));
}

void JsonFields::Fail(absl::string_view field, absl::string_view problem, const json& got) {
  if (!error_->ok()) return;
  Fail(field, absl::StrCat(problem, ", got ", Describe(&got)));
}

const json* JsonFields::Find(absl::string_view field, bool required) {
  if (!ok() || !object_->is_object()) return nullptr;
  auto it = object_->find(std::string(field));
  if (it == object_->end() || it->is_null()) {
    if (required) Fail(field, it == object_->end() ? "is missing" : "is null");
    return nullptr;
  }
  return &*it;
}

namespace {
// `v` as an integer in [lo, hi], or nullopt. Allocates nothing (arrays of block ids run
// through it per element).
std::optional<int64_t> IntIn(const json& v, int64_t lo, int64_t hi) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (hi >= 0 && u <= static_cast<uint64_t>(hi) && static_cast<int64_t>(u) >= lo) {
      return static_cast<int64_t>(u);
    }
  } else if (v.is_number_integer()) {
    const int64_t i = v.get<int64_t>();
    if (i >= lo && i <= hi) return i;
  }
  return std::nullopt;
}

// `v` as an unsigned integer (a non-negative signed one too) in [0, hi], or nullopt; as IntIn.
std::optional<uint64_t> UintIn(const json& v, uint64_t hi) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u <= hi) return u;
  } else if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    const uint64_t u = static_cast<uint64_t>(v.get<int64_t>());
    if (u <= hi) return u;
  }
  return std::nullopt;
}
}  // namespace

int64_t JsonFields::IntValue(const json& v, absl::string_view name, int64_t lo, int64_t hi) {
  if (std::optional<int64_t> i = IntIn(v, lo, hi)) return *i;
  Fail(name, absl::StrCat("must be an integer in [", lo, ", ", hi, "]"), v);
  return 0;
}

int64_t JsonFields::IntItem(const json& v, absl::string_view array, size_t index, int64_t lo,
                            int64_t hi) {
  if (std::optional<int64_t> i = IntIn(v, lo, hi)) return *i;
  return IntValue(v, absl::StrCat(array, "[", index, "]"), lo, hi);
}

uint64_t JsonFields::UintValue(const json& v, absl::string_view name, uint64_t hi) {
  if (std::optional<uint64_t> u = UintIn(v, hi)) return *u;
  Fail(name, absl::StrCat("must be an integer in [0, ", hi, "]"), v);
  return 0;
}

std::string JsonFields::StringValue(const json& v, absl::string_view name, size_t max_bytes) {
  if (!v.is_string()) {
    Fail(name, "must be a string", v);
    return "";
  }
  const std::string& s = v.get_ref<const std::string&>();
  if (s.size() > max_bytes) {
    Fail(name, absl::StrCat("is ", s.size(), " bytes long, over the limit of ", max_bytes));
    return "";
  }
  return s;
}

std::string JsonFields::String(absl::string_view field, size_t max_bytes) {
  const json* v = Find(field, /*required=*/true);
  return v == nullptr ? "" : StringValue(*v, field, max_bytes);
}

std::string JsonFields::OptString(absl::string_view field, std::string fallback, size_t max_bytes) {
  const json* v = Find(field, /*required=*/false);
  if (v == nullptr) return fallback;
  std::string s = StringValue(*v, field, max_bytes);
  return ok() ? s : fallback;
}

int64_t JsonFields::Int(absl::string_view field, int64_t lo, int64_t hi) {
  const json* v = Find(field, /*required=*/true);
  return v == nullptr ? 0 : IntValue(*v, field, lo, hi);
}

int64_t JsonFields::OptInt(absl::string_view field, int64_t lo, int64_t hi, int64_t fallback) {
  const json* v = Find(field, /*required=*/false);
  if (v == nullptr) return fallback;
  const int64_t i = IntValue(*v, field, lo, hi);
  return ok() ? i : fallback;
}

uint64_t JsonFields::Uint(absl::string_view field, uint64_t hi) {
  const json* v = Find(field, /*required=*/true);
  return v == nullptr ? 0 : UintValue(*v, field, hi);
}

uint64_t JsonFields::OptUint(absl::string_view field, uint64_t hi, uint64_t fallback) {
  const json* v = Find(field, /*required=*/false);
  if (v == nullptr) return fallback;
  const uint64_t u = UintValue(*v, field, hi);
  return ok() ? u : fallback;
}

bool JsonFields::Bool(absl::string_view field) {
  const json* v = Find(field, /*required=*/true);
  if (v == nullptr) return false;
  if (!v->is_boolean()) {
    Fail(field, "must be true or false", *v);
    return false;
  }
  return v->get<bool>();
}

bool JsonFields::OptBool(absl::string_view field, bool fallback) {
  const json* v = Find(field, /*required=*/false);
  if (v == nullptr) return fallback;
  if (!v->is_boolean()) {
    Fail(field, "must be true or false", *v);
    return fallback;
  }
  return v->get<bool>();
}

double JsonFields::NumberValue(const json& v, absl::string_view name, double lo, double hi) {
  if (v.is_number()) {
    const double d = v.get<double>();
    if (d >= lo && d <= hi) return d;
  }
  Fail(name, absl::StrCat("must be a number in [", lo, ", ", hi, "]"), v);
  return 0;
}

double JsonFields::Number(absl::string_view field, double lo, double hi) {
  const json* v = Find(field, /*required=*/true);
  return v == nullptr ? 0 : NumberValue(*v, field, lo, hi);
}

double JsonFields::OptNumber(absl::string_view field, double lo, double hi, double fallback) {
  const json* v = Find(field, /*required=*/false);
  if (v == nullptr) return fallback;
  const double d = NumberValue(*v, field, lo, hi);
  return ok() ? d : fallback;
}

const json* JsonFields::Array(absl::string_view field, bool required, size_t max_items) {
  const json* v = Find(field, required);
  if (v == nullptr) return nullptr;
  if (!v->is_array()) {
    Fail(field, "must be an array", *v);
    return nullptr;
  }
  if (v->size() > max_items) {
    Fail(field, absl::StrCat("has ", v->size(), " items, over the limit of ", max_items));
    return nullptr;
  }
  return v;
}

std::vector<int64_t> JsonFields::IntArray(absl::string_view field, bool required, int64_t lo,
                                          int64_t hi, size_t max_items) {
  std::vector<int64_t> out;
  const json* a = Array(field, required, max_items);
  if (a == nullptr) return out;
  out.reserve(a->size());
  for (size_t i = 0; i < a->size() && ok(); ++i) {
    out.push_back(IntItem((*a)[i], field, i, lo, hi));
  }
  if (!ok()) out.clear();
  return out;
}

std::vector<uint64_t> JsonFields::UintArray(absl::string_view field, bool required, uint64_t hi,
                                            size_t max_items) {
  std::vector<uint64_t> out;
  const json* a = Array(field, required, max_items);
  if (a == nullptr) return out;
  out.reserve(a->size());
  for (size_t i = 0; i < a->size() && ok(); ++i) {
    // The element's name is built only for an error, as IntItem's.
    std::optional<uint64_t> u = UintIn((*a)[i], hi);
    out.push_back(u ? *u : UintValue((*a)[i], absl::StrCat(field, "[", i, "]"), hi));
  }
  if (!ok()) out.clear();
  return out;
}

const json* JsonFields::Object(absl::string_view field, bool required) {
  const json* v = Find(field, required);
  if (v == nullptr) return nullptr;
  if (!v->is_object()) {
    Fail(field, "must be an object", *v);
    return nullptr;
  }
  return v;
}

JsonFields JsonFields::Nested(absl::string_view field, bool required) {
  static const json kEmpty = json::object();
  const json* v = Object(field, required);
  return JsonFields(v == nullptr ? kEmpty : *v, absl::StrCat(context_, ".", field), error_);
}

JsonFields JsonFields::Item(const json& value, absl::string_view name) {
  return JsonFields(value, absl::StrCat(context_, ".", name), error_);
}

}  // namespace kvwire
