#include "server/api/peer_identity.h"

#include <grp.h>
#include <grpc/grpc_security_constants.h>
#include <grpcpp/security/auth_context.h>
#include <grpcpp/server_context.h>
#include <pwd.h>
#include <unistd.h>

#include <algorithm>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"

namespace muond::server {
namespace {

struct PeerTable {
  absl::Mutex mu;
  std::unordered_map<int, UnixCredentials> by_fd ABSL_GUARDED_BY(mu);
};

PeerTable& Table() {
  static PeerTable* table = new PeerTable();
  return *table;
}

// getpwnam_r / getgrnam_r with a growing buffer; nullopt when there is no such name.
std::optional<uid_t> UidOfName(const std::string& name) {
  std::vector<char> buf(4096);
  while (true) {
    passwd pw;
    passwd* found = nullptr;
    const int err = ::getpwnam_r(name.c_str(), &pw, buf.data(), buf.size(), &found);
    if (err == ERANGE && buf.size() < (1u << 20)) {
      buf.resize(buf.size() * 2);
      continue;
    }
    if (err != 0 || found == nullptr) return std::nullopt;
    return pw.pw_uid;
  }
}

std::optional<gid_t> GidOfName(const std::string& name) {
  std::vector<char> buf(4096);
  while (true) {
    group gr;
    group* found = nullptr;
    const int err = ::getgrnam_r(name.c_str(), &gr, buf.data(), buf.size(), &found);
    if (err == ERANGE && buf.size() < (1u << 20)) {
      buf.resize(buf.size() * 2);
      continue;
    }
    if (err != 0 || found == nullptr) return std::nullopt;
    return gr.gr_gid;
  }
}

// Parses "1000,alice, 50" into ids; `lookup` resolves names.
template <typename Id, typename Lookup>
absl::Status ParseIds(const std::string& flag, const std::string& list, Lookup lookup,
                      std::vector<Id>* out) {
  for (absl::string_view part : absl::StrSplit(list, ',')) {
    const std::string entry(absl::StripAsciiWhitespace(part));
    if (entry.empty()) continue;
    uint32_t id = 0;
    if (absl::SimpleAtoi(entry, &id)) {
      out->push_back(static_cast<Id>(id));
      continue;
    }
    std::optional<Id> found = lookup(entry);
    if (!found) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": '", entry, "' is neither a number nor a known name"));
    }
    out->push_back(*found);
  }
  return absl::OkStatus();
}

template <typename Id>
bool Contains(const std::vector<Id>& ids, Id id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

}  // namespace

std::string PeerIdentity::Describe() const {
  if (unix_credentials) {
    return absl::StrCat("uid ", unix_credentials->uid, " gid ", unix_credentials->gid, " pid ",
                        unix_credentials->pid);
  }
  if (tls_client_verified) return absl::StrCat(peer, " (client certificate ", tls_identity, ")");
  return peer;
}

void RecordUnixPeer(int fd, const UnixCredentials& credentials) {
  PeerTable& t = Table();
  absl::MutexLock lock(&t.mu);
  t.by_fd[fd] = credentials;
}

void ForgetUnixPeer(int fd) {
  PeerTable& t = Table();
  absl::MutexLock lock(&t.mu);
  t.by_fd.erase(fd);
}

std::optional<UnixCredentials> LookupUnixPeer(int fd) {
  PeerTable& t = Table();
  absl::MutexLock lock(&t.mu);
  auto it = t.by_fd.find(fd);
  if (it == t.by_fd.end()) return std::nullopt;
  return it->second;
}

PeerIdentity PeerOf(const grpc::ServerContext& ctx) {
  PeerIdentity id;
  id.peer = ctx.peer();
  int fd = -1;
  if (absl::StartsWith(id.peer, "fd:") && absl::SimpleAtoi(id.peer.substr(3), &fd)) {
    id.unix_credentials = LookupUnixPeer(fd);
    return id;
  }
  std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
  if (auth != nullptr && auth->IsPeerAuthenticated()) {
    const std::vector<grpc::string_ref> security = auth->FindPropertyValues(
        GRPC_TRANSPORT_SECURITY_TYPE_PROPERTY_NAME);
    const bool ssl =
        !security.empty() && std::string(security[0].data(), security[0].size()) == "ssl";
    const std::vector<grpc::string_ref> certs =
        auth->FindPropertyValues(GRPC_X509_PEM_CERT_PROPERTY_NAME);
    if (ssl && !certs.empty()) {
      id.tls_client_verified = true;
      std::vector<std::string> names;
      for (const grpc::string_ref& n : auth->GetPeerIdentity()) names.emplace_back(n.data(), n.size());
      id.tls_identity = absl::StrJoin(names, ",");
    }
  }
  return id;
}

std::vector<gid_t> GroupsOfUser(uid_t uid) {
  std::vector<char> buf(4096);
  passwd pw;
  passwd* found = nullptr;
  while (true) {
    const int err = ::getpwuid_r(uid, &pw, buf.data(), buf.size(), &found);
    if (err == ERANGE && buf.size() < (1u << 20)) {
      buf.resize(buf.size() * 2);
      continue;
    }
    if (err != 0 || found == nullptr) return {};
    break;
  }
  std::vector<gid_t> groups(64);
  while (true) {
    int n = static_cast<int>(groups.size());
    if (::getgrouplist(pw.pw_name, pw.pw_gid, groups.data(), &n) >= 0) {
      groups.resize(n);
      return groups;
    }
    if (n <= static_cast<int>(groups.size())) n = static_cast<int>(groups.size()) * 2;
    if (n > 65536) return {pw.pw_gid};
    groups.resize(n);
  }
}

absl::StatusOr<std::unique_ptr<AccessPolicy>> AccessPolicy::Create(
    const std::string& allow_uids, const std::string& allow_groups, bool mutual_tls,
    uid_t daemon_uid, GroupLookup groups_of_user) {
  std::unique_ptr<AccessPolicy> p(new AccessPolicy());
  if (absl::Status s = ParseIds<uid_t>("allow-uids", allow_uids, UidOfName, &p->uids_); !s.ok()) {
    return s;
  }
  if (absl::Status s = ParseIds<gid_t>("allow-groups", allow_groups, GidOfName, &p->gids_);
      !s.ok()) {
    return s;
  }
  p->mutual_tls_ = mutual_tls;
  p->daemon_uid_ = daemon_uid;
  p->groups_of_user_ = std::move(groups_of_user);
  return p;
}

absl::Status AccessPolicy::MayCreateJob(const PeerIdentity& peer) const {
  if (!restricted()) return absl::OkStatus();
  if (peer.unix_credentials) {
    const UnixCredentials& c = *peer.unix_credentials;
    if (c.uid == 0 || c.uid == daemon_uid_ || Contains(uids_, c.uid)) return absl::OkStatus();
    if (!gids_.empty()) {
      if (Contains(gids_, c.gid)) return absl::OkStatus();
      for (gid_t g : groups_of_user_(c.uid)) {
        if (Contains(gids_, g)) return absl::OkStatus();
      }
    }
    const std::string groups =
        gids_.empty() ? std::string(" and no --allow-groups")
                      : absl::StrCat(", and neither its gid nor its user's groups are in "
                                     "--allow-groups (",
                                     absl::StrJoin(gids_, ","), ")");
    return absl::PermissionDeniedError(absl::StrCat(
        "uid ", c.uid, " (gid ", c.gid, ", pid ", c.pid, ") may not create jobs: not in ",
        "--allow-uids (", uids_.empty() ? "empty" : absl::StrJoin(uids_, ","), ")", groups));
  }
  if (mutual_tls_ && peer.tls_client_verified) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "peer ", peer.peer, " may not create jobs: it",
      " has no Unix credentials and no client certificate verified by mutual TLS "
      "(--tls-client-ca), and --allow-uids/--allow-groups are set"));
}

std::string AccessPolicy::Describe() const {
  if (!restricted()) return "unrestricted";
  return absl::StrCat("allow-uids ", uids_.empty() ? "-" : absl::StrJoin(uids_, ","),
                      "; allow-groups ", gids_.empty() ? "-" : absl::StrJoin(gids_, ","),
                      daemon_uid_ == 0 ? "; root always"
                                       : absl::StrCat("; root and uid ", daemon_uid_, " always"),
                      mutual_tls_ ? "; TCP peers with a verified client certificate" : "");
}

}  // namespace muond::server
