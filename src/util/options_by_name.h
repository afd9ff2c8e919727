// The by-name access every transport's options struct gives (TransportOptions::Set, Get and
// Keys, kvwire/transport_options.h), written once: KVWIRE_OPTIONS_BY_NAME(TcpOptions) in
// transport/tcp/tcp_options.cc defines TcpOptions::Set, ::Get and ::Keys over the field list
// that file declares before it, `template <typename Self, typename F> void Fields(Self& o,
// F&& f)` calling f("key", o.field) for each field in the struct's order. A macro because
// the three are member functions of each struct, declared in its public header.
#ifndef KVWIRE_SRC_UTIL_OPTIONS_BY_NAME_H_
#define KVWIRE_SRC_UTIL_OPTIONS_BY_NAME_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

#include "src/util/option_range.h"

#define KVWIRE_OPTIONS_BY_NAME(Type)                                                             \
  absl::Status Type::Set(absl::string_view key, absl::string_view value) {                       \
    return ::kvwire::SetOptionByName(kName, key, value, [this](auto&& f) { Fields(*this, f); }); \
  }                                                                                              \
  absl::Status Type::Get(absl::string_view key, std::string* value) const {                      \
    return ::kvwire::GetOptionByName(kName, key, value, [this](auto&& f) { Fields(*this, f); }); \
  }                                                                                              \
  std::vector<std::string> Type::Keys() const {                                                  \
    return ::kvwire::OptionKeys([this](auto&& f) { Fields(*this, f); });                         \
  }

#endif  // KVWIRE_SRC_UTIL_OPTIONS_BY_NAME_H_
