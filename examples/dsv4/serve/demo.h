// `kvwire-dsv4 demo` (what `make demo` runs): prefill, decode and router processes on
// loopback, a few prompts in read and write mode over tcp and shm, the generated text,
// per-request transfer statistics, and the check against single-process generation.
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_DEMO_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_DEMO_H_

#include <string>

#include "examples/dsv4/serve/flags.h"

namespace dsv4::serve {

// Returns the process exit code (non-zero when a request failed or did not match).
int RunDemo(const Flags& flags, const std::string& argv0);

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_DEMO_H_
