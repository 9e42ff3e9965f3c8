// Checks, in the ASan + UBSan build, that a UBSan report of a child process lands in the file that
// UBSAN_OPTIONS' log_path names (tests/sanitize/ubsan_log_path.cc) and not on its stderr: the lane
// finds the reports of the daemons the tests start only there. Runs itself as the child, with
// "overflow", to commit a signed overflow.
#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

namespace {

int Overflow(int argc) {
  volatile int big = INT_MAX;
  const int sum = big + argc;  // UB on purpose: the report this test looks for.
  std::printf("%d\n", sum);
  return 0;
}

// Names of the files in `dir`, separated by spaces.
std::string FilesIn(const std::string& dir) {
  std::string names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      if (e->d_name[0] != '.') names += std::string(e->d_name) + " ";
    }
    ::closedir(d);
  }
  return names;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "overflow") == 0) return Overflow(argc);
  char dir[] = "/tmp/muond-ubsan-XXXXXX";
  if (::mkdtemp(dir) == nullptr) return std::perror("mkdtemp"), 1;
  const std::string options = std::string("log_path=") + dir + "/report:halt_on_error=1";
  const std::string err_path = std::string(dir) + "/stderr";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setenv("UBSAN_OPTIONS", options.c_str(), 1);
    if (std::freopen(err_path.c_str(), "w", stderr) == nullptr) ::_exit(126);
    ::execl("/proc/self/exe", argv[0], "overflow", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  const std::string report_path = std::string(dir) + "/report.ubsan." + std::to_string(pid);
  std::stringstream report, err;
  report << std::ifstream(report_path).rdbuf();
  err << std::ifstream(err_path).rdbuf();
  const std::string files = FilesIn(dir);
  std::system((std::string("rm -rf ") + dir).c_str());
  const bool exited_1 = WIFEXITED(status) && WEXITSTATUS(status) == 1;
  const bool in_report = report.str().find("runtime error: signed integer overflow") !=
                         std::string::npos;
  const bool in_stderr = err.str().find("runtime error") != std::string::npos;
  std::printf("child exit %d, files: %s\nreport: %s\nstderr: %s\n",
              WIFEXITED(status) ? WEXITSTATUS(status) : -1, files.c_str(), report.str().c_str(),
              err.str().c_str());
  if (!exited_1 || !in_report || in_stderr) {
    std::printf("FAIL: expected exit 1 and the UBSan report in %s only\n", report_path.c_str());
    return 1;
  }
  std::printf("PASS\n");
  return 0;
}
