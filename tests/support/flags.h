// The command lines of the test drivers (peers, hostile targets): `--key=value` arguments only,
// each key declared with where its value goes. An argument without `--` or `=`, an unknown key
// or a value that does not parse is an error naming that argument, so a test that passes a
// driver a wrong flag fails at once instead of running with a default.
#ifndef KVWIRE_TESTS_SUPPORT_FLAGS_H_
#define KVWIRE_TESTS_SUPPORT_FLAGS_H_

#include <functional>
#include <map>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvwire::testing {

class FlagParser {
 public:
  // Sets `out` from a value, false if the value is not one.
  using Setter = std::function<bool(const std::string& value)>;

  FlagParser& String(const std::string& name, std::string* out) {
    return Custom(name, [out](const std::string& v) {
      *out = v;
      return true;
    });
  }
  // A decimal integer that fits T.
  template <typename T>
  FlagParser& Int(const std::string& name, T* out) {
    static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>);
    return Custom(name, [out](const std::string& v) { return absl::SimpleAtoi(v, out); });
  }
  // A hexadecimal integer, with or without 0x (an address).
  FlagParser& HexInt(const std::string& name, uint64_t* out) {
    return Custom(name, [out](const std::string& v) { return absl::SimpleHexAtoi(v, out); });
  }
  // 1/0, true/false, yes/no.
  FlagParser& Bool(const std::string& name, bool* out) {
    return Custom(name, [out](const std::string& v) { return absl::SimpleAtob(v, out); });
  }
  FlagParser& Custom(const std::string& name, Setter set) {
    setters_[name] = std::move(set);
    return *this;
  }

  // Parses argv[first, argc); a key given twice keeps the last value.
  absl::Status Parse(int argc, char** argv, int first = 1) const {
    for (int i = first; i < argc; ++i) {
      const std::string arg = argv[i];
      const size_t eq = arg.find('=');
      if (!absl::StartsWith(arg, "--") || eq == std::string::npos) {
        return absl::InvalidArgumentError(
            absl::StrCat("bad argument ", arg, " (want --key=value)"));
      }
      const std::string key = arg.substr(2, eq - 2);
      auto it = setters_.find(key);
      if (it == setters_.end())
        return absl::InvalidArgumentError(absl::StrCat("unknown flag --", key));
      if (!it->second(arg.substr(eq + 1))) {
        return absl::InvalidArgumentError(absl::StrCat("bad value in ", arg));
      }
    }
    return absl::OkStatus();
  }

 private:
  std::map<std::string, Setter> setters_;
};

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_SUPPORT_FLAGS_H_
