// The attach half of the shared-memory data plane (server/api/shm_server.h): reading and checking
// an attach request, creating a session's regions and descriptors, and answering it. Internal to
// ShmServer; stateless functions, thread-compatible.
#ifndef MUOND_SERVER_API_SHM_ATTACH_H_
#define MUOND_SERVER_API_SHM_ATTACH_H_

#include <cerrno>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "muond/v1/muond.pb.h"
#include "server/api/shm_session.h"
#include "server/jobs/job_registry.h"

namespace muond::server::shm_attach {

// RESOURCE_EXHAUSTED for out-of-memory or out-of-descriptor errnos, else INTERNAL; "what: text".
absl::Status Errno(const std::string& what, int err = errno);
// "RLIMIT_NOFILE <soft limit>" for messages.
std::string NoFileLimit();
std::string PeerString(const ShmPeer& p);
// The peer's SO_PEERCRED (zeros when unavailable).
ShmPeer PeerOf(int conn);
// True when the peer has closed the connection or shut down its sending side.
bool PeerHungUp(int conn);
// Sends the attach reply (and `nfds` descriptors); never blocks. Errors name the call.
absl::Status SendReply(int conn, const v1::ShmAttachResponse& reply, const int* fds, int nfds);
// Reads off what the peer still sends (bounded), then closes: the peer sees the answer rather
// than a reset.
void DrainAndClose(int conn);
v1::ShmAttachResponse ErrorReply(const absl::Status& s);
// The job the request names if its token matches (NOT_FOUND, UNAUTHENTICATED, PERMISSION_DENIED,
// INVALID_ARGUMENT for a rank outside the world size).
absl::StatusOr<std::shared_ptr<Job>> Authorize(JobRegistry& registry,
                                               const v1::ShmAttachRequest& req);
// Creates the session's regions, doorbell and completion descriptors and fills the reply.
absl::Status CreateSessionResources(ShmSession& session, v1::ShmAttachResponse& reply);
// Registers the session's regions with `device` for direct copies (DESIGN.md 5: cudaHostRegister
// on CUDA, an imported host pointer on Level Zero): OK with session.device_registered set, or why
// not (nothing stays registered; the session works, its steps stage on the host). Blocks while the
// driver pins the pages. REQUIRES: the session's regions exist; device.DirectHostCopies().
absl::Status RegisterWithDevice(ShmSession& session, device::Device& device);
// An error while setting a session up, named for `who`.
absl::Status SetupError(const std::string& who, const absl::Status& s);
// RESOURCE_EXHAUSTED naming the descriptor limit.
absl::Status OutOfDescriptors(int err);

}  // namespace muond::server::shm_attach

#endif  // MUOND_SERVER_API_SHM_ATTACH_H_
