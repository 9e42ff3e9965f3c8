// How the gRPC API is exposed on TCP: TLS credentials from --tls-cert/--tls-key (and client
// certificate verification with --tls-client-ca), and the rule that plaintext TCP is for loopback
// only unless --insecure-tcp says otherwise. Unix-socket addresses take none of these.
//
// Thread-safety: pure functions.
#ifndef MUOND_SERVER_API_TLS_CONFIG_H_
#define MUOND_SERVER_API_TLS_CONFIG_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/record/daemon_config.h"

namespace grpc {
class ServerCredentials;
}

namespace muond::server {

// True for HOST:PORT addresses whose host is 127.0.0.0/8, ::1 (bracketed or not, also
// ::ffff:127.x.y.z) or "localhost". Any other name is not loopback (it may resolve anywhere).
bool IsLoopbackAddress(const std::string& host_port);

struct ServerTransport {
  std::shared_ptr<grpc::ServerCredentials> credentials;
  bool tls = false;
  bool mutual_tls = false;  // client certificates required and verified against --tls-client-ca
  // Set when --insecure-tcp allowed plaintext TCP on a non-loopback address: the daemon logs it
  // as a WARNING at start.
  std::string warning;
  std::string Describe() const;  // "TLS", "mutual TLS", "plaintext" (for the start log)
};

// The credentials for `c.listen`. INVALID_ARGUMENT (muond exits 2), naming the flag, for: TLS
// flags on a unix:// address, --tls-cert without --tls-key (or the reverse), --tls-client-ca
// without them, an unreadable or empty PEM file, and plaintext TCP on a non-loopback address
// without --insecure-tcp.
absl::StatusOr<ServerTransport> ServerTransportFor(const DaemonConfig& c);

}  // namespace muond::server

#endif  // MUOND_SERVER_API_TLS_CONFIG_H_
