// Files the daemon parses as JSON with fields of the wrong type: an export manifest a creator
// names (CreateJob import_dir) and the job and reset records of the state directory at start.
// Each is a clear error naming the file and the key, never an exception: a refused import
// releases the job's id and bytes (--max-jobs is not used up), and a damaged job.json sets that
// job aside while the daemon and every other job start.
#include <sys/stat.h>
#include <unistd.h>

#include <iostream>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/crc32c.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/hostile_util.h"

namespace muond::integration {
namespace {

using Json = nlohmann::json;

std::unique_ptr<client::Client> Connect(const DaemonProcess& daemon) {
  auto c = client::Client::Connect(daemon.address());
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

// A manifest text with the checksum the daemon computes (common/state_export.cc), so that the
// field checks after it are reached.
std::string WithChecksum(Json j) {
  j.erase("checksum");
  const std::string text = j.dump(-1, ' ', false, Json::error_handler_t::replace);
  j["checksum"] = common::Crc32c(text.data(), text.size());
  return j.dump();
}

TEST(HostileFilesJsonTest, ManifestOfWrongTypesIsRefusedAndReleasesTheJob) {
  TempDir dir;
  TempDir files;
  ASSERT_EQ(::chmod(files.path().c_str(), 0755), 0);
  const std::string manifest = files.File("n0.manifest.json");
  WriteWholeFile(manifest, R"({"format": 1})");
  // A manifest that passes the format and checksum checks with a tensor's dtype a number.
  TempDir files2;
  ASSERT_EQ(::chmod(files2.path().c_str(), 0755), 0);
  const std::string manifest2 = files2.File("n0.manifest.json");
  WriteWholeFile(manifest2, WithChecksum({{"format", "muond-state-export"},
                                          {"format_version", 1},
                                          {"job", "n0"},
                                          {"global_job_id", ""},
                                          {"node", -1},
                                          {"nodes", 0},
                                          {"mode", "update"},
                                          {"step", 1},
                                          {"generation", 0},
                                          {"payload", "n0.safetensors"},
                                          {"payload_bytes", 100},
                                          {"tensors", Json::array({{{"name", "w"},
                                                                    {"tensor", "w"},
                                                                    {"dtype", 5},
                                                                    {"shape", {2, 2}},
                                                                    {"data_offsets", {0, 16}},
                                                                    {"crc32c", 0}}})}}));
  auto daemon = DaemonProcess::StartIn(dir.path(), {"--max-jobs", "2", "--metrics-address", "off"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto client = Connect(**daemon);
  ASSERT_NE(client, nullptr);
  // More refusals than --max-jobs: each must release what it reserved.
  for (int i = 0; i < 5; ++i) {
    auto t = client->CreateJobFromExport(OneMatrixJob(absl::StrCat("bad-", i)), files.path());
    ASSERT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
    EXPECT_NE(t.status().message().find(manifest), std::string::npos) << t.status();
    EXPECT_NE(t.status().message().find("key 'format' is 1"), std::string::npos) << t.status();
    if (i == 0) std::cout << "refused: " << t.status() << "\n";
  }
  for (int i = 0; i < 3; ++i) {
    auto t = client->CreateJobFromExport(OneMatrixJob(absl::StrCat("bad2-", i)), files2.path());
    ASSERT_EQ(t.status().code(), absl::StatusCode::kDataLoss) << t.status();
    EXPECT_NE(t.status().message().find(manifest2), std::string::npos) << t.status();
    EXPECT_NE(t.status().message().find("key 'tensors[0].dtype' is 5"), std::string::npos)
        << t.status();
    if (i == 0) std::cout << "refused: " << t.status() << "\n";
  }
  // Both slots of --max-jobs 2 are free: two good jobs, and a third is over the limit.
  auto a = client->CreateJob(OneMatrixJob("good-a"));
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = client->CreateJob(OneMatrixJob("good-b"));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(client->CreateJob(OneMatrixJob("good-c")).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(StepOnce(*client, "good-a", *a).ok());
  EXPECT_EQ((*daemon)->Stop(), 0) << (*daemon)->Log();
}

TEST(HostileFilesJsonTest, JobRecordsOfWrongTypesAreSetAsideAtStart) {
  TempDir dir;
  std::string token;
  {
    auto daemon = DaemonProcess::StartIn(dir.path(), {"--metrics-address", "off"});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    auto client = Connect(**daemon);
    ASSERT_NE(client, nullptr);
    auto t = client->CreateJob(OneMatrixJob("good"));
    ASSERT_TRUE(t.ok()) << t.status();
    token = *t;
    ASSERT_TRUE(StepOnce(*client, "good", token).ok());
    ASSERT_TRUE(client->ResetJob("good", token, 5).ok());
    ASSERT_EQ((*daemon)->Stop(), 0) << (*daemon)->Log();
  }
  const std::string jobs = dir.path() + "/state/jobs";
  const Json good = Json::parse(ReadWholeFile(jobs + "/good/job.json"));
  // Copies of the good record, each with one field of another type.
  auto write_job = [&](const std::string& id, const std::function<void(Json&)>& change) {
    Json j = good;
    j["spec"]["job_id"] = id;
    change(j);
    ASSERT_EQ(::mkdir((jobs + "/" + id).c_str(), 0700), 0);
    WriteWholeFile(jobs + "/" + id + "/job.json", j.dump());
  };
  write_job("format7", [](Json& j) { j["format"] = 7; });
  write_job("uidtext", [](Json& j) { j["owner"]["uid"] = "root"; });
  write_job("hashnum", [](Json& j) { j["token_sha256"] = 12; });
  // The good job's reset record with a step of another type: ignored, logged.
  const std::string reset = jobs + "/good/reset.json";
  ASSERT_NE(ReadWholeFile(reset), "");
  WriteWholeFile(reset, R"({"format": "muond-reset", "next_step": "5", "after_generation": 0})");

  auto daemon = DaemonProcess::StartIn(dir.path(), {"--metrics-address", "off"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string log = (*daemon)->Log();
  for (const std::string& want :
       {jobs + "/format7/job.json: key 'format' is 7, not \"muond-job\"",
        jobs + "/uidtext/job.json: key 'owner.uid' is \"root\", not a uid",
        jobs + "/hashnum/job.json: key 'token_sha256' is 12, not 64 hex digits",
        reset + ": key 'next_step' is \"5\", not a step"}) {
    EXPECT_NE(log.find(want), std::string::npos) << "wanted '" << want << "' in the log:\n" << log;
  }
  auto client = Connect(**daemon);
  ASSERT_NE(client, nullptr);
  auto listed = client->ListJobsWithBroken();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->jobs_size(), 1);
  EXPECT_EQ(listed->jobs(0).spec().job_id(), "good");
  EXPECT_EQ(listed->broken_size(), 3);
  for (const auto& b : listed->broken()) std::cout << "set aside: " << b.ShortDebugString() << "\n";
  // The set-aside ids stay taken (as for any record that does not parse), the good job serves.
  EXPECT_EQ(client->CreateJob(OneMatrixJob("format7")).status().code(),
            absl::StatusCode::kAlreadyExists);
  auto job = client->GetJob("good", token);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ((*daemon)->Stop(), 0) << (*daemon)->Log();
}

}  // namespace
}  // namespace muond::integration
