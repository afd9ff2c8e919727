// Each transport's own options, reached by the transport's name: EngineOptions::transports
// holds one TransportOptions per transport ("tcp", "shm", "rdma", and any outside transport
// that puts its own), each with its own Validate() (called by Engine::Create's one validator)
// and a by-name setter (Set) that the C ABI, Python and EngineOptions::FromEnvironment use
// without knowing the option: they hold no option and no range of their own.
//
// A transport's factory reads its options from TransportContext::options (e.g.
// `context.options->transports.Get<TcpOptions>()`); an outside transport does the same with
// its own type (tests/transport/pipe/pipe_transport.h's PipeOptions).
#ifndef KVWIRE_TRANSPORT_OPTIONS_H_
#define KVWIRE_TRANSPORT_OPTIONS_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvwire {

// The options of one transport. Errors name the option as "<transport>.<key>" (e.g.
// "tcp.io_poll: 1s is out of range (0..10ms)"), in the format of every option error.
class TransportOptions {
 public:
  virtual ~TransportOptions() = default;
  // The transport's name (Capabilities::name): the key in EngineOptions::transports.
  virtual absl::string_view transport() const = 0;
  virtual std::unique_ptr<TransportOptions> Clone() const = 0;
  // OK, or the first option out of range (or inconsistent with another).
  virtual absl::Status Validate() const = 0;
  // Sets option `key` from text: integers in decimal, durations as "20us", "5s", "1.5ms",
  // booleans as 1/0/true/false, lists comma-separated. Refuses an unknown key (naming the
  // known ones) or text that does not parse as the option's type; the range is Validate's.
  virtual absl::Status Set(absl::string_view key, absl::string_view value) = 0;
  // The option's current value as text Set accepts; NotFound for an unknown key.
  virtual absl::Status Get(absl::string_view key, std::string* value) const = 0;
  // The keys Set accepts, in declaration order.
  virtual std::vector<std::string> Keys() const = 0;
};

// Implements transport() and Clone() for an options struct T with `static constexpr char
// kName[]` (CRTP): `struct MyOptions : TransportOptionsOf<MyOptions> { ... }`.
template <typename T>
class TransportOptionsOf : public TransportOptions {
 public:
  absl::string_view transport() const override { return T::kName; }
  std::unique_ptr<TransportOptions> Clone() const override {
    return std::make_unique<T>(static_cast<const T&>(*this));
  }
};

// Transport name -> its options; copies deep. Built with the built-in transports' defaults
// (tcp, shm, rdma); an outside transport adds its own with Put.
class TransportOptionsMap {
 public:
  TransportOptionsMap();  // the built-in transports' defaults (transport/builtin_transports.cc)
  TransportOptionsMap(const TransportOptionsMap& other);
  TransportOptionsMap& operator=(const TransportOptionsMap& other);
  TransportOptionsMap(TransportOptionsMap&&) noexcept = default;
  TransportOptionsMap& operator=(TransportOptionsMap&&) noexcept = default;
  ~TransportOptionsMap();

  // The options of transport T (T::kName), added with T's defaults when absent (or when
  // another type sits under that name).
  template <typename T>
  T& Get() {
    if (auto* found = dynamic_cast<T*>(Find(T::kName))) return *found;
    auto fresh = std::make_unique<T>();
    T& ref = *fresh;
    Put(std::move(fresh));
    return ref;
  }
  // Read-only: T's defaults when absent.
  template <typename T>
  const T& Get() const {
    static const T kDefaults;
    const auto* found = dynamic_cast<const T*>(Find(T::kName));
    return found != nullptr ? *found : kDefaults;
  }

  TransportOptions* Find(absl::string_view transport);
  const TransportOptions* Find(absl::string_view transport) const;
  // Adds or replaces the options of options->transport().
  void Put(std::unique_ptr<TransportOptions> options);

  // Find(transport)->Set(key, value); InvalidArgument naming the known transports when none
  // has options named `transport`.
  absl::Status Set(absl::string_view transport, absl::string_view key, absl::string_view value);
  // Every transport's Validate(), in name order; the first error.
  absl::Status Validate() const;
  // The names of the transports with options, in order.
  std::vector<std::string> Names() const;

 private:
  std::map<std::string, std::unique_ptr<TransportOptions>, std::less<>> map_;
};

}  // namespace kvwire

#endif  // KVWIRE_TRANSPORT_OPTIONS_H_
