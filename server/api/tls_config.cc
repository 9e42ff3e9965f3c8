#include "server/api/tls_config.h"

#include <arpa/inet.h>
#include <grpcpp/security/server_credentials.h>
#include <netinet/in.h>

#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/pem.h"

namespace muond::server {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& flag, const std::string& path) {
  return common::ReadPemFile(absl::StrCat("--", flag), path);
}

}  // namespace

bool IsLoopbackAddress(const std::string& host_port) {
  const size_t colon = host_port.rfind(':');
  std::string host = colon == std::string::npos ? host_port : host_port.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (absl::AsciiStrToLower(host) == "localhost") return true;
  in_addr v4{};
  if (::inet_pton(AF_INET, host.c_str(), &v4) == 1) {
    return (ntohl(v4.s_addr) >> 24) == 127;
  }
  in6_addr v6{};
  if (::inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
    return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
  }
  return false;
}

std::string ServerTransport::Describe() const {
  return mutual_tls ? "mutual TLS" : tls ? "TLS" : "plaintext";
}

absl::StatusOr<ServerTransport> ServerTransportFor(const DaemonConfig& c) {
  ServerTransport t;
  const bool unix_address = c.listen.rfind("unix:", 0) == 0;
  const bool any_tls = !c.tls_cert.empty() || !c.tls_key.empty() || !c.tls_client_ca.empty();
  if (unix_address) {
    if (any_tls) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tls-cert/--tls-key/--tls-client-ca apply to TCP listen addresses, not ", c.listen));
    }
    t.credentials = grpc::InsecureServerCredentials();
    return t;
  }
  if (c.tls_cert.empty() != c.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (!c.tls_client_ca.empty() && c.tls_cert.empty()) {
    return absl::InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key");
  }
  if (c.tls_cert.empty()) {
    if (!IsLoopbackAddress(c.listen)) {
      if (!c.insecure_tcp) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--listen ", c.listen,
            ": plaintext TCP beyond loopback lets anyone on the network call the daemon; give "
            "--tls-cert and --tls-key (and --tls-client-ca), or --insecure-tcp to accept that"));
      }
      t.warning = absl::StrCat("--insecure-tcp: serving plaintext gRPC on ", c.listen,
                               ", not loopback; anyone who can reach it can call the daemon "
                               "(job tokens travel in clear)");
    }
    t.credentials = grpc::InsecureServerCredentials();
    return t;
  }
  grpc::SslServerCredentialsOptions options(
      c.tls_client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                              : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  absl::StatusOr<std::string> cert = ReadPem("tls-cert", c.tls_cert);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem("tls-key", c.tls_key);
  if (!key.ok()) return key.status();
  pair.cert_chain = *std::move(cert);
  pair.private_key = *std::move(key);
  options.pem_key_cert_pairs.push_back(std::move(pair));
  if (!c.tls_client_ca.empty()) {
    absl::StatusOr<std::string> ca = ReadPem("tls-client-ca", c.tls_client_ca);
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *std::move(ca);
    t.mutual_tls = true;
  }
  t.tls = true;
  t.credentials = grpc::SslServerCredentials(options);
  return t;
}

}  // namespace muond::server
