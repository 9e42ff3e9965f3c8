// The layer common/metrics.h adds over prometheus-cpp: promtool's naming conventions checked when a
// family is added, collect callbacks run at each scrape, and the exposition being
// prometheus-cpp's. prometheus-cpp's own behaviour is its project's to test; what is asserted
// here is what muond relies on from it (label escaping, histogram series, empty families left out).
#include <string>

#include "common/metrics.h"
#include "gtest/gtest.h"

namespace muond::common {
namespace {

bool Contains(const std::string& text, const std::string& piece) {
  return text.find(piece) != std::string::npos;
}

TEST(MetricsRegistryTest, NamesThatBreakTheConventionsAreRefused) {
  MetricsRegistry r;
  struct Case {
    const char* what;
    absl::Status status;
    const char* message;
  };
  const Case cases[] = {
      {"bad characters", r.AddGauge("muond-x", "X.").status(), "does not match"},
      {"leading digit", r.AddGauge("1muond", "X.").status(), "does not match"},
      {"empty help", r.AddGauge("muond_x", "").status(), "has no help text"},
      {"newline in help", r.AddGauge("muond_x", "a\nb").status(), "backslash or a newline"},
      {"backslash in help", r.AddGauge("muond_x", "a\\b").status(), "backslash or a newline"},
      {"counter without _total", r.AddCounter("muond_requests", "R.").status(),
       "must end in \"_total\""},
      {"gauge ending in _count", r.AddGauge("muond_x_count", "X.").status(),
       "reserved for histogram series"},
      {"counter ending in _sum_total is fine, _bucket is not",
       r.AddCounter("muond_x_bucket", "X.").status(), "must end in \"_total\""},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(c.status.code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_TRUE(Contains(std::string(c.status.message()), c.message)) << c.what << ": " << c.status;
  }
  // None of the refused families exists: the names are still free.
  EXPECT_TRUE(r.AddGauge("muond_x", "X.").ok());
  EXPECT_EQ(r.Serialize(), "");
}

TEST(MetricsRegistryTest, ASecondFamilyOfANameIsAlreadyExistsWhateverItsType) {
  MetricsRegistry r;
  ASSERT_TRUE(r.AddCounter("muond_a_total", "A.").ok());
  EXPECT_EQ(r.AddCounter("muond_a_total", "A.").status().code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(r.AddGauge("muond_b", "B.").ok());
  const absl::Status s = r.AddHistogram("muond_b", "B.").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(Contains(std::string(s.message()), "\"muond_b\"")) << s;
}

TEST(MetricsRegistryTest, SerializesWithPrometheusCppEscapingLabelValues) {
  MetricsRegistry r;
  Family<Counter>* c = r.AddCounter("muond_requests_total", "Requests.").value();
  c->Add({{"path", "a\"b\\c\nd"}}).Increment(2);
  c->Add({{"path", "x"}}).Increment(-1);  // refused by prometheus-cpp: counters never go down
  r.AddGauge("muond_unused", "No series: not exposed.").value();
  const std::string text = r.Serialize();
  EXPECT_TRUE(Contains(text, "# HELP muond_requests_total Requests.\n")) << text;
  EXPECT_TRUE(Contains(text, "# TYPE muond_requests_total counter\n")) << text;
  EXPECT_TRUE(Contains(text, "muond_requests_total{path=\"a\\\"b\\\\c\\nd\"} 2\n")) << text;
  EXPECT_TRUE(Contains(text, "muond_requests_total{path=\"x\"} 0\n")) << text;
  EXPECT_FALSE(Contains(text, "muond_unused")) << text;
}

TEST(MetricsRegistryTest, HistogramChildrenTakeTheirBucketsWhenAdded) {
  MetricsRegistry r;
  Family<Histogram>* h = r.AddHistogram("muond_x_seconds", "X.").value();
  Histogram& child = h->Add({{"phase", "a"}}, ExponentialBuckets(0.001, 10, 3));
  child.Observe(0.005);
  child.Observe(2);
  // The same labels give the same child (the bounds passed the second time are not used).
  h->Add({{"phase", "a"}}, Histogram::BucketBoundaries{}).Observe(0.0005);
  const std::string text = r.Serialize();
  for (const char* line :
       {"muond_x_seconds_bucket{phase=\"a\",le=\"0.001\"} 1\n",
        "muond_x_seconds_bucket{phase=\"a\",le=\"0.01\"} 2\n",
        "muond_x_seconds_bucket{phase=\"a\",le=\"0.1\"} 2\n",
        "muond_x_seconds_bucket{phase=\"a\",le=\"+Inf\"} 3\n",
        "muond_x_seconds_count{phase=\"a\"} 3\n", "muond_x_seconds_sum{phase=\"a\"} 2.0055\n"}) {
    EXPECT_TRUE(Contains(text, line)) << line << " in\n" << text;
  }
  h->Remove(&child);
  EXPECT_EQ(r.Serialize(), "");
}

TEST(MetricsRegistryTest, CollectCallbacksRunAtEachSerializeUntilRemoved) {
  MetricsRegistry r;
  Gauge& g = r.AddGauge("muond_depth", "Depth.").value()->Add({});
  int runs = 0;
  const auto id = r.AddCollectCallback([&] { g.Set(++runs); });
  EXPECT_TRUE(Contains(r.Serialize(), "muond_depth 1\n"));
  EXPECT_TRUE(Contains(r.Serialize(), "muond_depth 2\n"));
  EXPECT_TRUE(r.RemoveCollectCallback(id));
  EXPECT_FALSE(r.RemoveCollectCallback(id));
  EXPECT_TRUE(Contains(r.Serialize(), "muond_depth 2\n"));
  EXPECT_EQ(runs, 2);
}

TEST(MetricsRegistryTest, ExponentialBuckets) {
  EXPECT_EQ(ExponentialBuckets(1, 2, 4), (Histogram::BucketBoundaries{1, 2, 4, 8}));
  EXPECT_TRUE(ExponentialBuckets(0, 2, 4).empty());
  EXPECT_TRUE(ExponentialBuckets(1, 1, 4).empty());
  EXPECT_TRUE(ExponentialBuckets(1, 2, 0).empty());
}

}  // namespace
}  // namespace muond::common
