// A transport that lives only in tests: the proof that adding a transport is one folder and
// one line. It is registered from outside the engine (AddPipeTransport: its factory in
// EngineOptions::extra_transports, its options in EngineOptions::transports) and routed like
// the built-ins, from its Capabilities, or forced by its name (EngineOptions::transport =
// "pipe"); nothing under src/core names it.
//
// Data path: one Unix stream socket (abstract namespace, so same host only) per peer and
// direction. The initiator sends each op as a fixed header (plus the payload of a WRITE); the
// target validates it with TargetHooks::ResolveIncoming, copies with memcpy-like socket I/O,
// counts WRITE arrivals (TargetHooks::OnWriteArrived) and answers with a status (plus the
// data of a READ). Simple and slow on purpose: one lane, one op at a time.
#ifndef KVWIRE_TESTS_TRANSPORT_PIPE_PIPE_TRANSPORT_H_
#define KVWIRE_TESTS_TRANSPORT_PIPE_PIPE_TRANSPORT_H_

#include "kvwire/engine.h"

namespace kvwire::testing {

// Name of the transport (Capabilities::name, the Hello's endpoint kind).
inline constexpr char kPipeTransportName[] = "pipe";

// Its options, carried and validated like a built-in transport's
// (EngineOptions::transports["pipe"]; by name: transports.Set("pipe", "rank", "50")).
struct PipeOptions : TransportOptionsOf<PipeOptions> {
  static constexpr char kName[] = "pipe";
  // Capabilities::rank. The default (5) is better than every built-in's, so an engine that
  // registers it uses it for every peer that offers it too ("auto"). 1..1000.
  int rank = 5;

  absl::Status Validate() const override;
  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::Status Get(absl::string_view key, std::string* value) const override;
  std::vector<std::string> Keys() const override;
};

// Creates the transport with the engine's PipeOptions (defaults when it has none). It reaches
// every region (the target validates).
TransportFactory PipeTransportFactory();

// Registers it: the factory, and PipeOptions (so that "pipe" is a name the engine knows and
// may be forced).
void AddPipeTransport(EngineOptions* options);

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_TRANSPORT_PIPE_PIPE_TRANSPORT_H_
