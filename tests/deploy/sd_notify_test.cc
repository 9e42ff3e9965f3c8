// server/ops/sd_notify.h against a socket the test binds, as systemd would: the exact datagrams for a
// path and an abstract $NOTIFY_SOCKET, the errors, $WATCHDOG_USEC/$WATCHDOG_PID parsing, and the
// watchdog thread's pings (count, spacing at half the interval, prompt stop).
#include "server/ops/sd_notify.h"

#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/deploy/notify_listener.h"

namespace muond::server {
namespace {

using deploy_test::NotifyListener;
using Clock = std::chrono::steady_clock;

// Sets (or unsets, for nullopt) an environment variable for the scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = getenv(name)) old_ = old;
    if (value) {
      setenv(name, value->c_str(), 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(SdNotifyTest, WithoutNotifySocketNothingIsSent) {
  ScopedEnv env("NOTIFY_SOCKET", std::nullopt);
  EXPECT_TRUE(SdNotify("READY=1").ok());
  ScopedEnv empty("NOTIFY_SOCKET", "");
  EXPECT_TRUE(SdNotify("READY=1").ok());
}

TEST(SdNotifyTest, SendsTheStateToAPathSocket) {
  NotifyListener listener(NotifyListener::Kind::kPath);
  ASSERT_TRUE(listener.ok());
  ScopedEnv env("NOTIFY_SOCKET", listener.address());
  ASSERT_TRUE(SdNotify("READY=1\nSTATUS=serving on unix:///run/muond/muond.sock").ok());
  EXPECT_EQ(listener.Receive(5), "READY=1\nSTATUS=serving on unix:///run/muond/muond.sock");
  ASSERT_TRUE(SdNotify("STOPPING=1").ok());
  EXPECT_EQ(listener.Receive(5), "STOPPING=1");
}

TEST(SdNotifyTest, SendsTheStateToAnAbstractSocket) {
  NotifyListener listener(NotifyListener::Kind::kAbstract);
  ASSERT_TRUE(listener.ok());
  ASSERT_EQ(listener.address()[0], '@');
  ScopedEnv env("NOTIFY_SOCKET", listener.address());
  ASSERT_TRUE(SdNotify("READY=1").ok());
  EXPECT_EQ(listener.Receive(5), "READY=1");
}

TEST(SdNotifyTest, ReportsBadAddressesAndAbsentListeners) {
  {
    ScopedEnv env("NOTIFY_SOCKET", "relative/notify");
    EXPECT_EQ(SdNotify("READY=1").code(), absl::StatusCode::kInvalidArgument);
  }
  {
    ScopedEnv env("NOTIFY_SOCKET", "/" + std::string(200, 'x'));
    EXPECT_EQ(SdNotify("READY=1").code(), absl::StatusCode::kInvalidArgument);
  }
  {
    ScopedEnv env("NOTIFY_SOCKET", absl::StrCat("/tmp/muond-no-such-socket-", getpid()));
    absl::Status s = SdNotify("READY=1");
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_NE(s.message().find("No such file"), absl::string_view::npos) << s;
  }
}

TEST(SdNotifyTest, WatchdogIntervalFollowsTheEnvironment) {
  {
    ScopedEnv usec("WATCHDOG_USEC", std::nullopt);
    EXPECT_EQ(SdWatchdogInterval(), absl::ZeroDuration());
  }
  ScopedEnv pid("WATCHDOG_PID", std::nullopt);
  {
    ScopedEnv usec("WATCHDOG_USEC", "30000000");
    EXPECT_EQ(SdWatchdogInterval(), absl::Seconds(30));
  }
  for (const char* bad : {"", "0", "-5", "12abc"}) {
    ScopedEnv usec("WATCHDOG_USEC", bad);
    EXPECT_EQ(SdWatchdogInterval(), absl::ZeroDuration()) << bad;
  }
  ScopedEnv usec("WATCHDOG_USEC", "200000");
  {
    ScopedEnv own("WATCHDOG_PID", std::to_string(getpid()));
    EXPECT_EQ(SdWatchdogInterval(), absl::Milliseconds(200));
  }
  {
    // The variables were meant for another process (e.g. inherited from a parent service).
    ScopedEnv other("WATCHDOG_PID", std::to_string(getpid() + 1));
    EXPECT_EQ(SdWatchdogInterval(), absl::ZeroDuration());
  }
}

TEST(SdNotifyTest, WatchdogPingsAtHalfTheInterval) {
  NotifyListener listener;
  ASSERT_TRUE(listener.ok());
  ScopedEnv env("NOTIFY_SOCKET", listener.address());
  ScopedEnv usec("WATCHDOG_USEC", "100000");  // 100 ms: pings every 50 ms
  ScopedEnv pid("WATCHDOG_PID", std::nullopt);
  Clock::time_point first, last;
  {
    SdWatchdog watchdog;  // SdWatchdogInterval() from the environment
    ASSERT_TRUE(watchdog.active());
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(listener.Receive(5), "WATCHDOG=1") << "ping " << i;
      (i == 0 ? first : last) = Clock::now();
    }
  }
  // Pings 2..4 come at least 3 periods (150 ms) after the first, less scheduling jitter.
  const double ms = std::chrono::duration<double, std::milli>(last - first).count();
  EXPECT_GE(ms, 140);
  EXPECT_LT(ms, 3000);
  // Stopped: nothing more arrives (beyond a ping that may have been in flight at destruction).
  if (listener.Receive(0.2).has_value()) {
    EXPECT_FALSE(listener.Receive(0.2).has_value());
  }
}

TEST(SdNotifyTest, WatchdogStopsPromptlyAndIsOffWithoutAnInterval) {
  NotifyListener listener;
  ASSERT_TRUE(listener.ok());
  ScopedEnv env("NOTIFY_SOCKET", listener.address());
  const Clock::time_point start = Clock::now();
  {
    SdWatchdog watchdog(absl::Seconds(60));  // next ping would be in 30 s
    EXPECT_EQ(listener.Receive(5), "WATCHDOG=1");
  }
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 5);
  SdWatchdog off(absl::ZeroDuration());
  EXPECT_FALSE(off.active());
  EXPECT_FALSE(listener.Receive(0.1).has_value());
}

}  // namespace
}  // namespace muond::server
