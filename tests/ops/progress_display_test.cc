// The forms muonctl draws progress in (client/progress_display.h): the plain line when stderr is
// not a terminal, the bar on a terminal, and ProgressDisplay's rules (plain lines at most once a
// second, the last one always).
#include "client/progress_display.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "gtest/gtest.h"

namespace muond::client {
namespace {

TEST(ProgressLineTest, PlainForm) {
  EXPECT_EQ(PlainProgressLine("save job j", "bytes", 1048576, 4194304, 2.0, false),
            "progress: save job j: 1048576/4194304 bytes (25.0%), 512.0 KiB/s, 0:06 left");
  EXPECT_EQ(PlainProgressLine("save job j", "bytes", 4194304, 4194304, 61.4, true),
            "progress: save job j: 4194304/4194304 bytes (100.0%), 66.7 KiB/s, done in 1:01");
  // Nothing done yet: rate and time left unknown.
  EXPECT_EQ(PlainProgressLine("load job j", "bytes", 0, 100, 0.5, false),
            "progress: load job j: 0/100 bytes (0.0%), -, - left");
  // More than the total (a generation read twice) is shown as the total.
  EXPECT_EQ(PlainProgressLine("load job j", "bytes", 150, 100, 1.0, true),
            "progress: load job j: 100/100 bytes (100.0%), 100 B/s, done in 0:01");
  EXPECT_EQ(PlainProgressLine("training", "steps", 10, 40, 5.0, false),
            "progress: training: 10/40 steps (25.0%), 2.00 steps/s, 0:15 left");
  EXPECT_EQ(PlainProgressLine("training", "steps", 1, 3601, 1.0, false),
            "progress: training: 1/3601 steps (0.0%), 1.00 steps/s, 1:00:00 left");
}

TEST(ProgressLineTest, TerminalForm) {
  EXPECT_EQ(TerminalProgressLine("save job j", "bytes", 2097152, 4194304, 1.0, 10),
            "save job j  [#####-----]   50.0%  2.0 MiB / 4.0 MiB  2.0 MiB/s  0:01 left");
  EXPECT_EQ(TerminalProgressLine("save job j", "bytes", 4194304, 4194304, 2.0, 4),
            "save job j  [####]  100.0%  4.0 MiB / 4.0 MiB  2.0 MiB/s  0:00 left");
}

TEST(ProgressDisplayTest, PlainLinesAtMostOnceASecondAndTheLastAlways) {
  char* buffer = nullptr;
  size_t size = 0;
  FILE* out = open_memstream(&buffer, &size);
  ASSERT_NE(out, nullptr);
  {
    ProgressDisplay d("save job j", "bytes", out, /*tty=*/false);
    d.Update(10, 100);  // drawn: the first
    d.Update(20, 100);  // within the second: not drawn
    d.Finish(100, 100);
    d.Finish(100, 100);  // once only
    d.Update(100, 100);  // after the end: nothing
  }
  std::fclose(out);
  const std::string text(buffer, size);
  std::free(buffer);
  ASSERT_EQ(std::count(text.begin(), text.end(), '\n'), 2) << text;
  EXPECT_EQ(text.rfind("progress: save job j: 10/100 bytes (10.0%), ", 0), 0u) << text;
  EXPECT_NE(text.find("\nprogress: save job j: 100/100 bytes (100.0%), "), std::string::npos)
      << text;
  EXPECT_NE(text.find(", done in 0:00\n"), std::string::npos) << text;
}

TEST(ProgressDisplayTest, TerminalRedrawsInPlace) {
  char* buffer = nullptr;
  size_t size = 0;
  FILE* out = open_memstream(&buffer, &size);
  ASSERT_NE(out, nullptr);
  {
    ProgressDisplay d("export job j", "bytes", out, /*tty=*/true);
    d.Update(1, 2);
    d.Finish(2, 2);
  }
  std::fclose(out);
  const std::string text(buffer, size);
  std::free(buffer);
  EXPECT_EQ(text.rfind("\rexport job j  [##########----------]   50.0%", 0), 0u) << text;
  EXPECT_NE(text.find("\rexport job j  [####################]  100.0%"), std::string::npos);
  EXPECT_EQ(text.back(), '\n');
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 1);
}

TEST(ProgressDisplayTest, AFailedOperationGetsNoFinalLine) {
  for (const bool tty : {false, true}) {
    char* buffer = nullptr;
    size_t size = 0;
    FILE* out = open_memstream(&buffer, &size);
    ASSERT_NE(out, nullptr);
    {
      ProgressDisplay d("load job j", "bytes", out, tty);
      d.Update(1, 4);
      d.Abandon();
      d.Finish(4, 4);  // after Abandon: nothing
    }
    std::fclose(out);
    const std::string text(buffer, size);
    std::free(buffer);
    EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 1) << text;
    EXPECT_EQ(text.find("100.0%"), std::string::npos) << text;
    EXPECT_EQ(text.find("done in"), std::string::npos) << text;
  }
}

}  // namespace
}  // namespace muond::client
