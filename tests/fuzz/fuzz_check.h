// FUZZ_CHECK: a property a fuzz target asserts about the code under test. On failure it prints
// the condition and what the harness says, then aborts, so libFuzzer saves the input and a replay
// of it fails.
#ifndef MUOND_TESTS_FUZZ_FUZZ_CHECK_H_
#define MUOND_TESTS_FUZZ_FUZZ_CHECK_H_

#include <cstdio>
#include <cstdlib>
#include <string>

#define FUZZ_CHECK(cond, what)                                                              \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK(%s) failed: %s\n", __FILE__, __LINE__, #cond, \
                   std::string(what).c_str());                                              \
      std::abort();                                                                         \
    }                                                                                       \
  } while (0)

#endif  // MUOND_TESTS_FUZZ_FUZZ_CHECK_H_
