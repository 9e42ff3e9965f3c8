// Who is calling: the identity of a gRPC peer, and the daemon's policy on who may create jobs.
//
// Unix-socket connections are accepted by the daemon itself (server/api/connection_listener.h),
// which reads each connection's SO_PEERCRED and records it here, keyed by the descriptor it hands
// to gRPC; gRPC names such a peer "fd:<N>" (so does it a plaintext TCP peer the daemon accepted,
// which has no entry). TCP peers have no Unix credentials; over mutual TLS they carry
// a client certificate that gRPC verified against --tls-client-ca.
//
// Descriptor reuse: a descriptor number is reused once gRPC closed its connection, and the next
// accept overwrites the entry. A handler that still runs for a connection whose client already
// went away (its call is cancelled) may then see the newer connection's credentials; its answer
// reaches no one.
//
// Thread-safety: the peer table and PeerOf are thread-safe; AccessPolicy is immutable after
// Create and may be shared between threads.
#ifndef MUOND_SERVER_API_PEER_IDENTITY_H_
#define MUOND_SERVER_API_PEER_IDENTITY_H_

#include <sys/types.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace grpc {
class ServerContext;
}

namespace muond::server {

// The credentials of a Unix-socket peer, read with SO_PEERCRED when its connection was accepted.
struct UnixCredentials {
  uid_t uid = 0;
  gid_t gid = 0;
  pid_t pid = 0;
};

struct PeerIdentity {
  std::optional<UnixCredentials> unix_credentials;  // set for Unix-socket peers
  std::string peer;                                 // ServerContext::peer(): "fd:7", "ipv4:..."
  // A client certificate was presented and verified (the server requires and verifies client
  // certificates only with --tls-client-ca), and the identity it names (SAN or CN).
  bool tls_client_verified = false;
  std::string tls_identity;

  // "uid 1000 gid 1000 pid 4242" for Unix peers, else the peer string (and the certificate's
  // identity when there is one).
  std::string Describe() const;
};

// The process-wide table of accepted Unix-socket connections. Record overwrites the entry of a
// reused descriptor; Forget removes it (the connection is known to be closed).
void RecordUnixPeer(int fd, const UnixCredentials& credentials);
void ForgetUnixPeer(int fd);
std::optional<UnixCredentials> LookupUnixPeer(int fd);

// The identity of the peer of a call: Unix credentials for "fd:<N>" peers recorded above, else
// the peer string and, over TLS, the verified client certificate's identity.
PeerIdentity PeerOf(const grpc::ServerContext& ctx);

// The groups of the user with this uid: its primary group and supplementary groups
// (getpwuid_r + getgrouplist); empty when the uid has no passwd entry.
std::vector<gid_t> GroupsOfUser(uid_t uid);

// --allow-uids / --allow-groups: who may create jobs.
class AccessPolicy {
 public:
  using GroupLookup = std::function<std::vector<gid_t>(uid_t)>;

  // `allow_uids`, `allow_groups`: comma-separated numeric ids or user/group names ("" = no
  // list). Both empty: everyone who can reach the daemon may create jobs. `mutual_tls`: the
  // server verifies client certificates (--tls-client-ca), so a TCP peer with a verified
  // certificate passes a restricted policy. INVALID_ARGUMENT naming the flag and the entry for an
  // unknown name or a malformed id.
  static absl::StatusOr<std::unique_ptr<AccessPolicy>> Create(
      const std::string& allow_uids, const std::string& allow_groups, bool mutual_tls,
      uid_t daemon_uid, GroupLookup groups_of_user = GroupsOfUser);

  // True when an allow-list is set.
  bool restricted() const { return !uids_.empty() || !gids_.empty(); }

  // OK when `peer` may create a job; PERMISSION_DENIED naming the uid (or the peer) and the
  // flags otherwise. Root and the daemon's own uid are always allowed.
  absl::Status MayCreateJob(const PeerIdentity& peer) const;

  // One line for the start log: "allow-uids 1000,1001; allow-groups 50" or "unrestricted".
  std::string Describe() const;

 private:
  AccessPolicy() = default;
  std::vector<uid_t> uids_;
  std::vector<gid_t> gids_;
  bool mutual_tls_ = false;
  uid_t daemon_uid_ = 0;
  GroupLookup groups_of_user_;
};

}  // namespace muond::server

#endif  // MUOND_SERVER_API_PEER_IDENTITY_H_
