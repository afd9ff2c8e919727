// Environment variables set for one scope, and what was there before restored at its end (the
// tests of the KVWIRE_* readers: EngineOptions::FromEnvironment and
// ConnectorOptions::FromEnvironment).
#ifndef KVWIRE_TESTS_SUPPORT_SCOPED_ENV_H_
#define KVWIRE_TESTS_SUPPORT_SCOPED_ENV_H_

#include <cstdlib>
#include <initializer_list>
#include <stdlib.h>
#include <string>
#include <utility>
#include <vector>

namespace kvwire::testing {

class ScopedEnv {
 public:
  ScopedEnv(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (const auto& [name, value] : vars) {
      const char* old = std::getenv(name);
      saved_.push_back({name, old != nullptr, old != nullptr ? old : ""});
      setenv(name, value, 1);
    }
  }
  ~ScopedEnv() {
    for (const Saved& s : saved_) {
      if (s.had) {
        setenv(s.name.c_str(), s.value.c_str(), 1);
      } else {
        unsetenv(s.name.c_str());
      }
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  struct Saved {
    std::string name;
    bool had;
    std::string value;
  };
  std::vector<Saved> saved_;
};

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_SUPPORT_SCOPED_ENV_H_
