// Command-line flags of the kvwire-dsv4 subcommands: "--name value", "--name=value", and
// bare "--name" for booleans. Unknown flags are errors naming the flag.
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_FLAGS_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_FLAGS_H_

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace dsv4::serve {

class Flags {
 public:
  // `known` lists the accepted flag names, `bools` those that take no value.
  static absl::StatusOr<Flags> Parse(const std::vector<std::string>& args,
                                     const std::set<std::string>& known,
                                     const std::set<std::string>& bools = {});

  bool Has(const std::string& name) const { return values_.count(name) != 0; }
  std::string Get(const std::string& name, const std::string& fallback = "") const;
  // Every value of a repeated flag, in order.
  std::vector<std::string> GetAll(const std::string& name) const;
  absl::StatusOr<int64_t> GetInt(const std::string& name, int64_t fallback) const;
  absl::StatusOr<double> GetDouble(const std::string& name, double fallback) const;
  absl::Status Require(const std::vector<std::string>& names) const;

 private:
  std::multimap<std::string, std::string> values_;
};

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_FLAGS_H_
