#include "server/ops/stop_signal.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>

#include "absl/strings/str_cat.h"

namespace muond::server {
namespace {

int stop_pipe[2] = {-1, -1};

extern "C" void OnStopSignal(int sig) {
  const int saved = errno;
  const unsigned char b = static_cast<unsigned char>(sig);
  [[maybe_unused]] const ssize_t n = ::write(stop_pipe[1], &b, 1);
  errno = saved;
}

sigset_t StopSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  return signals;
}

}  // namespace

absl::Status InstallStopSignals() {
  if (::pipe2(stop_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    return absl::InternalError(absl::StrCat("pipe2: ", std::strerror(errno)));
  }
  struct sigaction stop_action = {};
  stop_action.sa_handler = OnStopSignal;
  sigemptyset(&stop_action.sa_mask);
  stop_action.sa_flags = SA_RESTART;
  ::sigaction(SIGTERM, &stop_action, nullptr);
  ::sigaction(SIGINT, &stop_action, nullptr);
  const sigset_t signals = StopSignals();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
  return absl::OkStatus();
}

int WaitForStopSignal() {
  // The main thread keeps the signals blocked and takes them synchronously (sigtimedwait: while it
  // waits it is eligible, and as the thread group leader the kernel offers it a process-directed
  // signal first). The handler and its pipe catch one that a thread started before main took
  // (it has them unblocked), checked between waits. Under ThreadSanitizer this is also what makes
  // SIGTERM work at all: TSan defers a handler until its thread enters an intercepted call, which
  // an OpenBLAS worker parked on a futex never does.
  const sigset_t signals = StopSignals();
  while (true) {
    const timespec wait = {0, 100 * 1000 * 1000};
    const int sig = ::sigtimedwait(&signals, nullptr, &wait);
    if (sig > 0) return sig;
    unsigned char b = 0;
    if (::read(stop_pipe[0], &b, 1) == 1) return b;
  }
}

}  // namespace muond::server
