// The one format of an option out of range, and storing an int64 a binding was given into an
// option field of another integer type. Engine::Create's validator (src/core/options_check.h)
// reports ranges with OptionOutOfRange; the C API and Python use StoreOption, which checks only
// what the field's type can hold (the option's range is the validator's).
#ifndef KVWIRE_SRC_UTIL_OPTION_RANGE_H_
#define KVWIRE_SRC_UTIL_OPTION_RANGE_H_

#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

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

}  // namespace kvwire

#endif  // KVWIRE_SRC_UTIL_OPTION_RANGE_H_
