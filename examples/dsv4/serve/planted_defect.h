// A sanitizer report planted on purpose, for the tests that prove a server's report fails the
// test that started it (tests/dsv4/serve/e2e_test.cc, ServerEnd.*): with
// KVWIRE_DSV4_PLANT_SANITIZER_REPORT=1 in its environment, a kvwire-dsv4 built with TSan
// commits a real data race (ASan: a heap overflow) as it exits, after serving normally. The
// sanitizer then makes the process exit non-zero. Builds without a sanitizer do nothing.
#ifndef KVWIRE_EXAMPLES_DSV4_SERVE_PLANTED_DEFECT_H_
#define KVWIRE_EXAMPLES_DSV4_SERVE_PLANTED_DEFECT_H_

namespace dsv4::serve {

// Commits the defect now when the environment asks for it; returns `exit_code` unchanged.
int CommitPlantedDefectIfAsked(int exit_code);

}  // namespace dsv4::serve

#endif  // KVWIRE_EXAMPLES_DSV4_SERVE_PLANTED_DEFECT_H_
