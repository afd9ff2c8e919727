// Escapes a string for use inside a JSON string literal (also fine for Prometheus labels).
#ifndef KVWIRE_UTIL_JSON_ESCAPE_H_
#define KVWIRE_UTIL_JSON_ESCAPE_H_

#include <string>

namespace kvwire {

// Backslash-escapes quotes and backslashes and writes control characters as \uXXXX; the
// result has no surrounding quotes.
std::string JsonEscape(const std::string& s);

}  // namespace kvwire

#endif  // KVWIRE_UTIL_JSON_ESCAPE_H_
