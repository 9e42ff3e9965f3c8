#include "common/metrics_text.h"

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>

#include "gtest/gtest.h"

namespace muond::common {
namespace {

TEST(MetricsTextTest, MetricNames) {
  EXPECT_TRUE(IsValidMetricName("muond_steps_total"));
  EXPECT_TRUE(IsValidMetricName("_x"));
  EXPECT_TRUE(IsValidMetricName("job:rate5m"));
  EXPECT_TRUE(IsValidMetricName("a1"));
  EXPECT_FALSE(IsValidMetricName(""));
  EXPECT_FALSE(IsValidMetricName("1a"));
  EXPECT_FALSE(IsValidMetricName("muond-steps"));
  EXPECT_FALSE(IsValidMetricName("muond steps"));
  EXPECT_FALSE(IsValidMetricName("muond.steps"));
  EXPECT_FALSE(IsValidMetricName("d\xc3\xa9j\xc3\xa0"));
}

TEST(MetricsTextTest, LabelNames) {
  EXPECT_TRUE(IsValidLabelName("job"));
  EXPECT_TRUE(IsValidLabelName("_x1"));
  EXPECT_FALSE(IsValidLabelName(""));
  EXPECT_FALSE(IsValidLabelName("__name__"));
  EXPECT_FALSE(IsValidLabelName("__x"));
  EXPECT_FALSE(IsValidLabelName("a:b"));  // Colons are for metric names only.
  EXPECT_FALSE(IsValidLabelName("9a"));
  EXPECT_FALSE(IsValidLabelName("a-b"));
}

TEST(MetricsTextTest, Escaping) {
  EXPECT_EQ(EscapeLabelValue(R"(a\b"c)"
                             "\n"
                             "d"),
            R"(a\\b\"c\nd)");
  // HELP keeps double quotes as they are.
  EXPECT_EQ(EscapeHelp(R"(say "hi" \ )"
                       "\n"),
            R"(say "hi" \\ \n)");
  EXPECT_EQ(EscapeLabelValue("caf\xc3\xa9 \t"), "caf\xc3\xa9 \t");  // Only the three characters.
}

TEST(MetricsTextTest, ValuesRoundTrip) {
  EXPECT_EQ(FormatSampleValue(0), "0");
  EXPECT_EQ(FormatSampleValue(42), "42");
  EXPECT_EQ(FormatSampleValue(-3), "-3");
  EXPECT_EQ(FormatSampleValue(0.1), "0.1");
  EXPECT_EQ(FormatSampleValue(0.005), "0.005");
  EXPECT_EQ(FormatSampleValue(2.5e-7), "2.5e-07");
  EXPECT_EQ(FormatSampleValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(FormatSampleValue(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(FormatSampleValue(std::nan("")), "NaN");
  for (double v : {0.1 + 0.2, 1.0 / 3.0, 123456789.123456789, 9007199254740993.0, 1e300, 5e-324,
                   std::numeric_limits<double>::max(), -2.2250738585072014e-308}) {
    const std::string text = FormatSampleValue(v);
    EXPECT_EQ(std::strtod(text.c_str(), nullptr), v) << text;
  }
}

TEST(MetricsTextTest, SampleLines) {
  std::string out;
  AppendSampleLine("m", {}, "", "", 1, &out);
  AppendSampleLine("m", {{"b", "2"}, {"a", "x\"y"}}, "", "", 0.5, &out);
  AppendSampleLine("m_bucket", {{"a", "1"}}, "le", "+Inf", 3, &out);
  AppendSampleLine("m_bucket", {}, "le", "0.1", 3, &out);
  EXPECT_EQ(out,
            "m 1\n"
            "m{a=\"x\\\"y\",b=\"2\"} 0.5\n"
            "m_bucket{a=\"1\",le=\"+Inf\"} 3\n"
            "m_bucket{le=\"0.1\"} 3\n");
}

}  // namespace
}  // namespace muond::common
