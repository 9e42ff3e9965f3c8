// TLS beyond loopback: certificates made with openssl at test time; a daemon on 127.0.0.1 with
// --tls-cert/--tls-key (and --tls-client-ca for mutual TLS); plaintext TCP on a non-loopback
// address refused unless --insecure-tcp. The tests connect to loopback only.
#include <sys/wait.h>

#include <chrono>
#include <iostream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/hostile_util.h"

namespace muond::integration {
namespace {

// A CA, a server certificate for 127.0.0.1/localhost and a client certificate, in `dir`.
void MakeCertificates(const TempDir& dir) {
  const std::string script = absl::StrCat(
      "set -e; cd ", dir.path(), "\n",
      "key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out $1 "
      "2>/dev/null; }\n"
      "key ca.key; key server.key; key client.key; key rogue.key\n"
      "openssl req -x509 -new -key ca.key -out ca.pem -days 2 -subj /CN=muond-test-ca "
      "-addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign\n"
      "openssl req -x509 -new -key rogue.key -out rogue-ca.pem -days 2 -subj /CN=rogue-ca "
      "-addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign\n"
      "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\nextendedKeyUsage=serverAuth\\n' "
      "> server.ext\n"
      "printf 'subjectAltName=DNS:trainer.test\\nextendedKeyUsage=clientAuth\\n' > client.ext\n"
      "openssl req -new -key server.key -out server.csr -subj /CN=localhost\n"
      "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 "
      "-extfile server.ext -out server.pem 2>/dev/null\n"
      "openssl req -new -key client.key -out client.csr -subj /CN=trainer.test\n"
      "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 "
      "-extfile client.ext -out client.pem 2>/dev/null\n"
      // A client certificate from a CA the daemon does not trust.
      "openssl x509 -req -in client.csr -CA rogue-ca.pem -CAkey rogue.key -CAcreateserial "
      "-days 2 -extfile client.ext -out rogue-client.pem 2>/dev/null\n");
  const ProcessResult r = RunProcess({"/bin/sh", "-c", script});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
}

// Starts muond on 127.0.0.1 (an ephemeral port) with `extra` flags; *port gets its port.
absl::StatusOr<std::unique_ptr<DaemonProcess>> StartTcp(const TempDir& dir, const std::string& host,
                                                        const std::vector<std::string>& extra,
                                                        int* port) {
  std::vector<std::string> args = {"--listen",  host + ":0", "--state-dir", dir.File("state"),
                                   "--threads", "1",         "--metrics-address", "off"};
  args.insert(args.end(), extra.begin(), extra.end());
  auto d = DaemonProcess::Spawn(args, dir.File("muond.log"));
  if (!d.ok()) return d.status();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while ((*port = LoggedPort((*d)->Log())) == 0) {
    if ((*d)->WaitExit(0)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "muond ", DescribeWaitStatus((*d)->exit_status()), " before serving:\n", (*d)->Log()));
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("no port logged:\n", (*d)->Log()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return d;
}

// Health through a fresh client (a failed channel would back off before retrying).
absl::Status HealthWith(const std::string& address, const client::TlsOptions& tls,
                        double timeout_seconds = 2) {
  auto c = client::Client::Connect(address, tls);
  if (!c.ok()) return c.status();
  return (*c)->Health(timeout_seconds);
}

// Polls HealthWith until OK (the daemon logs its port just before it reports SERVING).
absl::Status WaitHealthy(const std::string& address, const client::TlsOptions& tls) {
  absl::Status s;
  for (int i = 0; i < 50; ++i) {
    s = HealthWith(address, tls);
    if (s.ok()) return s;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return s;
}

TEST(HostileTlsTest, ServerCertificateIsVerified) {
  TempDir dir;
  MakeCertificates(dir);
  int port = 0;
  auto daemon = StartTcp(dir, "127.0.0.1",
                         {"--tls-cert", dir.File("server.pem"), "--tls-key", dir.File("server.key")},
                         &port);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string address = absl::StrCat("tls://127.0.0.1:", port);
  const client::TlsOptions trusted{dir.File("ca.pem"), "", ""};
  ASSERT_TRUE(WaitHealthy(address, trusted).ok()) << (*daemon)->Log();
  EXPECT_NE((*daemon)->Log().find(": TLS"), std::string::npos) << (*daemon)->Log();

  // Without the CA (gRPC's default roots), with another CA, or in plaintext: no connection.
  const absl::Status no_ca = HealthWith(address, {});
  EXPECT_EQ(no_ca.code(), absl::StatusCode::kUnavailable) << no_ca;
  const absl::Status rogue = HealthWith(address, {dir.File("rogue-ca.pem"), "", ""});
  EXPECT_EQ(rogue.code(), absl::StatusCode::kUnavailable) << rogue;
  const absl::Status plain = HealthWith(absl::StrCat("127.0.0.1:", port), {});
  EXPECT_EQ(plain.code(), absl::StatusCode::kUnavailable) << plain;
  std::cout << "without the CA: " << no_ca.message() << "\n";

  // With it: a job and a step.
  auto c = client::Client::Connect(address, trusted);
  ASSERT_TRUE(c.ok()) << c.status();
  auto token = (*c)->CreateJob(OneMatrixJob("tls-job"));
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_TRUE(StepOnce(**c, "tls-job", *token).ok());

  // muonctl: --tls-ca, or $MUOND_TLS_CA; a TLS file with a plaintext address is a usage error.
  ProcessResult r = RunMuonctl(address, {"--tls-ca", dir.File("ca.pem"), "health"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "SERVING\n");
  r = RunMuonctl(address, {"health"}, {{"MUOND_TLS_CA", dir.File("ca.pem")}});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  r = RunMuonctl(address, {"health"});
  EXPECT_EQ(r.exit_code, 14) << r.out << r.err;  // UNAVAILABLE
  r = RunMuonctl(absl::StrCat("127.0.0.1:", port), {"--tls-ca", dir.File("ca.pem"), "health"});
  EXPECT_EQ(r.exit_code, 3) << r.out << r.err;  // INVALID_ARGUMENT
  EXPECT_NE(r.err.find("tls://"), std::string::npos) << r.err;
  const int status = (*daemon)->Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << DescribeWaitStatus(status);
}

TEST(HostileTlsTest, MutualTlsRequiresAClientCertificate) {
  TempDir dir;
  MakeCertificates(dir);
  int port = 0;
  // With an allow-list: a TCP peer may create jobs only with a verified client certificate.
  auto daemon = StartTcp(dir, "127.0.0.1",
                         {"--tls-cert", dir.File("server.pem"), "--tls-key", dir.File("server.key"),
                          "--tls-client-ca", dir.File("ca.pem"), "--allow-uids", "1234"},
                         &port);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string address = absl::StrCat("tls://127.0.0.1:", port);
  const client::TlsOptions with_cert{dir.File("ca.pem"), dir.File("client.pem"),
                                     dir.File("client.key")};
  ASSERT_TRUE(WaitHealthy(address, with_cert).ok()) << (*daemon)->Log();
  EXPECT_NE((*daemon)->Log().find("mutual TLS"), std::string::npos) << (*daemon)->Log();

  const absl::Status no_cert = HealthWith(address, {dir.File("ca.pem"), "", ""});
  EXPECT_EQ(no_cert.code(), absl::StatusCode::kUnavailable) << no_cert;
  const absl::Status rogue_cert =
      HealthWith(address, {dir.File("ca.pem"), dir.File("rogue-client.pem"), dir.File("client.key")});
  EXPECT_EQ(rogue_cert.code(), absl::StatusCode::kUnavailable) << rogue_cert;
  const absl::Status half = HealthWith(address, {dir.File("ca.pem"), dir.File("client.pem"), ""});
  EXPECT_EQ(half.code(), absl::StatusCode::kInvalidArgument) << half;

  auto c = client::Client::Connect(address, with_cert);
  ASSERT_TRUE(c.ok()) << c.status();
  auto token = (*c)->CreateJob(OneMatrixJob("mtls-job"));
  ASSERT_TRUE(token.ok()) << "a verified client certificate passes the allow-list: "
                          << token.status();
  EXPECT_TRUE(StepOnce(**c, "mtls-job", *token).ok());
  const ProcessResult r = RunMuonctl(address, {"job", "list"},
                                     {{"MUOND_TLS_CA", dir.File("ca.pem")},
                                      {"MUOND_TLS_CERT", dir.File("client.pem")},
                                      {"MUOND_TLS_KEY", dir.File("client.key")}});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("mtls-job"), std::string::npos) << r.out;
  const int status = (*daemon)->Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << DescribeWaitStatus(status);
}

TEST(HostileTlsTest, PlaintextBeyondLoopbackNeedsInsecureTcp) {
  TempDir dir;
  const ProcessResult refused =
      RunProcess({MUOND_BIN, "--listen", "0.0.0.0:0", "--state-dir", dir.File("state"),
                  "--threads", "1", "--metrics-address", "off"});
  EXPECT_TRUE(refused.exited);
  EXPECT_EQ(refused.exit_code, 2) << refused.out << refused.err;
  EXPECT_EQ(CountLines(refused.err), 1) << refused.err;
  EXPECT_NE(refused.err.find("--insecure-tcp"), std::string::npos) << refused.err;
  std::cout << "refused: " << refused.err;
  // TLS flags on a Unix socket make no sense: refused too.
  const ProcessResult unix_tls = RunProcess(
      {MUOND_BIN, "--listen", "unix://" + dir.File("s.sock"), "--state-dir", dir.File("state"),
       "--tls-cert", dir.File("none.pem"), "--tls-key", dir.File("none.key")});
  EXPECT_EQ(unix_tls.exit_code, 2) << unix_tls.err;

  // Accepted with --insecure-tcp and a WARNING; with an allow-list, a TCP peer (no credentials,
  // no certificate) may not create jobs. Only the loopback address is dialled.
  int port = 0;
  auto daemon = StartTcp(dir, "0.0.0.0", {"--insecure-tcp", "--allow-uids", "1234"}, &port);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string log = (*daemon)->Log();
  EXPECT_NE(log.find("Z W main.cc"), std::string::npos) << log;  // a WARNING line
  EXPECT_NE(log.find("--insecure-tcp: serving plaintext"), std::string::npos) << log;
  const std::string address = absl::StrCat("127.0.0.1:", port);
  ASSERT_TRUE(WaitHealthy(address, {}).ok()) << (*daemon)->Log();
  auto c = client::Client::Connect(address, {});
  ASSERT_TRUE(c.ok());
  auto token = (*c)->CreateJob(OneMatrixJob("tcp-job"));
  EXPECT_EQ(token.status().code(), absl::StatusCode::kPermissionDenied) << token.status();
  EXPECT_NE(token.status().message().find("no Unix credentials"), absl::string_view::npos)
      << token.status();
  const int status = (*daemon)->Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << DescribeWaitStatus(status);
}

}  // namespace
}  // namespace muond::integration
