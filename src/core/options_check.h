// The one check of kvwire::EngineOptions, as LevelDB's SanitizeOptions: Engine::Create runs it
// before anything starts, and the C API and Python forward their options to Create, holding no
// range of their own. A value out of range is refused with an error naming the option and its
// range ("<option>: <value> is out of range (<lo>..<hi>)"), never clamped.
#ifndef KVWIRE_SRC_CORE_OPTIONS_CHECK_H_
#define KVWIRE_SRC_CORE_OPTIONS_CHECK_H_

#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

#include "kvwire/engine.h"

namespace kvwire {

// OK, or the first option of `options` that is out of range or inconsistent with another.
absl::Status ValidateEngineOptions(const EngineOptions& options);

// The error of an option out of range, in the one format every entry point reports.
template <typename V, typename B>
absl::Status OptionOutOfRange(absl::string_view option, const V& value, const B& lo, const B& hi) {
  return absl::InvalidArgumentError(
      absl::StrCat(option, ": ", value, " is out of range (", lo, "..", hi, ")"));
}

// For bindings that take every integer option as int64 (the C API, Python): stores `value` in
// a field of type T when T can hold it. Only the field's type is checked here; its range is
// ValidateEngineOptions'.
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

}  // namespace kvwire

#endif  // KVWIRE_SRC_CORE_OPTIONS_CHECK_H_
