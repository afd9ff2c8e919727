// The one check of each options struct, as LevelDB's SanitizeOptions: Engine::Create runs
// ValidateEngineOptions, and Connector::Create runs ValidateConnectorOptions (which ends with
// ValidateEngineOptions on its engine options), before anything starts. The C API and Python
// forward their options to Create and hold no range of their own. A value out of range is
// refused with InvalidArgument naming the option and its range ("<option>: <value> is out of
// range (<lo>..<hi>)"; "request_timeout: 0 is out of range (1ms..24h)"), never clamped; options
// each in range but unworkable together name the option and the other one. A program may call
// them itself to check options before it creates anything.
#ifndef KVWIRE_OPTIONS_CHECK_H_
#define KVWIRE_OPTIONS_CHECK_H_

#include "absl/status/status.h"

#include "kvwire/engine.h"

namespace kvwire {

struct ConnectorOptions;  // kvwire/connector.h

// OK, or the first option of `options` that is out of range or inconsistent with another
// (src/core/options_check.cc).
absl::Status ValidateEngineOptions(const EngineOptions& options);

// OK, or the first connector option out of range or inconsistent with another, then the
// engine's options' check (src/connector/connector_options.cc).
absl::Status ValidateConnectorOptions(const ConnectorOptions& options);

}  // namespace kvwire

#endif  // KVWIRE_OPTIONS_CHECK_H_
