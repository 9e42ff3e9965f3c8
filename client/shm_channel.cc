#include "client/shm_channel.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/job_spec_proto.h"
#include "common/shm_protocol.h"
#include "common/status_macros.h"
#include "muond/v1/muond.pb.h"

namespace muond::client {

namespace shm = common::shm;

// How long Attach waits on the daemon: to connect (a full backlog), to send and for the reply.
// The daemon answers or closes a connection that has not attached within its attach timeout
// (default 5 s), but creating and locking large regions takes time: a generous bound that still
// never leaves the caller blocked forever.
constexpr int kAttachTimeoutSeconds = 60;

std::string ShmSocketFor(const std::string& address) {
  if (!absl::StartsWith(address, "unix:///")) return "";
  return address.substr(7) + ".shm";
}

namespace {

// The daemon's answer to an attach request and the descriptors that came with it.
struct AttachReply {
  std::string bytes;  // the serialized v1::ShmAttachResponse
  int fds[shm::kNumFds];
  int nfds = 0;            // as many as the daemon sent; only the first kNumFds are kept
  bool truncated = false;  // the kernel dropped descriptors (MSG_CTRUNC)
  void CloseFds() {
    for (int i = 0; i < nfds && i < shm::kNumFds; ++i) close(fds[i]);
  }
};

// Sends the attach request. Returns the errno of a send that found the connection already closed
// (0 when it went out): a daemon that refuses the connection (too many connections, out of
// descriptors) answers and closes it at once, possibly before this send, and then its answer is
// still there to be read.
absl::StatusOr<int> SendAttachRequest(int conn, const v1::ShmAttachRequest& req) {
  const std::string bytes = req.SerializeAsString();
  if (send(conn, bytes.data(), bytes.size(), MSG_NOSIGNAL) < 0) {
    const int send_errno = errno;
    if (send_errno != EPIPE && send_errno != ECONNRESET) {
      return absl::UnavailableError(
          absl::StrCat("shared-memory attach: send: ", std::strerror(send_errno)));
    }
    return send_errno;
  }
  return 0;
}

// Receives the daemon's reply with its descriptors; `send_errno` (from SendAttachRequest) explains
// a connection closed without a reply.
absl::StatusOr<AttachReply> ReceiveAttachReply(int conn, const std::string& socket_path,
                                               int send_errno) {
  AttachReply reply;
  reply.bytes.assign(1 << 20, '\0');
  iovec iov{reply.bytes.data(), reply.bytes.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * shm::kNumFds)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n = -1;
  for (int resets = 0;;) {
    n = recvmsg(conn, &msg, MSG_CMSG_CLOEXEC);
    if (n >= 0) break;
    if (errno == EINTR) continue;
    // The daemon closed the connection with our request unread: the reset is reported first, its
    // answer (if it sent one) is still queued behind it.
    if (errno == ECONNRESET && resets++ == 0) continue;
    break;
  }
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "shared-memory attach: no reply from the daemon on ", socket_path, " within ",
        kAttachTimeoutSeconds, " s"));
  }
  if (n < 0) {
    return absl::UnavailableError(
        absl::StrCat("shared-memory attach: recvmsg: ", std::strerror(errno)));
  }
  if (n == 0) {
    return absl::UnavailableError(absl::StrCat(
        "shared-memory attach: the daemon closed the connection without replying",
        send_errno != 0 ? absl::StrCat(" (send: ", std::strerror(send_errno), ")") : ""));
  }
  reply.bytes.resize(static_cast<size_t>(n));
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      reply.nfds = static_cast<int>((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
      std::memcpy(reply.fds, CMSG_DATA(c), sizeof(int) * std::min(reply.nfds, shm::kNumFds));
    }
  }
  reply.truncated = (msg.msg_flags & MSG_CTRUNC) != 0;
  return reply;
}

// The daemon's answer to an attach with all its descriptors; otherwise closes the descriptors and
// returns the daemon's refusal, or INTERNAL for a malformed reply or missing descriptors.
absl::StatusOr<v1::ShmAttachResponse> AcceptedAttach(AttachReply& reply) {
  v1::ShmAttachResponse response;
  if (!response.ParseFromArray(reply.bytes.data(), static_cast<int>(reply.bytes.size()))) {
    reply.CloseFds();
    return absl::InternalError("shared-memory attach: malformed reply");
  }
  if (response.code() != 0) {
    reply.CloseFds();
    return absl::Status(static_cast<absl::StatusCode>(response.code()), response.message());
  }
  if (reply.nfds != shm::kNumFds || reply.truncated) {
    reply.CloseFds();
    return absl::InternalError(
        absl::StrCat("shared-memory attach: got ", reply.nfds, " descriptors"));
  }
  return response;
}

// What a completion of code OK says of its step.
ShmChannel::Ringing RingingOf(const shm::Completion& c) {
  return ShmChannel::Ringing{c.step, (c.flags & shm::kCompletionReplayed) != 0, c.seconds,
                             (c.flags & shm::kCompletionSkipped) != 0, c.grad_sum_sq};
}

}  // namespace

absl::Status ShmChannel::Connect(const std::string& socket_path) {
  conn_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (conn_ >= 0) {
    const timeval timeout{kAttachTimeoutSeconds, 0};
    setsockopt(conn_, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    setsockopt(conn_, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path too long: ", socket_path));
  }
  std::strncpy(addr.sun_path, socket_path.c_str(), sizeof(addr.sun_path) - 1);
  if (conn_ < 0 || connect(conn_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::UnavailableError(absl::StrCat("shared-memory socket ", socket_path, ": ",
                                               std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status ShmChannel::MapRegions(const v1::ShmAttachResponse& reply,
                                    const int (&fds)[shm::kNumFds]) {
  session_id_ = reply.session_id();
  generation_ = reply.generation();
  buffer_bytes_ = reply.buffer_bytes();
  hyper_byte_offset_ = reply.hyper_byte_offset();
  next_step_ = reply.next_step();
  pinned_ = reply.pinned();
  doorbell_ = fds[3];
  completion_ = fds[4];
  // The job's buffers per region (step t uses t % buffers); an older daemon's spec says none: 2.
  auto spec = common::JobSpecFromProto(reply.spec());
  buffers_ = spec.ok() ? static_cast<uint32_t>(spec->step_buffers) : 2;
  // Each Map owns its descriptor even when it fails: map all three before looking at the results.
  auto in = common::SharedRegion::Map(fds[0], buffers_ * buffer_bytes_, /*writable=*/true);
  auto out = common::SharedRegion::Map(fds[1], buffers_ * buffer_bytes_, /*writable=*/false);
  auto ring = common::SharedRegion::Map(fds[2], shm::kRingBytes, /*writable=*/true);
  if (!in.ok()) return in.status();
  if (!out.ok()) return out.status();
  if (!ring.ok()) return ring.status();
  in_ = *std::move(in);
  out_ = *std::move(out);
  ring_ = *std::move(ring);
  if (!spec.ok()) return spec.status();
  spec_ = *std::move(spec);
  for (const v1::ShmSpan& s : reply.spans()) {
    spans_.push_back(
        {s.matrix_index(), s.offset(), s.length(), s.byte_offset(), s.param_byte_offset()});
  }
  const uint64_t progress = reply.progress_byte_offset();
  if (progress >= buffers_ * buffer_bytes_ && progress % alignof(int64_t) == 0 &&
      progress <= out_.size() && shm::ProgressBytes(spans_.size()) <= out_.size() - progress) {
    progress_byte_offset_ = progress;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ShmChannel>> ShmChannel::Attach(const std::string& socket_path,
                                                               const std::string& job_id, int rank,
                                                               const std::string& token,
                                                               bool takeover) {
  std::unique_ptr<ShmChannel> ch(new ShmChannel());
  RETURN_IF_ERROR(ch->Connect(socket_path));
  v1::ShmAttachRequest req;
  req.set_job_id(job_id);
  req.set_rank(rank);
  req.set_token(token);
  req.set_takeover(takeover);
  ASSIGN_OR_RETURN(const int send_errno, SendAttachRequest(ch->conn_, req));
  ASSIGN_OR_RETURN(AttachReply reply, ReceiveAttachReply(ch->conn_, socket_path, send_errno));
  ASSIGN_OR_RETURN(const v1::ShmAttachResponse response, AcceptedAttach(reply));
  RETURN_IF_ERROR(ch->MapRegions(response, reply.fds));
  return ch;
}

ShmChannel::~ShmChannel() {
  if (doorbell_ >= 0) close(doorbell_);
  if (completion_ >= 0) close(completion_);
  if (conn_ >= 0) {
    // Detach, hang up and wait (briefly) until the daemon has ended the session, so that the rank
    // is detached when this returns, as with a gRPC detach.
    const char detach = shm::kDetachByte;
    ssize_t unused = send(conn_, &detach, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)unused;
    shutdown(conn_, SHUT_WR);
    pollfd p{conn_, POLLIN, 0};
    char byte;
    for (int i = 0; i < 100 && poll(&p, 1, 20) >= 0; ++i) {
      if ((p.revents & (POLLIN | POLLHUP)) && recv(conn_, &byte, 1, MSG_DONTWAIT) <= 0) break;
    }
    close(conn_);
  }
}

char* ShmChannel::GradientBuffer(int64_t step) const {
  return in_.data() + static_cast<uint64_t>(step % buffers_) * buffer_bytes_;
}

const char* ShmChannel::UpdateBuffer(int64_t step) const {
  return out_.data() + static_cast<uint64_t>(step % buffers_) * buffer_bytes_;
}

absl::StatusOr<ShmChannel::Ringing> ShmChannel::Ring(int64_t step) {
  if (step < 0) return absl::InvalidArgumentError(absl::StrCat("step ", step, " is negative"));
  return RingRaw(step, static_cast<uint32_t>(step % buffers_), 0, buffer_bytes_, generation_);
}

absl::Status ShmChannel::RingInitParams() {
  return RingRaw(-1, 0, 0, buffer_bytes_, generation_, shm::kSubmitInitParams).status();
}

absl::StatusOr<uint64_t> ShmChannel::Publish(int64_t step, uint32_t buffer, uint64_t offset,
                                             uint64_t size, uint64_t generation, uint32_t kind) {
  auto* ring = reinterpret_cast<shm::Ring*>(ring_.data());
  const uint64_t seq = next_seq_++;
  shm::Submission& sub = ring->subs[seq % shm::kRingSlots];
  sub.seq = seq;
  sub.step = step;
  sub.generation = generation;
  sub.buffer = buffer;
  sub.kind = kind;
  sub.offset = offset;
  sub.size = size;
  ring->header.sub_head.store(seq + 1, std::memory_order_release);
  const uint64_t one = 1;
  if (write(doorbell_, &one, sizeof(one)) != sizeof(one)) {
    return absl::UnavailableError(absl::StrCat("doorbell: ", std::strerror(errno)));
  }
  return seq;
}

absl::Status ShmChannel::Poll(int timeout_ms) {
  pollfd fds[2] = {{completion_, POLLIN, 0}, {conn_, POLLRDHUP, 0}};
  const int r = poll(fds, 2, timeout_ms);
  if (r < 0 && errno != EINTR) {
    return absl::InternalError(absl::StrCat("poll: ", std::strerror(errno)));
  }
  if (r > 0 && (fds[0].revents & POLLIN)) {
    uint64_t count;
    ssize_t unused = read(completion_, &count, sizeof(count));
    (void)unused;
  } else if (r > 0 && (fds[1].revents & (POLLRDHUP | POLLHUP | POLLERR))) {
    return absl::UnavailableError("the daemon ended the shared-memory session");
  }
  return absl::OkStatus();
}

absl::StatusOr<ShmChannel::Ringing> ShmChannel::RingRaw(int64_t step, uint32_t buffer,
                                                        uint64_t offset, uint64_t size,
                                                        uint64_t generation, uint32_t kind) {
  auto* ring = reinterpret_cast<shm::Ring*>(ring_.data());
  ASSIGN_OR_RETURN(const uint64_t seq, Publish(step, buffer, offset, size, generation, kind));
  // Wait for the completion of this submission; the socket hanging up means the daemon is gone.
  while (true) {
    const uint64_t tail = ring->header.comp_tail.load(std::memory_order_relaxed);
    if (ring->header.comp_head.load(std::memory_order_acquire) > tail) {
      const shm::Completion c = ring->comps[tail % shm::kRingSlots];
      ring->header.comp_tail.store(tail + 1, std::memory_order_release);
      if (c.seq != seq) continue;  // a completion of an earlier, abandoned submission
      if (c.code != 0) {
        const size_t len = strnlen(c.message, shm::kMessageBytes);
        return absl::Status(static_cast<absl::StatusCode>(c.code), std::string(c.message, len));
      }
      return RingingOf(c);
    }
    RETURN_IF_ERROR(Poll(-1));
  }
}

void ShmChannel::Reap() {
  auto* ring = reinterpret_cast<shm::Ring*>(ring_.data());
  while (true) {
    const uint64_t tail = ring->header.comp_tail.load(std::memory_order_relaxed);
    if (ring->header.comp_head.load(std::memory_order_acquire) <= tail) return;
    const shm::Completion c = ring->comps[tail % shm::kRingSlots];
    ring->header.comp_tail.store(tail + 1, std::memory_order_release);
    // Completions of another step, or of an earlier try of this one (a refused or dropped try
    // whose parts are still being answered), say nothing of this try.
    if (c.step != part_step_ || c.seq < first_seq_) continue;
    if (c.seq == first_seq_ && c.code == 0) opened_ = true;
    if (c.code != 0 && part_error_.ok()) {
      const size_t len = strnlen(c.message, shm::kMessageBytes);
      part_error_ = absl::Status(static_cast<absl::StatusCode>(c.code), std::string(c.message, len));
    }
    if (c.seq == last_seq_) {
      part_ended_ = true;
      part_result_ = RingingOf(c);
    }
  }
}

absl::Status ShmChannel::Post(int64_t step, uint64_t offset, uint64_t size, bool last) {
  if (step < 0) return absl::InvalidArgumentError(absl::StrCat("step ", step, " is negative"));
  if (step != part_step_ || part_ended_) {
    if (part_step_ >= 0 && !part_ended_ && last_seq_ == UINT64_MAX) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", part_step_, " is being sent in parts and its last part is not posted; step ",
          step, " cannot begin"));
    }
    if (part_step_ >= 0 && !part_ended_) RETURN_IF_ERROR(WaitStep(part_step_).status());
    part_step_ = step;
    last_seq_ = UINT64_MAX;
    first_seq_ = next_seq_;  // the sequence this try's first part will get
    opened_ = false;
    part_ended_ = false;
    part_error_ = absl::OkStatus();
  } else if (last_seq_ != UINT64_MAX) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, ": its last part was posted already"));
  }
  // The completion ring holds kRingSlots: never more submissions without their completion.
  auto* ring = reinterpret_cast<shm::Ring*>(ring_.data());
  Reap();
  while (next_seq_ - ring->header.comp_tail.load(std::memory_order_relaxed) >= shm::kRingSlots) {
    RETURN_IF_ERROR(Poll(-1));
    Reap();
  }
  ASSIGN_OR_RETURN(const uint64_t seq,
                   Publish(step, static_cast<uint32_t>(step % buffers_), offset, size, generation_,
                           last ? shm::kSubmitStep : shm::kSubmitStepPart));
  if (last) last_seq_ = seq;
  return absl::OkStatus();
}

absl::Status ShmChannel::WaitProgress(int timeout_ms) {
  Reap();
  if (part_ended_) return absl::OkStatus();
  RETURN_IF_ERROR(Poll(timeout_ms));
  Reap();
  return absl::OkStatus();
}

absl::StatusOr<ShmChannel::Ringing> ShmChannel::WaitStep(int64_t step) {
  if (step != part_step_) {
    return absl::FailedPreconditionError(absl::StrCat("step ", step, " was not sent in parts"));
  }
  if (last_seq_ == UINT64_MAX) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, ": its last part was not posted"));
  }
  Reap();
  while (!part_ended_) {
    RETURN_IF_ERROR(Poll(-1));
    Reap();
  }
  if (!part_error_.ok()) return part_error_;
  return part_result_;
}

bool ShmChannel::SpanReady(size_t span, int64_t step) const {
  if (progress_byte_offset_ == 0 || span >= spans_.size()) return false;
  // The words are this try's only once the daemon answered its first part: it clears them when
  // the try opens (server/jobs/job_shared.cc), so a word an earlier try of the step set is never
  // taken for a result of this one.
  if (step != part_step_ || !opened_) return false;
  const auto* words = reinterpret_cast<const int64_t*>(out_.data() + progress_byte_offset_);
  return __atomic_load_n(&words[span], __ATOMIC_ACQUIRE) == step + 1;
}

bool ShmChannel::StepEnded(int64_t step) const { return step == part_step_ && part_ended_; }

absl::Status ShmChannel::StepOutcome(int64_t step) const {
  if (step != part_step_ || !part_ended_) {
    return absl::FailedPreconditionError(absl::StrCat("step ", step, " has not ended"));
  }
  return part_error_;
}

}  // namespace muond::client
