// The status page's parts without a daemon: the step history and operation progress bounds, the
// JSON of a registry with a job (no token in it), and the HTTP routes of the pages beside
// /metrics (methods, content types, a page that loads nothing from elsewhere).
#include <unistd.h>

#include <filesystem>
#include <regex>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/api/job_status_proto.h"
#include "server/device/device.h"
#include "server/device/device_streams.h"
#include "server/engine/compute_executor.h"
#include "server/jobs/job_registry.h"
#include "server/ops/metrics_http.h"
#include "server/ops/metrics_http_request.h"
#include "server/ops/status_json.h"
#include "server/ops/status_page.h"
#include "server/record/status_history.h"
#include "server/record/status_progress.h"
#include "tests/unit/metrics/http_test_client.h"

namespace muond::server {
namespace {

using http_test::Fetch;
using http_test::Header;
using http_test::HttpResponse;
using Json = nlohmann::json;

TEST(StepHistoryTest, KeepsTheLastStepsOfEachJob) {
  StepHistory h;
  for (int64_t s = 0; s < 100; ++s) h.Record("a", 1, {s, 0, 0.5, {}});
  const std::vector<StepSample> steps = h.Steps("a");
  ASSERT_EQ(steps.size(), StepHistory::kStepsKept);
  EXPECT_EQ(steps.front().step, 100 - static_cast<int64_t>(StepHistory::kStepsKept));
  EXPECT_EQ(steps.back().step, 99);
  // The same id created again (another creation time) starts afresh.
  h.Record("a", 2, {0, 0, 0.5, {}});
  EXPECT_EQ(h.Steps("a").size(), 1u);
  h.Record("b", 1, {0, 0, 0.5, {}});
  h.Prune({"b"});
  EXPECT_TRUE(h.Steps("a").empty());
  EXPECT_EQ(h.Steps("b").size(), 1u);
}

TEST(OperationProgressTest, ReportsBytesAndKeepsFewFinished) {
  OperationProgress p;
  auto op = p.Begin("j", "save", "j", 1000);
  op->Advance(400);
  std::vector<OperationReport> now = p.ForJob("j");
  ASSERT_EQ(now.size(), 1u);
  EXPECT_EQ(now[0].bytes_done, 400u);
  EXPECT_FALSE(now[0].done);
  op->Advance(600);
  op->End(absl::OkStatus());
  now = p.ForJob("j");
  EXPECT_EQ(now[0].bytes_done, 1000u);
  EXPECT_TRUE(now[0].done);
  EXPECT_EQ(now[0].error, "");
  for (int i = 0; i < 10; ++i) {
    auto failed = p.Begin("j", "load", "j", 10);
    failed->End(absl::DataLossError("bad"));
  }
  now = p.ForJob("j");
  EXPECT_EQ(now.size(), OperationProgress::kFinishedKept);
  EXPECT_EQ(now.back().error, "bad");
  auto running = p.Begin("gone", "restore", "new", 10);
  p.Prune({"j"});
  EXPECT_EQ(p.ForJob("gone").size(), 1u);  // running operations stay
  running.reset();                         // ends as abandoned
  EXPECT_EQ(p.ForJob("gone")[0].error, "abandoned");
  p.Prune({"j"});
  EXPECT_TRUE(p.ForJob("gone").empty());
}

TEST(StepHistoryTest, ForgetDropsOnlyTheJobOfThatCreation) {
  StepHistory h;
  h.Record("a", 1, {0, 0, 0.5, {}});
  h.Forget("a", 2);  // another creation of the id: not this history
  EXPECT_EQ(h.Steps("a").size(), 1u);
  h.Forget("a", 1);
  EXPECT_TRUE(h.Steps("a").empty());
  EXPECT_EQ(h.jobs(), 0u);
}

TEST(OperationProgressTest, ForgetDropsFinishedNowAndRunningWhenTheyEnd) {
  OperationProgress p;
  p.Begin("j", "save", "j", 10)->End(absl::OkStatus());
  auto running = p.Begin("j", "load", "j", 10);
  p.Forget("j");
  ASSERT_EQ(p.ForJob("j").size(), 1u);  // the running load is still shown
  EXPECT_EQ(p.ForJob("j")[0].kind, "load");
  running->End(absl::OkStatus());
  EXPECT_TRUE(p.ForJob("j").empty());
  EXPECT_EQ(p.jobs(), 0u);
}

TEST(OperationProgressTest, JobsWhoseOperationsEndedAreBoundedWithoutARender) {
  OperationProgress p;
  // Imports of jobs whose creation failed: never deleted, never rendered.
  const size_t n = OperationProgress::kIdleJobsKept + 50;
  for (size_t i = 0; i < n; ++i) {
    p.Begin(absl::StrCat("failed-", i), "import", "", 1)->End(absl::InvalidArgumentError("x"));
  }
  EXPECT_EQ(p.jobs(), OperationProgress::kIdleJobsKept);
  EXPECT_TRUE(p.ForJob("failed-0").empty());  // the oldest went
  EXPECT_EQ(p.ForJob(absl::StrCat("failed-", n - 1)).size(), 1u);
  auto running = p.Begin("busy", "save", "busy", 1);  // a running one is never trimmed
  for (size_t i = 0; i < 10; ++i) p.Begin(absl::StrCat("more-", i), "import", "", 1)->End({});
  EXPECT_EQ(p.ForJob("busy").size(), 1u);
}

class StatusJsonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/status-json-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    auto devices = DeviceStreams::Create(device::NewHostDevice(1, nullptr), "cpu", false);
    ASSERT_TRUE(devices.ok()) << devices.status();
    devices_ = *std::move(devices);
    executor_ = std::make_unique<ComputeExecutor>(1);
    registry_ = std::make_unique<JobRegistry>("cpu (test)", DaemonLimits{}, uint64_t{64} << 20,
                                              executor_.get(), devices_.get(), dir_);
  }
  void TearDown() override {
    registry_.reset();
    executor_.reset();
    devices_.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  std::string dir_;
  std::unique_ptr<DeviceStreams> devices_;
  std::unique_ptr<ComputeExecutor> executor_;
  std::unique_ptr<JobRegistry> registry_;
};

TEST_F(StatusJsonTest, DescribesDaemonAndJobsWithoutTokens) {
  auto spec = common::ParseJobSpecJson(
      R"({"job_id": "page", "world_size": 2, "zero_stage": 1,
          "matrices": [{"name": "w", "shape": [8, 16]}]})");
  ASSERT_TRUE(spec.ok()) << spec.status();
  auto created = registry_->Create(*spec);
  ASSERT_TRUE(created.ok()) << created.status();
  ASSERT_TRUE(created->job->Attach(1, false).ok());
  const int64_t created_ms = created->job->Report().created_unix_ms;
  StepHistory::Default().Record("page", created_ms, {0, 1, 0.25, {0.01, 0.02, 0.2, 0, 0, 0.02}});

  StatusSource source(registry_.get(), nullptr,
                      {"9.9.9", "cpu", "cpu (test)", "test cpu", "avx2 (bf16 emulated: test)", "",
                       1000, {{"max_jobs", 64}}});
  source.SetMetricsAddress("127.0.0.1:1");
  const std::string text = source.Render();
  EXPECT_EQ(text.find(created->token), std::string::npos);
  EXPECT_EQ(text.find(created->job->token_sha256()), std::string::npos);
  const Json s = Json::parse(text);
  EXPECT_EQ(s["format"], "muond-status");
  EXPECT_EQ(s["daemon"]["version"], "9.9.9");
  EXPECT_EQ(s["daemon"]["backend_why"], "cpu (test)");
  EXPECT_EQ(s["daemon"]["cpu_math"], "avx2 (bf16 emulated: test)");
  EXPECT_EQ(s["daemon"]["metrics_address"], "127.0.0.1:1");
  EXPECT_EQ(s["daemon"]["limits"]["max_jobs"], 64);
  EXPECT_EQ(s["daemon"]["jobs"], 1);
  ASSERT_EQ(s["phases"].size(), 6u);
  EXPECT_EQ(s["phases"][2], "newton_schulz");
  ASSERT_EQ(s["jobs"].size(), 1u);
  const Json& j = s["jobs"][0];
  EXPECT_EQ(j["id"], "page");
  EXPECT_FALSE(j.contains("owner")) << "the page shows ids, sizes and state, not who owns a job";
  EXPECT_EQ(j["mode"], "update");
  EXPECT_EQ(j["world_size"], 2);
  EXPECT_EQ(j["zero_stage"], 1);
  EXPECT_EQ(j["ranks_attached"], 1);
  EXPECT_EQ(j["ranks"][0]["transport"], "");
  EXPECT_EQ(j["ranks"][1]["transport"], "grpc");
  EXPECT_EQ(j["state_bytes"], 8 * 16 * 4);
  EXPECT_TRUE(j["checkpoint"].is_null());
  ASSERT_EQ(j["recent_steps"].size(), 1u);
  EXPECT_EQ(j["recent_steps"][0]["phases"][2], 0.2);
  // A deleted job's history and operations go with it, without a render.
  OperationProgress::Default().Begin("page", "save", "page", 1)->End(absl::OkStatus());
  ASSERT_EQ(OperationProgress::Default().ForJob("page").size(), 1u);
  ASSERT_TRUE(registry_->Delete(std::move(created->job)).ok());
  EXPECT_TRUE(StepHistory::Default().Steps("page").empty());
  EXPECT_TRUE(OperationProgress::Default().ForJob("page").empty());
  EXPECT_EQ(Json::parse(source.Render())["jobs"].size(), 0u);
}

// ListJobs for a caller that neither owns a job nor holds its token (hostile.ListJobsWithheld):
// ids, sizes and state; none of the details.
TEST_F(StatusJsonTest, WithheldJobStatusCarriesIdsSizesAndStateOnly) {
  auto spec = common::ParseJobSpecJson(
      R"({"job_id": "private", "world_size": 2, "zero_stage": 1,
          "matrices": [{"name": "secret_layer.w", "shape": [8, 16]}]})");
  ASSERT_TRUE(spec.ok()) << spec.status();
  JobOwner owner;
  owner.uid = 1000;
  owner.description = "uid 1000 (alice) pid 77";
  auto created = registry_->Create(*spec, std::nullopt, owner);
  ASSERT_TRUE(created.ok()) << created.status();
  ASSERT_TRUE(created->job->Attach(0, false).ok());
  const JobReport r = created->job->Report();
  const v1::JobStatus full = JobStatusToProto(r);
  EXPECT_FALSE(full.details_withheld());
  EXPECT_EQ(full.owner_uid(), 1000);
  EXPECT_FALSE(full.checkpoint_dir().empty());
  EXPECT_NE(full.ranks(0).session_id(), 0u);
  const v1::JobStatus w = WithheldJobStatus(r);
  EXPECT_TRUE(w.details_withheld());
  EXPECT_EQ(w.spec().job_id(), "private");
  EXPECT_EQ(w.spec().world_size(), 2);
  EXPECT_EQ(w.spec().zero_stage(), 1);
  EXPECT_EQ(w.momentum_bytes(), full.momentum_bytes());
  EXPECT_EQ(w.next_step(), full.next_step());
  ASSERT_EQ(w.ranks_size(), 2);
  EXPECT_TRUE(w.ranks(0).attached());
  EXPECT_EQ(w.ranks(0).session_id(), 0u);
  EXPECT_EQ(w.spec().matrices_size(), 0);
  EXPECT_FALSE(w.has_owner_uid());
  EXPECT_EQ(w.owner(), "");
  EXPECT_EQ(w.checkpoint_dir(), "");
  EXPECT_EQ(w.fence_reason(), "");
  const std::string bytes = w.SerializeAsString();
  for (const std::string& secret : {std::string("secret_layer"), std::string("alice"),
                                    full.checkpoint_dir()}) {
    EXPECT_EQ(bytes.find(secret), std::string::npos) << secret;
  }
  ASSERT_TRUE(registry_->Delete(std::move(created->job)).ok());
}

class StatusPagesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MetricsServerOptions options;
    options.pages = StatusPages([] { return std::string(R"({"jobs": []})"); });
    auto server = MetricsServer::Start("127.0.0.1:0", &registry_, options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }
  common::MetricsRegistry registry_;
  std::unique_ptr<MetricsServer> server_;
};

TEST_F(StatusPagesTest, ServesPageAndJson) {
  HttpResponse r = Fetch(server_->port(), "GET", "/");
  EXPECT_EQ(r.status_line, "HTTP/1.1 200 OK");
  EXPECT_EQ(Header(r, "Content-Type"), "text/html; charset=utf-8");
  EXPECT_NE(Header(r, "Content-Security-Policy").find("default-src 'none'"), std::string::npos);
  EXPECT_EQ(r.body, StatusPageHtml());
  r = Fetch(server_->port(), "GET", "/api/v1/status?x=1");
  EXPECT_EQ(r.status_line, "HTTP/1.1 200 OK");
  EXPECT_EQ(Header(r, "Content-Type"), "application/json");
  EXPECT_EQ(r.body, R"({"jobs": []})");
  r = Fetch(server_->port(), "HEAD", "/");
  EXPECT_EQ(Header(r, "Content-Length"), std::to_string(StatusPageHtml().size()));
  EXPECT_EQ(r.body, "");
  EXPECT_EQ(Fetch(server_->port(), "GET", "/metrics").status_line, "HTTP/1.1 200 OK");
  EXPECT_EQ(Fetch(server_->port(), "GET", "/index.html").status_line, "HTTP/1.1 404 Not Found");
}

TEST_F(StatusPagesTest, ReadOnly) {
  for (const char* path : {"/", "/api/v1/status"}) {
    for (const char* method : {"POST", "PUT", "DELETE", "PATCH", "OPTIONS"}) {
      const HttpResponse r = Fetch(server_->port(), method, path);
      EXPECT_EQ(r.status_line, "HTTP/1.1 405 Method Not Allowed") << method << " " << path;
      EXPECT_EQ(Header(r, "Allow"), "GET, HEAD") << method << " " << path;
    }
  }
}

// DNS rebinding: a page of another origin whose name resolves to the daemon's address sends its
// own name in Host; the status pages answer 421 unless Host names this server. /metrics (scraped
// by Prometheus under whatever target name it was given) is not restricted.
TEST_F(StatusPagesTest, RefusesHostsThatAreNotTheServer) {
  const int port = server_->port();
  const std::string p = std::to_string(port);
  for (const char* path : {"/", "/api/v1/status"}) {
    for (const std::string& host : std::vector<std::string>{
             "evil.example:" + p, "evil.example", "127.0.0.1",
             "127.0.0.1:" + std::to_string(port + 1), "-", "127.0.0.1:" + p + "x",
             "0.0.0.0:" + p}) {
      const HttpResponse r = Fetch(port, "GET", path, host);
      EXPECT_EQ(r.status_line, "HTTP/1.1 421 Misdirected Request") << path << " Host " << host;
      EXPECT_NE(r.body.find("does not name this server (127.0.0.1:" + p + ")"),
                std::string::npos)
          << r.body;
      EXPECT_EQ(r.body.find("jobs"), std::string::npos) << "nothing of the status leaks";
    }
    for (const std::string& host :
         std::vector<std::string>{"127.0.0.1:" + p, "localhost:" + p, "LOCALHOST:" + p}) {
      EXPECT_EQ(Fetch(port, "GET", path, host).status_line, "HTTP/1.1 200 OK") << host;
    }
  }
  EXPECT_EQ(Fetch(port, "GET", "/metrics", "evil.example:" + p).status_line, "HTTP/1.1 200 OK");
}

TEST(HostNamesServerTest, BoundAddressRules) {
  using http::BoundAddress;
  using http::HostNamesServer;
  const BoundAddress loopback{"127.0.0.1", 9464}, v6{"[::1]", 9464}, any{"0.0.0.0", 9464},
      lan{"10.0.0.5", 9464};
  EXPECT_TRUE(HostNamesServer("127.0.0.1:9464", loopback));
  EXPECT_TRUE(HostNamesServer("localhost:9464", loopback));
  EXPECT_FALSE(HostNamesServer("localhost:9465", loopback));
  EXPECT_FALSE(HostNamesServer("10.0.0.5:9464", loopback));
  EXPECT_TRUE(HostNamesServer("[::1]:9464", v6));
  EXPECT_TRUE(HostNamesServer("localhost:9464", v6));
  EXPECT_FALSE(HostNamesServer("[::1]", v6));  // port 80 meant
  EXPECT_TRUE(HostNamesServer("10.0.0.5:9464", lan));
  EXPECT_FALSE(HostNamesServer("localhost:9464", lan));  // not a loopback address
  EXPECT_FALSE(HostNamesServer("rebind.example:9464", lan));
  // A wildcard address answers to any IP literal, localhost and this machine's name.
  EXPECT_TRUE(HostNamesServer("192.168.1.7:9464", any));
  EXPECT_TRUE(HostNamesServer("[fe80::1]:9464", any));
  EXPECT_TRUE(HostNamesServer("localhost:9464", any));
  char name[256] = {};
  ASSERT_EQ(gethostname(name, sizeof(name) - 1), 0);
  EXPECT_TRUE(HostNamesServer(std::string(name) + ":9464", any));
  EXPECT_FALSE(HostNamesServer("rebind.example:9464", any));
  EXPECT_FALSE(HostNamesServer(":9464", any));
  EXPECT_FALSE(HostNamesServer("192.168.1.7:99999", any));
}

TEST(StatusPageHtmlTest, LoadsNothingFromElsewhere) {
  const std::string& html = StatusPageHtml();
  // No element that fetches a resource, and no URL but the status JSON and the SVG namespace.
  for (const char* tag :
       {"<link", "<img", "<iframe", "<object", "<embed", "src=", "@import", "url("}) {
    EXPECT_EQ(html.find(tag), std::string::npos) << tag;
  }
  const std::regex url(R"((https?:)?//[A-Za-z0-9.-]+\.[A-Za-z]{2,})");
  for (auto it = std::sregex_iterator(html.begin(), html.end(), url); it != std::sregex_iterator();
       ++it) {
    EXPECT_EQ(it->str(), "http://www.w3.org") << "external reference " << it->str();
  }
  EXPECT_NE(html.find("fetch('/api/v1/status'"), std::string::npos);
}

}  // namespace
}  // namespace muond::server
