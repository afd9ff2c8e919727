// The transports every engine tries to create: the one list a new built-in transport is
// added to. Adding one is a folder (transport/<name>/: a Transport subclass declaring its
// Capabilities, and a factory) and one line in BuiltinTransports() (plus its folder's
// kvwire_component line in CMakeLists.txt); the core routes it from its Capabilities and never
// names it. A transport from outside the library registers with one line instead:
// EngineOptions::extra_transports (tests/transport/pipe is one).
#ifndef KVWIRE_TRANSPORT_BUILTIN_TRANSPORTS_H_
#define KVWIRE_TRANSPORT_BUILTIN_TRANSPORTS_H_

#include <vector>

#include "kvwire/engine.h"

namespace kvwire::transport {

std::vector<TransportFactory> BuiltinTransports();

// The statistics every built-in transport declares, at zero: an engine lists them also for a
// transport that is not running on this machine (rdma without a device), so its stats keep
// their shape.
std::vector<TransportStat> BuiltinTransportStats();

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_BUILTIN_TRANSPORTS_H_
