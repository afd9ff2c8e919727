// The one format of an option out of range, range checks in that format, storing an int64 a
// binding was given into an option field of another integer type, and setting an option by
// name from text. Engine::Create's validator (kvwire/options_check.h) and each transport's
// options (kvwire/transport_options.h) report ranges with CheckOptionRange/OptionOutOfRange;
// the C API and Python use StoreOption, which checks only what the field's type can hold (the
// option's range is the validator's). SetOptionByName/GetOptionByName serve the transports'
// by-name setters (TransportOptions::Set/Get).
#ifndef KVWIRE_SRC_UTIL_OPTION_RANGE_H_
#define KVWIRE_SRC_UTIL_OPTION_RANGE_H_

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvwire {

// "<option>: <value> is out of range (<lo>..<hi>)", as InvalidArgument.
template <typename V, typename B>
absl::Status OptionOutOfRange(absl::string_view option, const V& value, const B& lo, const B& hi) {
  return absl::InvalidArgumentError(
      absl::StrCat(option, ": ", value, " is out of range (", lo, "..", hi, ")"));
}

// Stores `value` in `*field` when T can hold it (bool: 0 or 1); else the error above with T's
// limits, and `*field` keeps its value.
template <typename T>
absl::Status StoreOption(absl::string_view option, int64_t value, T* field) {
  if constexpr (std::is_same_v<T, bool>) {
    if (value != 0 && value != 1) return OptionOutOfRange(option, value, 0, 1);
  } else {
    if (!std::in_range<T>(value)) {
      return OptionOutOfRange(option, value, std::numeric_limits<T>::min(),
                              std::numeric_limits<T>::max());
    }
  }
  *field = static_cast<T>(value);
  return absl::OkStatus();
}

// An integer option within [lo, hi]; unsigned fields compare without wrapping.
template <typename T>
absl::Status CheckOptionRange(absl::string_view option, T value, int64_t lo, int64_t hi) {
  bool inside;
  if constexpr (std::is_unsigned_v<T>) {
    inside = value <= static_cast<uint64_t>(hi) && (lo <= 0 || value >= static_cast<uint64_t>(lo));
  } else {
    inside = value >= lo && value <= hi;
  }
  return inside ? absl::OkStatus() : OptionOutOfRange(option, value, lo, hi);
}

inline absl::Status CheckOptionRange(absl::string_view option, absl::Duration value,
                                     absl::Duration lo, absl::Duration hi) {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return OptionOutOfRange(option, absl::FormatDuration(value), absl::FormatDuration(lo),
                          absl::FormatDuration(hi));
}

// Parses the text of an option into its field (integers in decimal, booleans 1/0/true/false,
// durations as absl::ParseDuration takes them, lists comma-separated with empty entries
// dropped); InvalidArgument naming the option and the expected form otherwise.
template <typename T>
absl::Status ParseOptionText(absl::string_view option, absl::string_view text, T* field) {
  if constexpr (std::is_same_v<T, bool>) {
    if (text == "1" || text == "true") {
      *field = true;
    } else if (text == "0" || text == "false") {
      *field = false;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(option, ": \"", text, "\" is not a boolean (1, 0, true or false)"));
    }
    return absl::OkStatus();
  } else if constexpr (std::is_same_v<T, absl::Duration>) {
    absl::Duration d;
    if (!absl::ParseDuration(text, &d) || d == absl::InfiniteDuration() ||
        d == -absl::InfiniteDuration()) {
      return absl::InvalidArgumentError(absl::StrCat(
          option, ": \"", text, "\" is not a duration (a number and a unit: 20us, 5s, 1.5ms)"));
    }
    *field = d;
    return absl::OkStatus();
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    *field = absl::StrSplit(text, ',', absl::SkipEmpty());
    return absl::OkStatus();
  } else if constexpr (std::is_same_v<T, std::string>) {
    *field = std::string(text);  // checked by the struct's Validate
    return absl::OkStatus();
  } else {
    static_assert(std::is_integral_v<T>);
    int64_t v = 0;
    if (!absl::SimpleAtoi(text, &v)) {
      return absl::InvalidArgumentError(absl::StrCat(option, ": \"", text, "\" is not an integer"));
    }
    return StoreOption(option, v, field);
  }
}

// The text of a field, as ParseOptionText takes it.
template <typename T>
std::string OptionText(const T& field) {
  if constexpr (std::is_same_v<T, bool>) {
    return field ? "1" : "0";
  } else if constexpr (std::is_same_v<T, absl::Duration>) {
    return absl::FormatDuration(field);
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    return absl::StrJoin(field, ",");
  } else if constexpr (std::is_same_v<T, std::string>) {
    return field;
  } else {
    return absl::StrCat(field);
  }
}

// For an options struct whose fields `visit` lists (visit(f) calls f("key", field) for each):
// sets field `key` of transport `transport` from text. An unknown key is InvalidArgument
// naming the known ones.
template <typename Visit>
absl::Status SetOptionByName(absl::string_view transport, absl::string_view key,
                             absl::string_view text, Visit&& visit) {
  std::vector<std::string> keys;
  absl::Status result = absl::InvalidArgumentError("");
  bool found = false;
  visit([&](absl::string_view k, auto& field) {
    keys.emplace_back(k);
    if (!found && k == key) {
      found = true;
      result = ParseOptionText(absl::StrCat(transport, ".", k), text, &field);
    }
  });
  if (found) return result;
  return absl::InvalidArgumentError(absl::StrCat("unknown option \"", key, "\" of transport ",
                                                 transport, " (", absl::StrJoin(keys, ", "), ")"));
}

// The text of field `key`; NotFound for an unknown key.
template <typename Visit>
absl::Status GetOptionByName(absl::string_view transport, absl::string_view key, std::string* text,
                             Visit&& visit) {
  bool found = false;
  visit([&](absl::string_view k, const auto& field) {
    if (!found && k == key) {
      found = true;
      *text = OptionText(field);
    }
  });
  if (found) return absl::OkStatus();
  return absl::NotFoundError(absl::StrCat("unknown option \"", key, "\" of transport ", transport));
}

template <typename Visit>
std::vector<std::string> OptionKeys(Visit&& visit) {
  std::vector<std::string> keys;
  visit([&](absl::string_view k, const auto&) { keys.emplace_back(k); });
  return keys;
}

}  // namespace kvwire

#endif  // KVWIRE_SRC_UTIL_OPTION_RANGE_H_
