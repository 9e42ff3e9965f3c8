// Test helper: the receiving end of systemd's notification protocol. Binds an AF_UNIX datagram
// socket (a path in a private temporary directory, or an abstract name) the way systemd does for
// $NOTIFY_SOCKET, and receives the datagrams a process sends there. Not thread-safe.
#ifndef MUOND_TESTS_DEPLOY_NOTIFY_LISTENER_H_
#define MUOND_TESTS_DEPLOY_NOTIFY_LISTENER_H_

#include <optional>
#include <string>

namespace muond::deploy_test {

class NotifyListener {
 public:
  enum class Kind { kPath, kAbstract };
  // Binds at once; check ok() (a failure is reported with ADD_FAILURE).
  explicit NotifyListener(Kind kind = Kind::kPath);
  ~NotifyListener();
  NotifyListener(const NotifyListener&) = delete;
  NotifyListener& operator=(const NotifyListener&) = delete;

  bool ok() const { return fd_ >= 0; }
  // The value for $NOTIFY_SOCKET: "/tmp/.../notify" or "@muond-test-...".
  const std::string& address() const { return address_; }
  // The next datagram, or nullopt when none arrives within `timeout_seconds` (bounded poll).
  std::optional<std::string> Receive(double timeout_seconds);

 private:
  int fd_ = -1;
  std::string dir_;
  std::string address_;
};

}  // namespace muond::deploy_test

#endif  // MUOND_TESTS_DEPLOY_NOTIFY_LISTENER_H_
