// The rows of a shared table of bad option values (tests/support/bad_engine_options.tsv,
// bad_connector_options.tsv): what C++, C and Python must each refuse with the same message.
// Lines starting with '#' and empty lines are comments; a row is four tab-separated columns.
#ifndef KVWIRE_TESTS_SUPPORT_BAD_OPTION_TABLE_H_
#define KVWIRE_TESTS_SUPPORT_BAD_OPTION_TABLE_H_

#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_split.h"

namespace kvwire::testing {

struct BadOption {
  std::string option;
  std::string kind;
  std::string value;
  std::string error;  // the message after the status code
};

// The table's rows; a row without four columns is a test failure (and skipped).
inline std::vector<BadOption> ReadBadOptionTable(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot read " << path;
  std::vector<BadOption> rows;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::vector<std::string> f = absl::StrSplit(line, '\t');
    if (f.size() != 4) {
      ADD_FAILURE() << path << ": bad row: " << line;
      continue;
    }
    rows.push_back(BadOption{f[0], f[1], f[2], f[3]});
  }
  return rows;
}

}  // namespace kvwire::testing

#endif  // KVWIRE_TESTS_SUPPORT_BAD_OPTION_TABLE_H_
