// The one check of kvwire::EngineOptions, as LevelDB's SanitizeOptions: Engine::Create runs it
// before anything starts, and the C API and Python forward their options to Create, holding no
// range of their own. A value out of range is refused with an error naming the option and its
// range ("<option>: <value> is out of range (<lo>..<hi>)", src/util/option_range.h), never
// clamped.
#ifndef KVWIRE_SRC_CORE_OPTIONS_CHECK_H_
#define KVWIRE_SRC_CORE_OPTIONS_CHECK_H_

#include "absl/status/status.h"

#include "kvwire/engine.h"

namespace kvwire {

// OK, or the first option of `options` that is out of range or inconsistent with another.
absl::Status ValidateEngineOptions(const EngineOptions& options);

}  // namespace kvwire

#endif  // KVWIRE_SRC_CORE_OPTIONS_CHECK_H_
