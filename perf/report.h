// kvwire-perf output: the perftest-style header block and table on stdout, and the same
// numbers as JSON and CSV files.
#ifndef KVWIRE_PERF_REPORT_H_
#define KVWIRE_PERF_REPORT_H_

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"

#include "perf/perf_options.h"
#include "perf/results.h"

namespace kvwire::perf {

// What the header block shows besides the options.
struct RunInfo {
  std::string role;              // "initiator" / "target"
  std::string peer;              // host:port of the other side
  std::string transport;         // chosen path, e.g. "shm memfd+cma", "tcp x4"
  std::string transport_reason;  // why the engine chose it
  std::string engine_name;
};

void PrintHeader(std::FILE* out, const PerfOptions& options, const RunInfo& info);
void PrintTableHeader(std::FILE* out, const PerfOptions& options);
void PrintRow(std::FILE* out, const PerfOptions& options, const Result& r);
void PrintRule(std::FILE* out);

absl::Status WriteJson(const std::string& path, const PerfOptions& options, const RunInfo& info,
                       const std::vector<Result>& results);
absl::Status WriteCsv(const std::string& path, const PerfOptions& options, const RunInfo& info,
                      const std::vector<Result>& results);

// A one-line progress report on stderr, redrawn in place; only when stderr is a terminal.
class ProgressLine {
 public:
  ProgressLine();
  bool enabled() const { return enabled_; }
  void Show(const std::string& text);
  void Clear();

 private:
  bool enabled_;
  size_t width_ = 0;
};

}  // namespace kvwire::perf

#endif  // KVWIRE_PERF_REPORT_H_
