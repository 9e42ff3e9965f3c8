// Linked into every executable and shared library of the ASan + UBSan build
// (MUOND_SANITIZE=address): sends UBSan's reports to the log_path of $UBSAN_OPTIONS, with
// ".ubsan" appended (files <log_path>.ubsan.<pid>), as tests/sanitize/run.sh expects of every
// process, the daemons the tests start included.
//
// Why it is needed: gcc links -fsanitize=address,undefined against two runtimes, libasan.so and
// libubsan.so, each with its own copy of the report file. libubsan applies log_path by calling
// __sanitizer_set_report_path, an exported symbol that libasan (first in the lookup order) also
// defines, so the call sets ASan's report file and libubsan keeps writing to stderr: a UBSan report
// of a daemon ended in its captured stderr, deleted with the test's directory. dlsym on libubsan's
// own handle finds its definition. ASan's reports keep going to log_path itself.
//
// Runs once per image at load time, before main; needs no lock (nothing else runs yet).
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>

namespace {

// The value of log_path in `options` (flags separated by ':'), copied into `out`; false when there
// is none or it does not fit.
bool LogPathOf(const char* options, char* out, size_t size) {
  for (const char* p = options; p != nullptr && *p != '\0';) {
    const char* end = std::strchr(p, ':');
    const size_t len = end == nullptr ? std::strlen(p) : static_cast<size_t>(end - p);
    constexpr char kKey[] = "log_path=";
    constexpr size_t kKeyLen = sizeof(kKey) - 1;
    if (len > kKeyLen && std::strncmp(p, kKey, kKeyLen) == 0 && len - kKeyLen < size) {
      std::memcpy(out, p + kKeyLen, len - kKeyLen);
      out[len - kKeyLen] = '\0';
      return true;
    }
    p = end == nullptr ? nullptr : end + 1;
  }
  return false;
}

__attribute__((constructor)) void RouteUbsanReportsToLogPath() {
  // Static: nothing is allocated this early.
  static char path[4096];
  constexpr char kSuffix[] = ".ubsan";
  if (!LogPathOf(std::getenv("UBSAN_OPTIONS"), path, sizeof(path) - sizeof(kSuffix))) return;
  if (std::strcmp(path, "stderr") == 0 || std::strcmp(path, "stdout") == 0) return;
  std::strcat(path, kSuffix);
  void* ubsan = ::dlopen("libubsan.so.1", RTLD_LAZY | RTLD_NOLOAD);
  if (ubsan == nullptr) return;
  using SetReportPath = void (*)(const char*);
  auto set = reinterpret_cast<SetReportPath>(::dlsym(ubsan, "__sanitizer_set_report_path"));
  if (set != nullptr) set(path);
  ::dlclose(ubsan);
}

}  // namespace
