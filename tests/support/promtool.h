// `promtool check metrics` (Debian's prometheus package, installed by scripts/install-deps.sh)
// on a Prometheus text exposition: the format, the types, the _total/_seconds naming and the
// HELP lines as Prometheus's own linter sees them. A missing promtool is an error, not a skip.
#ifndef KVWIRE_TESTS_SUPPORT_PROMTOOL_H_
#define KVWIRE_TESTS_SUPPORT_PROMTOOL_H_

#include <sys/wait.h>

#include <stdio.h>
#include <stdlib.h>
#include <string>
#include <unistd.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvwire::testing {

// OK when promtool accepts `text` without a problem; otherwise its findings.
inline absl::Status PromtoolCheckMetrics(const std::string& text) {
  if (system("command -v promtool >/dev/null 2>&1") != 0) {
    return absl::FailedPreconditionError(
        "promtool is not installed: it comes with Debian's prometheus package "
        "(scripts/install-deps.sh installs it)");
  }
  char path[] = "/tmp/kvwire-metrics-XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) return absl::InternalError("mkstemp failed");
  size_t written = 0;
  while (written < text.size()) {
    const ssize_t n = write(fd, text.data() + written, text.size() - written);
    if (n <= 0) break;
    written += static_cast<size_t>(n);
  }
  close(fd);
  if (written != text.size()) {
    unlink(path);
    return absl::InternalError("could not write the metrics file");
  }
  // stdin: promtool reads the exposition there; its findings go to stdout/stderr.
  FILE* p = popen(absl::StrCat("promtool check metrics < ", path, " 2>&1").c_str(), "r");
  std::string output;
  if (p != nullptr) {
    char buffer[4096];
    size_t n;
    while ((n = fread(buffer, 1, sizeof(buffer), p)) > 0) output.append(buffer, n);
  }
  const int status = p != nullptr ? pclose(p) : -1;
  unlink(path);
  if (status != 0 || !output.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("promtool check metrics (exit status ",
                                                      WIFEXITED(status) ? WEXITSTATUS(status) : -1,
                                                      "):\n", output, "--- input ---\n", text));
  }
  return absl::OkStatus();
}

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_SUPPORT_PROMTOOL_H_
