// muonctl's apply-mode flags without a daemon (MuonctlApplyFlagsTest): `step --lr GROUP=VALUE`,
// `--wd GROUP=VALUE` and `--grad-divisor X` parsed by muonctl_util.cc (compiled in), and muonctl's
// refusals that come before it talks to a daemon (one line on stderr, the gRPC code as the exit
// code).
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/muonctl_util.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"

namespace muond::integration {
namespace {

absl::StatusOr<client::Args> Parse(std::vector<std::string> argv) {
  return client::ParseArgs(argv);
}

TEST(MuonctlApplyFlagsTest, LrAndWdRepeatInOrderAndGroupsMayHoldEquals) {
  auto a = Parse({"step", "--lr", "muon=0.02", "--lr=adamw=1e-3", "--wd", "muon=0.1", "--lr",
                  "a=b=0.5", "--grad-divisor", "1024"});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->repeated.at("lr"), (std::vector<std::string>{"muon=0.02", "adamw=1e-3", "a=b=0.5"}));
  auto hyper = client::StepHyperFlags(*a);
  ASSERT_TRUE(hyper.ok()) << hyper.status();
  ASSERT_TRUE(hyper->has_value());
  const client::StepHyper& h = **hyper;
  ASSERT_EQ(h.lr.size(), 3u);
  EXPECT_EQ(h.lr[0], (std::pair<std::string, double>{"muon", 0.02}));
  EXPECT_EQ(h.lr[1], (std::pair<std::string, double>{"adamw", 1e-3}));
  EXPECT_EQ(h.lr[2], (std::pair<std::string, double>{"a=b", 0.5}));  // the last '=' splits
  ASSERT_EQ(h.weight_decay.size(), 1u);
  EXPECT_EQ(h.weight_decay[0], (std::pair<std::string, double>{"muon", 0.1}));
  EXPECT_EQ(h.grad_divisor, 1024);
}

TEST(MuonctlApplyFlagsTest, NoHyperFlagsIsNoHyper) {
  auto a = Parse({"step", "--job", "j"});
  ASSERT_TRUE(a.ok()) << a.status();
  auto hyper = client::StepHyperFlags(*a);
  ASSERT_TRUE(hyper.ok()) << hyper.status();
  EXPECT_FALSE(hyper->has_value());
  // --grad-divisor alone is a hyper flag too (refused by an update job, checked by an apply job).
  a = Parse({"step", "--grad-divisor", "8"});
  ASSERT_TRUE(a.ok());
  hyper = client::StepHyperFlags(*a);
  ASSERT_TRUE(hyper.ok() && hyper->has_value());
  EXPECT_TRUE((*hyper)->lr.empty());
  EXPECT_EQ((*hyper)->grad_divisor, 8);
}

TEST(MuonctlApplyFlagsTest, MalformedValuesNameTheFlag) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--lr", "muon"}, "--lr"},
      {{"--lr", "=0.1"}, "--lr"},
      {{"--lr", "muon=fast"}, "--lr"},
      {{"--wd", "muon="}, "--wd"},
      {{"--grad-divisor", "x"}, "--grad-divisor"},
  };
  for (const auto& [argv, flag] : cases) {
    SCOPED_TRACE(argv[1]);
    auto a = Parse(argv);
    ASSERT_TRUE(a.ok()) << a.status();
    auto hyper = client::StepHyperFlags(*a);
    ASSERT_FALSE(hyper.ok());
    EXPECT_EQ(hyper.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(hyper.status().message().find(flag), std::string::npos) << hyper.status();
  }
  // Unknown flags and a flag without its value stay usage errors.
  EXPECT_FALSE(Parse({"step", "--learning-rate", "muon=1"}).ok());
  EXPECT_FALSE(Parse({"step", "--lr"}).ok());
}

TEST(MuonctlApplyFlagsTest, RefusedBeforeTalkingToADaemon) {
  TempDir dir;
  const std::string nobody = "unix://" + dir.File("nobody.sock");
  struct Case {
    std::vector<std::string> args;
    int code;
    std::string want;
  };
  const std::vector<Case> cases = {
      {{"step", "--job", "j", "--rank", "0", "--step", "0", "--grads", "g", "--out", "o", "--lr",
        "decay"},
       3,
       "--lr"},
      {{"params"}, 64, "params needs a subcommand"},
      {{"params", "load", "--job", "j"}, 3, "unknown params command 'load'"},
      {{"params", "init", "--job", "j", "--rank", "0"}, 3, "--params"},
      {{"export", "--job", "j"}, 3, "export needs --out"},
      {{"export", "--job", "j", "--out", "x", "--dtype", "int8"}, 3, "int8"},
      {{"step", "--lr-rate", "1"}, 64, "unknown option --lr-rate"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args[0] + " " + c.args.back());
    const ProcessResult r = RunMuonctl(nobody, c.args);
    EXPECT_EQ(r.exit_code, c.code) << r.err;
    EXPECT_EQ(CountLines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(c.want), std::string::npos) << r.err;
  }
  const ProcessResult help = RunProcess({MUONCTL_BIN, "--help"});
  for (const char* want : {"params init --job ID --rank R --params", "--lr GROUP=VALUE",
                           "--grad-divisor", "export --job ID --out", "--dtype"}) {
    EXPECT_NE(help.out.find(want), std::string::npos) << want;
  }
}

}  // namespace
}  // namespace muond::integration
