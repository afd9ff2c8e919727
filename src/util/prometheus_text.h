// Pieces of the Prometheus text exposition format (version 0.0.4) shared by the engine's and
// the connector's /metrics output.
#ifndef KVWIRE_UTIL_PROMETHEUS_TEXT_H_
#define KVWIRE_UTIL_PROMETHEUS_TEXT_H_

#include <string>
#include <string_view>

namespace kvwire {

// A label value escaped for use between double quotes: backslash, double quote and line feed
// become \\, \" and \n, as the format requires (JSON's \uXXXX escapes are not valid there).
std::string PrometheusLabelValue(std::string_view value);

// A sample value or bucket bound written with enough digits to read back the same double
// (integers below 2^53 come out exactly, without an exponent).
std::string PrometheusNumber(double value);

}  // namespace kvwire

#endif  // KVWIRE_UTIL_PROMETHEUS_TEXT_H_
