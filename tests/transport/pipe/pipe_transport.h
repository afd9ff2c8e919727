// A transport that lives only in tests: the proof that adding a transport is one folder and
// one line. It is registered from outside the engine (EngineOptions::extra_transports, the
// one line) and routed like the built-ins, from its Capabilities; nothing under src/core
// names it.
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

// Its rank (5) is better than every built-in's, so an engine that registers it uses it for
// every peer that offers it too (kAuto); it reaches every region (the target validates).
TransportFactory PipeTransportFactory();

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_TRANSPORT_PIPE_PIPE_TRANSPORT_H_
