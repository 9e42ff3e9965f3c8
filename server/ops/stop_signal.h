// SIGTERM/SIGINT for the daemon: the main thread takes them synchronously (sigtimedwait), and a
// handler writes the signal number to a pipe the main thread also checks. A handler, not only
// sigwait with the signals blocked: threads that libraries start before main (OpenBLAS's workers)
// do not have them blocked, and a process-directed signal delivered to one of them would otherwise
// take the default action and kill the daemon.
#ifndef MUOND_SERVER_OPS_STOP_SIGNAL_H_
#define MUOND_SERVER_OPS_STOP_SIGNAL_H_

#include "absl/status/status.h"

namespace muond::server {

// Installs the handler and blocks the signals in the calling thread (threads it starts from here
// on inherit the mask); ignores SIGPIPE. Call once, first thing in main.
absl::Status InstallStopSignals();
// Blocks until SIGTERM or SIGINT arrived (also one that arrived earlier); returns it. Call from
// the thread that called InstallStopSignals.
int WaitForStopSignal();

}  // namespace muond::server

#endif  // MUOND_SERVER_OPS_STOP_SIGNAL_H_
