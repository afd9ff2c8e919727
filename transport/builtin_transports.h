// The transports every engine tries to create: the one list a new built-in transport is
// added to (one line in builtin_transports.cc). EngineOptions::extra_transports adds more.
#ifndef KVWIRE_TRANSPORT_BUILTIN_TRANSPORTS_H_
#define KVWIRE_TRANSPORT_BUILTIN_TRANSPORTS_H_

#include <vector>

#include "kvwire/engine.h"

namespace kvwire::transport {

std::vector<TransportFactory> BuiltinTransports();

}  // namespace kvwire::transport

#endif  // KVWIRE_TRANSPORT_BUILTIN_TRANSPORTS_H_
