#include "common/metrics.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace muond::common {
namespace {

// One parsed sample line of text format 0.0.4.
struct Sample {
  std::string name;
  Labels labels;
  double value = 0;
};

// A strict reader of what Serialize() writes: comment lines are skipped, every other line must be a
// well-formed sample (label values unescaped), or the test fails.
std::vector<Sample> ParseSamples(const std::string& text) {
  std::vector<Sample> samples;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t eol = text.find('\n', pos);
    EXPECT_NE(eol, std::string::npos) << "last line not terminated";
    if (eol == std::string::npos) break;
    const std::string line = text.substr(pos, eol - pos);
    pos = eol + 1;
    if (line.rfind("# ", 0) == 0) continue;
    Sample s;
    size_t i = line.find_first_of("{ ");
    s.name = line.substr(0, i);
    if (line[i] == '{') {
      ++i;
      while (line[i] != '}') {
        const size_t eq = line.find('=', i);
        const std::string key = line.substr(i, eq - i);
        EXPECT_EQ(line[eq + 1], '"') << line;
        std::string value;
        size_t j = eq + 2;
        for (; line[j] != '"'; ++j) {
          if (line[j] == '\\') {
            ++j;
            value.push_back(line[j] == 'n' ? '\n' : line[j]);
          } else {
            value.push_back(line[j]);
          }
        }
        s.labels[key] = value;
        i = j + 1;
        if (line[i] == ',') ++i;
      }
      ++i;
    }
    EXPECT_EQ(line[i], ' ') << line;
    const std::string value_text = line.substr(i + 1);
    s.value = value_text == "+Inf"   ? std::numeric_limits<double>::infinity()
              : value_text == "-Inf" ? -std::numeric_limits<double>::infinity()
                                     : std::strtod(value_text.c_str(), nullptr);
    samples.push_back(std::move(s));
  }
  return samples;
}

double ParseLe(const std::string& le) {
  return le == "+Inf" ? std::numeric_limits<double>::infinity() : std::strtod(le.c_str(), nullptr);
}

// Checks, for every series of histogram `name` in `text`: `le` strictly ascending and ending in
// +Inf, bucket counts non-decreasing (cumulative), +Inf bucket == _count. Returns the series count.
int CheckHistogramInvariants(const std::string& text, const std::string& name) {
  std::map<Labels, std::vector<std::pair<double, double>>> buckets;  // labels -> (le, count)
  std::map<Labels, double> counts;
  for (const Sample& s : ParseSamples(text)) {
    if (s.name == name + "_bucket") {
      Labels labels = s.labels;
      const auto le = labels.find("le");
      EXPECT_NE(le, labels.end());
      const double bound = ParseLe(le->second);
      labels.erase(le);
      buckets[labels].emplace_back(bound, s.value);
    } else if (s.name == name + "_count") {
      counts[s.labels] = s.value;
    }
  }
  EXPECT_EQ(buckets.size(), counts.size());
  for (const auto& [labels, series] : buckets) {
    EXPECT_TRUE(std::isinf(series.back().first)) << "last bucket is not +Inf";
    for (size_t i = 1; i < series.size(); ++i) {
      EXPECT_LT(series[i - 1].first, series[i].first) << "le not ascending";
      EXPECT_LE(series[i - 1].second, series[i].second) << "buckets not cumulative";
    }
    EXPECT_EQ(series.back().second, counts[labels]) << "+Inf bucket != _count";
  }
  return static_cast<int>(buckets.size());
}

TEST(MetricsTest, CounterRendersWithHelpAndType) {
  Registry registry;
  Family<Counter>* steps = registry.AddCounter("muond_steps_total", "Steps completed.").value();
  steps->Add({{"job", "a"}}).Increment();
  steps->Add({{"job", "a"}}).Increment(2.5);
  steps->Add({{"job", "b"}});
  EXPECT_EQ(registry.Serialize(),
            "# HELP muond_steps_total Steps completed.\n"
            "# TYPE muond_steps_total counter\n"
            "muond_steps_total{job=\"a\"} 3.5\n"
            "muond_steps_total{job=\"b\"} 0\n");
}

TEST(MetricsTest, SameLabelsSameChildAndStableReferences) {
  Registry registry;
  Family<Gauge>* g = registry.AddGauge("muond_queue_depth", "Queued requests.").value();
  Gauge& a = g->Add({{"job", "a"}, {"phase", "x"}});
  std::vector<Gauge*> others;
  for (int i = 0; i < 100; ++i) others.push_back(&g->Add({{"job", std::to_string(i)}}));
  EXPECT_EQ(&a, &g->Add({{"phase", "x"}, {"job", "a"}}));  // Label order does not matter.
  EXPECT_EQ(&a, *g->TryAdd({{"job", "a"}, {"phase", "x"}}));
  EXPECT_EQ(g->size(), 101u);
  a.Set(7);
  a.Increment(3);
  a.Decrement(0.5);
  EXPECT_EQ(a.Value(), 9.5);
}

TEST(MetricsTest, RemoveDropsTheSeries) {
  Registry registry;
  Family<Gauge>* g = registry.AddGauge("muond_jobs", "Jobs.").value();
  Gauge& a = g->Add({{"job", "a"}});
  g->Add({{"job", "b"}}).Set(1);
  EXPECT_TRUE(g->Remove(&a));
  EXPECT_FALSE(g->Remove(&a));
  Gauge stranger;
  EXPECT_FALSE(g->Remove(&stranger));
  EXPECT_EQ(registry.Serialize(),
            "# HELP muond_jobs Jobs.\n# TYPE muond_jobs gauge\nmuond_jobs{job=\"b\"} 1\n");
  // Removing the last child removes the family from the output.
  EXPECT_TRUE(g->Remove(&g->Add({{"job", "b"}})));
  EXPECT_EQ(registry.Serialize(), "");
}

TEST(MetricsTest, CounterDecrementsRefused) {
  Registry registry;
  Counter& c = registry.AddCounter("muond_bytes_total", "Bytes.").value()->Add({});
  EXPECT_TRUE(c.Increment(5));
  EXPECT_FALSE(c.Increment(-1));
  EXPECT_FALSE(c.Increment(std::nan("")));
  EXPECT_TRUE(c.Increment(0));
  EXPECT_EQ(c.Value(), 5);
}

TEST(MetricsTest, DuplicateNamesRefused) {
  Registry registry;
  ASSERT_TRUE(registry.AddCounter("muond_x_total", "X.").ok());
  EXPECT_EQ(registry.AddCounter("muond_x_total", "X again.").status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry.AddGauge("muond_x_total", "X.").status().code(),
            absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(registry.AddHistogram("muond_h_seconds", "H.", {1}).ok());
  EXPECT_EQ(registry.AddHistogram("muond_h_seconds", "H.", {1}).status().code(),
            absl::StatusCode::kAlreadyExists);
}

TEST(MetricsTest, InvalidNamesRefused) {
  Registry registry;
  for (const char* name : {"", "1abc", "muond-x_total", "muond x_total", "muond.x_total"}) {
    EXPECT_EQ(registry.AddCounter(name, "h").status().code(), absl::StatusCode::kInvalidArgument)
        << name;
  }
  // Conventions promtool lints for.
  EXPECT_EQ(registry.AddCounter("muond_steps", "h").status().code(),
            absl::StatusCode::kInvalidArgument);  // Counter without _total.
  EXPECT_EQ(registry.AddGauge("muond_q_count", "h").status().code(),
            absl::StatusCode::kInvalidArgument);  // Clashes with histogram series.
  EXPECT_EQ(registry.AddGauge("muond_q_sum", "h").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.AddGauge("muond_q_bucket", "h").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.AddGauge("muond_q", "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.Serialize(), "");
}

TEST(MetricsTest, InvalidLabelsRefused) {
  Registry registry;
  Family<Counter>* c = registry.AddCounter("muond_c_total", "C.").value();
  for (const char* name : {"", "__reserved", "a-b", "1a", "le", "quantile", "a:b"}) {
    EXPECT_EQ(c->TryAdd({{name, "v"}}).status().code(), absl::StatusCode::kInvalidArgument) << name;
  }
  EXPECT_EQ(c->TryAdd({{"job", "bad \xff utf8"}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Add() never fails: the detached child takes the updates and is not rendered.
  Counter& sink = c->Add({{"le", "1"}});
  EXPECT_TRUE(sink.Increment());
  EXPECT_EQ(&sink, &c->Add({{"__x", "1"}}));
  EXPECT_EQ(c->size(), 0u);
  EXPECT_FALSE(c->Remove(&sink));
  EXPECT_EQ(registry.Serialize(), "");
}

TEST(MetricsTest, InvalidBucketsRefused) {
  Registry registry;
  const double inf = std::numeric_limits<double>::infinity();
  for (const std::vector<double>& bounds :
       std::vector<std::vector<double>>{{1, 1}, {2, 1}, {0.1, std::nan("")}, {1, inf}, {-inf, 1}}) {
    EXPECT_EQ(registry.AddHistogram("muond_h_seconds", "H.", bounds).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  // Only the implicit +Inf bucket.
  Histogram& h = registry.AddHistogram("muond_h_seconds", "H.", {}).value()->Add({});
  h.Observe(3);
  EXPECT_EQ(registry.Serialize(),
            "# HELP muond_h_seconds H.\n# TYPE muond_h_seconds histogram\n"
            "muond_h_seconds_bucket{le=\"+Inf\"} 1\nmuond_h_seconds_sum 3\n"
            "muond_h_seconds_count 1\n");
}

TEST(MetricsTest, HistogramRendering) {
  Registry registry;
  Family<Histogram>* f =
      registry.AddHistogram("muond_step_seconds", "Step time.", {0.005, 0.1, 1}).value();
  Histogram& h = f->Add({{"phase", "copy_in"}});
  for (double v : {0.001, 0.005, 0.05, 0.1, 0.5, 2.0, 7.0}) h.Observe(v);
  h.Observe(std::nan(""));  // Ignored.
  EXPECT_EQ(registry.Serialize(),
            "# HELP muond_step_seconds Step time.\n"
            "# TYPE muond_step_seconds histogram\n"
            "muond_step_seconds_bucket{phase=\"copy_in\",le=\"0.005\"} 2\n"
            "muond_step_seconds_bucket{phase=\"copy_in\",le=\"0.1\"} 4\n"
            "muond_step_seconds_bucket{phase=\"copy_in\",le=\"1\"} 5\n"
            "muond_step_seconds_bucket{phase=\"copy_in\",le=\"+Inf\"} 7\n"
            "muond_step_seconds_sum{phase=\"copy_in\"} 9.656\n"
            "muond_step_seconds_count{phase=\"copy_in\"} 7\n");
  const HistogramSnapshot s = h.Snapshot();
  EXPECT_EQ(s.cumulative_counts, (std::vector<uint64_t>{2, 4, 5, 7}));
  EXPECT_EQ(s.count, 7u);
}

TEST(MetricsTest, HistogramInvariantsOverManySeries) {
  Registry registry;
  Family<Histogram>* f =
      registry.AddHistogram("muond_phase_seconds", "Phase time.", ExponentialBuckets(1e-4, 4, 8))
          .value();
  uint64_t x = 12345;
  for (int series = 0; series < 6; ++series) {
    Histogram& h = f->Add({{"phase", "p" + std::to_string(series)}});
    for (int i = 0; i < 500 * (series + 1); ++i) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      h.Observe(static_cast<double>(x >> 11) / 9007199254740992.0 * (series + 1) * 0.5);
    }
  }
  EXPECT_EQ(CheckHistogramInvariants(registry.Serialize(), "muond_phase_seconds"), 6);
}

TEST(MetricsTest, BucketHelpers) {
  EXPECT_EQ(ExponentialBuckets(1, 2, 4), (std::vector<double>{1, 2, 4, 8}));
  EXPECT_EQ(LinearBuckets(0.5, 0.5, 3), (std::vector<double>{0.5, 1.0, 1.5}));
  EXPECT_EQ(LinearBuckets(0, 0.1, 11).back(), 1.0);  // No accumulated error.
  EXPECT_TRUE(ExponentialBuckets(0, 2, 4).empty());
  EXPECT_TRUE(ExponentialBuckets(1, 1, 4).empty());
  EXPECT_TRUE(ExponentialBuckets(1, 2, 0).empty());
  EXPECT_TRUE(LinearBuckets(0, 0, 4).empty());
  EXPECT_TRUE(LinearBuckets(0, 1, -1).empty());
}

TEST(MetricsTest, EscapingInOutput) {
  Registry registry;
  registry.AddGauge("muond_g", "Help with \\ backslash,\nnewline and \"quotes\".")
      .value()
      ->Add({{"path", "C:\\dir\n\"x\""}})
      .Set(1);
  const std::string text = registry.Serialize();
  EXPECT_EQ(text,
            "# HELP muond_g Help with \\\\ backslash,\\nnewline and \"quotes\".\n"
            "# TYPE muond_g gauge\n"
            "muond_g{path=\"C:\\\\dir\\n\\\"x\\\"\"} 1\n");
  const std::vector<Sample> samples = ParseSamples(text);
  ASSERT_EQ(samples.size(), 1u);
  EXPECT_EQ(samples[0].labels.at("path"), "C:\\dir\n\"x\"");
}

TEST(MetricsTest, SpecialValues) {
  Registry registry;
  Family<Gauge>* g = registry.AddGauge("muond_g", "G.").value();
  g->Add({{"v", "a"}}).Set(std::numeric_limits<double>::infinity());
  g->Add({{"v", "b"}}).Set(-std::numeric_limits<double>::infinity());
  g->Add({{"v", "c"}}).Set(std::nan(""));
  g->Add({{"v", "d"}}).Set(1e-9);
  EXPECT_EQ(registry.Serialize(),
            "# HELP muond_g G.\n# TYPE muond_g gauge\n"
            "muond_g{v=\"a\"} +Inf\nmuond_g{v=\"b\"} -Inf\nmuond_g{v=\"c\"} NaN\n"
            "muond_g{v=\"d\"} 1e-09\n");
}

TEST(MetricsTest, StableSortedOrder) {
  // Families by name and series by label set, whatever the order of registration and updates.
  Registry r1, r2;
  const std::vector<std::string> names = {"muond_b", "muond_a", "muond_c", "muond_a_b"};
  const std::vector<std::string> jobs = {"z", "a", "m", "b"};
  for (size_t i = 0; i < names.size(); ++i) {
    Family<Gauge>* f1 = r1.AddGauge(names[i], "h").value();
    Family<Gauge>* f2 = r2.AddGauge(names[names.size() - 1 - i], "h").value();
    for (size_t j = 0; j < jobs.size(); ++j) {
      f1->Add({{"job", jobs[j]}, {"phase", "p"}}).Set(static_cast<double>(j));
    }
    for (size_t j = jobs.size(); j-- > 0;) {
      f2->Add({{"phase", "p"}, {"job", jobs[j]}}).Set(static_cast<double>(j));
    }
  }
  // r2 got the same series with values matched per job, so the texts match exactly.
  const std::string text = r1.Serialize();
  EXPECT_EQ(text, r2.Serialize());
  EXPECT_EQ(text, r1.Serialize());
  std::vector<std::string> order;
  for (const Sample& s : ParseSamples(text)) order.push_back(s.name + "/" + s.labels.at("job"));
  std::vector<std::string> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(order, sorted);
  EXPECT_EQ(order.front(), "muond_a/a");
  EXPECT_EQ(order.back(), "muond_c/z");
}

TEST(MetricsTest, ConcurrentUpdatesAreExact) {
  Registry registry;
  Family<Counter>* c = registry.AddCounter("muond_ops_total", "Ops.").value();
  Family<Gauge>* g = registry.AddGauge("muond_level", "Level.").value();
  Family<Histogram>* h = registry.AddHistogram("muond_lat_seconds", "Lat.", {0.5, 1.5}).value();
  constexpr int kThreads = 8;
  constexpr int kPerThread = 20000;
  std::vector<std::thread> threads;
  std::atomic<bool> stop{false};
  // A concurrent scraper: every scrape it sees must already satisfy the histogram invariants.
  std::thread scraper([&] {
    while (!stop.load()) CheckHistogramInvariants(registry.Serialize(), "muond_lat_seconds");
  });
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Each thread looks its children up itself: Add from many threads must agree on one child.
      Counter& shared = c->Add({{"job", "shared"}});
      Counter& own = c->Add({{"job", "t" + std::to_string(t)}});
      Gauge& level = g->Add({});
      Histogram& lat = h->Add({{"job", "shared"}});
      for (int i = 0; i < kPerThread; ++i) {
        shared.Increment();
        own.Increment(0.5);
        level.Increment(2);
        level.Decrement(1);
        lat.Observe(i % 3);  // 0, 1, 2 -> one each into le=0.5, le=1.5, +Inf.
      }
    });
  }
  for (std::thread& t : threads) t.join();
  stop.store(true);
  scraper.join();
  EXPECT_EQ(c->Add({{"job", "shared"}}).Value(), kThreads * kPerThread);
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(c->Add({{"job", "t" + std::to_string(t)}}).Value(), kPerThread * 0.5);
  }
  EXPECT_EQ(c->size(), kThreads + 1u);
  EXPECT_EQ(g->Add({}).Value(), kThreads * kPerThread);
  const HistogramSnapshot s = h->Add({{"job", "shared"}}).Snapshot();
  EXPECT_EQ(s.count, static_cast<uint64_t>(kThreads * kPerThread));
  // 20000 = 3 * 6666 + 2: remainders 0 and 1 get one extra each per thread.
  EXPECT_EQ(s.cumulative_counts[0], kThreads * 6667u);
  EXPECT_EQ(s.cumulative_counts[1], kThreads * 2u * 6667u);
  EXPECT_EQ(s.sum, kThreads * (6667.0 * 1 + 6666.0 * 2));
}

TEST(MetricsTest, ConcurrentRegistration) {
  Registry registry;
  std::atomic<int> created{0}, refused{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 50; ++i) {
        auto f = registry.AddGauge("muond_g" + std::to_string(i), "G.");
        if (f.ok()) {
          ++created;
        } else {
          ++refused;
          EXPECT_EQ(f.status().code(), absl::StatusCode::kAlreadyExists);
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(created.load(), 50);
  EXPECT_EQ(refused.load(), 7 * 50);
}

TEST(MetricsTest, CollectCallbacksRunBeforeRendering) {
  Registry registry;
  Gauge& depth = registry.AddGauge("muond_queue_depth", "Depth.").value()->Add({});
  int queue = 3;
  int calls = 0;
  const Registry::CallbackId id = registry.AddCollectCallback([&] {
    ++calls;
    depth.Set(queue);
  });
  EXPECT_NE(registry.Serialize().find("muond_queue_depth 3\n"), std::string::npos);
  queue = 11;
  EXPECT_NE(registry.Serialize().find("muond_queue_depth 11\n"), std::string::npos);
  EXPECT_EQ(calls, 2);
  EXPECT_TRUE(registry.RemoveCollectCallback(id));
  EXPECT_FALSE(registry.RemoveCollectCallback(id));
  queue = 20;
  EXPECT_NE(registry.Serialize().find("muond_queue_depth 11\n"), std::string::npos);
  EXPECT_EQ(calls, 2);
}

TEST(MetricsTest, DefaultRegistryIsOneInstance) {
  EXPECT_EQ(&DefaultRegistry(), &DefaultRegistry());
}

}  // namespace
}  // namespace muond::common
