#include "server/api/shm_attach.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/job_spec_proto.h"
#include "common/layout.h"
#include "common/logging.h"
#include "common/shm_protocol.h"
#include "common/shm_region.h"

namespace muond::server::shm_attach {

namespace shm = common::shm;

absl::Status Errno(const std::string& what, int err) {
  const std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  if (err == EMFILE || err == ENFILE || err == ENOMEM || err == ENOBUFS) {
    return absl::ResourceExhaustedError(msg);
  }
  return absl::InternalError(msg);
}

std::string NoFileLimit() {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return "RLIMIT_NOFILE unknown";
  return absl::StrCat("RLIMIT_NOFILE ", lim.rlim_cur);
}

std::string PeerString(const ShmPeer& p) {
  return absl::StrCat("pid ", p.pid, " uid ", p.uid, " gid ", p.gid);
}

ShmPeer PeerOf(int conn) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  ShmPeer peer;
  if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
    peer.pid = cred.pid;
    peer.uid = cred.uid;
    peer.gid = cred.gid;
  }
  return peer;
}

// True when the peer has closed the connection or shut down its sending side (it can never send
// an attach request that we have not already read).
bool PeerHungUp(int conn) {
  pollfd p{conn, POLLIN | POLLRDHUP, 0};
  return poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

// Sends the attach reply (and `nfds` descriptors); never blocks. Errors name the call.
absl::Status SendReply(int conn, const v1::ShmAttachResponse& reply, const int* fds, int nfds) {
  const std::string bytes = reply.SerializeAsString();
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * shm::kNumFds)];
  if (nfds > 0) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
    std::memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
  }
  if (sendmsg(conn, &msg, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
    return Errno("sendmsg of the shared-memory attach reply");
  }
  return absl::OkStatus();
}

// Closes a connection that was answered. Datagrams the peer sent that were not read are dropped
// first: closing a socket with unread data makes the peer's next receive fail with ECONNRESET
// before it gets to the answer.
void DrainAndClose(int conn) {
  for (int i = 0; i < 16 && recv(conn, nullptr, 0, MSG_DONTWAIT | MSG_TRUNC) >= 0; ++i) {
  }
  close(conn);
}

v1::ShmAttachResponse ErrorReply(const absl::Status& s) {
  v1::ShmAttachResponse r;
  r.set_code(static_cast<int>(s.code()));
  r.set_message(std::string(s.message()));
  return r;
}

// The job of an attach request, once its token and rank are checked.
absl::StatusOr<std::shared_ptr<Job>> Authorize(JobRegistry& registry,
                                               const v1::ShmAttachRequest& req) {
  auto job = registry.Authorize(req.job_id(), req.token());
  if (!job.ok()) return job.status();
  const int world = (*job)->spec().world_size;
  if (req.rank() < 0 || req.rank() >= world) {
    return absl::InvalidArgumentError(absl::StrCat("job '", req.job_id(), "': rank ", req.rank(),
                                                   " is outside the world size [0, ", world, ")"));
  }
  return *std::move(job);
}

namespace {

// Where each of the rank's spans starts in a buffer (into *offsets), in the gradient dtype or
// (`params`) the param dtype; returns the bytes the spans take. The rank's flat buffer when every
// tensor shares the dtype, else the spans back to back.
uint64_t LayOut(const common::JobSpec& spec, int rank, const std::vector<common::ShardSpan>& spans,
                bool params, std::vector<uint64_t>* offsets) {
  auto dtype = [&](uint32_t m) {
    return params ? spec.matrices[m].param_dtype : spec.matrices[m].dtype;
  };
  bool uniform = true;
  for (uint32_t m = 0; m < spec.matrices.size(); ++m) uniform = uniform && dtype(m) == dtype(0);
  uint64_t bytes = 0;
  for (const common::ShardSpan& span : spans) {
    const size_t esize = common::DTypeSize(dtype(span.matrix));
    const uint64_t at = uniform ? span.rank_offset * esize : bytes;
    offsets->push_back(at);
    bytes = std::max(bytes, at + span.length * esize);
  }
  if (uniform) bytes = common::RankBufferElements(spec, rank) * common::DTypeSize(dtype(0));
  return bytes;
}

}  // namespace

// Lays out the rank's buffer (into `session` and the spans of `reply`), creates the session's
// regions and eventfds (five new descriptors) and fills in the rest of the reply.
// RESOURCE_EXHAUSTED when the process is out of descriptors or memory.
// REQUIRES: session.job, rank and session_id are set.
absl::Status CreateSessionResources(ShmSession& session, v1::ShmAttachResponse& reply) {
  const common::JobSpec& spec = session.job->spec();
  const int rank = session.rank;
  // Span byte offsets: the rank's flat buffer when all matrices share a dtype, else back to back;
  // apply mode lays out the parameters (param dtype) the same way.
  session.spans = common::RankSpans(spec, rank);
  const std::vector<common::ShardSpan>& spans = session.spans;
  const bool apply = spec.mode == common::JobMode::kApply;
  const uint64_t bytes = LayOut(spec, rank, spans, false, &session.byte_offsets);
  uint64_t buffer = bytes;
  if (apply) {
    const uint64_t params = LayOut(spec, rank, spans, true, &session.param_byte_offsets);
    session.hyper_byte_offset = (std::max(bytes, params) + 63) / 64 * 64;
    // Whole 64-byte lines: buffer 1 starts where buffer 0 ends, and its spans must stay as
    // aligned as buffer 0's (the presence mask makes the block an odd number of bytes).
    buffer =
        (session.hyper_byte_offset +
         shm::HyperBytes(spec.groups.size(), spec.matrices.size(), spec.qk_clip.logits()) + 63) /
        64 * 64;
    reply.set_hyper_byte_offset(session.hyper_byte_offset);
  } else if (spec.clips_outside_share()) {
    // Update mode with clipping: the rank's share of the norm (shm::kOutsideSumSqBytes).
    session.hyper_byte_offset = (bytes + 63) / 64 * 64;
    buffer = session.hyper_byte_offset + 64;
    reply.set_hyper_byte_offset(session.hyper_byte_offset);
  }
  for (size_t i = 0; i < spans.size(); ++i) {
    v1::ShmSpan* s = reply.add_spans();
    s->set_matrix_index(spans[i].matrix);
    s->set_offset(spans[i].offset);
    s->set_length(spans[i].length);
    s->set_byte_offset(session.byte_offsets[i]);
    if (apply) s->set_param_byte_offset(session.param_byte_offsets[i]);
  }
  session.buffer_bytes = std::max<uint64_t>(buffer, 1);
  session.buffers = static_cast<uint32_t>(spec.step_buffers);
  const uint64_t buffers = session.buffers;
  auto in = common::SharedRegion::Create("muond-grad", buffers * session.buffer_bytes, false, true);
  if (!in.ok()) return in.status();
  session.progress_byte_offset = (buffers * session.buffer_bytes + 63) / 64 * 64;
  reply.set_progress_byte_offset(session.progress_byte_offset);
  auto out = common::SharedRegion::Create(
      "muond-update", session.progress_byte_offset + shm::ProgressBytes(spans.size()), true, true);
  if (!out.ok()) return out.status();
  auto ring = common::SharedRegion::Create("muond-ring", shm::kRingBytes, false, true);
  if (!ring.ok()) return ring.status();
  session.doorbell = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (session.doorbell < 0) return Errno("eventfd (doorbell)");
  const int completion = eventfd(0, EFD_CLOEXEC);
  if (completion < 0) return Errno("eventfd (completion)");
  auto* r = reinterpret_cast<shm::Ring*>(ring->data());
  r->header.magic = shm::kRingMagic;
  r->header.version = shm::kRingVersion;
  r->header.generation = session.session_id;
  for (const common::SharedRegion* region : {&*in, &*out, &*ring}) {
    if (region->locked()) session.pinned_bytes += region->size();
    session.region_bytes += region->size();
  }
  reply.set_pinned(in->locked() && out->locked() && ring->locked());
  session.regions = std::make_shared<ShmRegions>();
  session.regions->in = *std::move(in);
  session.regions->out = *std::move(out);
  session.completions = std::make_shared<CompletionChannel>(*std::move(ring), completion);
  reply.set_session_id(session.session_id);
  reply.set_generation(session.session_id);
  reply.set_buffer_bytes(session.buffer_bytes);
  reply.set_next_step(session.job->Report().next_step);
  *reply.mutable_spec() = common::JobSpecToProto(spec);
  return absl::OkStatus();
}

absl::Status RegisterWithDevice(ShmSession& session, device::Device& device) {
  ShmRegions& regions = *session.regions;
  auto in = device::HostRegistration::Register(device, regions.in.data(), regions.in.size());
  if (!in.ok()) return in.status();
  auto out = device::HostRegistration::Register(device, regions.out.data(), regions.out.size());
  if (!out.ok()) return out.status();  // `in` is unregistered as it goes
  regions.in_device = *std::move(in);
  regions.out_device = *std::move(out);
  session.device_registered = true;
  return absl::OkStatus();
}

// Why an attach could not get its resources, with the descriptor limit when that was the cause.
absl::Status SetupError(const std::string& who, const absl::Status& s) {
  const bool no_fds = absl::StrContains(s.message(), std::strerror(EMFILE)) ||
                      absl::StrContains(s.message(), std::strerror(ENFILE));
  return absl::Status(s.code(),
                      absl::StrCat(who, ": cannot set up the shared-memory session: ", s.message(),
                                   no_fds ? absl::StrCat(" (", NoFileLimit(), ")") : ""));
}

// The refusal of a connection that accept4 could not take (`err`: EMFILE, ENFILE, ...).
absl::Status OutOfDescriptors(int err) {
  const bool fds = err == EMFILE || err == ENFILE;
  return absl::ResourceExhaustedError(absl::StrCat(
      "muond is out of ", fds ? "file descriptors" : "kernel memory", " (", NoFileLimit(),
      "; accept: ", std::strerror(err), "): shared-memory connection refused, try again later"));
}

}  // namespace muond::server::shm_attach
