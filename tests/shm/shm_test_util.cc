#include "tests/shm/shm_test_util.h"

#include <dirent.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/layout.h"

namespace muond::shmtest {

namespace shm = common::shm;
using Clock = std::chrono::steady_clock;

common::JobSpec MakeSpec(const std::string& job_id, int world, int stage,
                         std::vector<common::MatrixSpec> matrices) {
  common::JobSpec spec;
  spec.job_id = job_id;
  spec.world_size = world;
  spec.zero_stage = stage;
  spec.matrices = std::move(matrices);
  return spec;
}

std::string ApiName(Api api) {
  switch (api) {
    case Api::kGrpcStep: return "grpc/Step";
    case Api::kGrpcBuffer: return "grpc/StepBuffer";
    case Api::kShmStep: return "shm/Step";
    case Api::kShmBuffer: return "shm/StepBuffer";
    case Api::kShmTensors: return "shm/StepTensors";
    case Api::kGrpcTensors: return "grpc/StepTensors";
    case Api::kZeroCopy: return "shm/zero-copy views";
  }
  return "?";
}

client::Transport ApiTransport(Api api) {
  switch (api) {
    case Api::kGrpcStep:
    case Api::kGrpcBuffer:
    case Api::kGrpcTensors:
      return client::Transport::kGrpc;
    default:
      return client::Transport::kShm;
  }
}

std::string NanBytes(common::DType dtype) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::string out(common::DTypeSize(dtype), '\0');
  common::FromFloat32(&nan, 1, dtype, out.data());
  return out;
}

::testing::AssertionResult IsError(const absl::Status& s, absl::StatusCode code,
                                   const std::string& text) {
  if (s.code() == code && absl::StrContains(s.message(), text)) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "got " << s << "; want " << absl::StatusCodeToString(code)
                                       << " containing '" << text << "'";
}

absl::Status FillGradientView(client::RankSession& session, int64_t step,
                              const std::vector<std::string>& grads) {
  const common::JobSpec& spec = session.spec();
  absl::StatusOr<client::RankSession::View> view = session.GradientView(step);
  if (!view.ok()) return view.status();
  const common::DType dtype = spec.matrices[0].dtype;
  const std::string nan = NanBytes(dtype);
  for (size_t at = 0; at + nan.size() <= view->size; at += nan.size()) {
    std::memcpy(view->data + at, nan.data(), nan.size());
  }
  const size_t esize = common::DTypeSize(dtype);
  for (const common::ShardSpan& s : session.spans()) {
    const std::string bytes =
        integration::Slice(grads.at(s.matrix), spec.matrices[s.matrix].dtype, s.offset, s.length);
    if ((s.rank_offset + s.length) * esize > view->size) {
      return absl::InternalError("gradient view smaller than the rank's spans");
    }
    std::memcpy(view->data + s.rank_offset * esize, bytes.data(), bytes.size());
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> ReadUpdateView(client::RankSession& session,
                                                        int64_t step) {
  const common::JobSpec& spec = session.spec();
  absl::StatusOr<client::RankSession::View> view = session.UpdateView(step);
  if (!view.ok()) return view.status();
  const size_t esize = common::DTypeSize(spec.matrices[0].dtype);
  std::vector<std::string> out;
  for (const common::ShardSpan& s : session.spans()) {
    out.emplace_back(view->data + s.rank_offset * esize, s.length * esize);
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> StepWith(Api api, client::RankSession& session,
                                                  int64_t step,
                                                  const std::vector<std::string>& grads,
                                                  client::StepResult* result) {
  switch (api) {
    case Api::kGrpcStep:
    case Api::kShmStep:
      return integration::StepSpans(session, step, grads, result);
    case Api::kGrpcBuffer:
    case Api::kShmBuffer:
      return integration::StepFlatBuffer(session, step, grads, 0.5f, result);
    case Api::kShmTensors:
    case Api::kGrpcTensors: {
      const common::JobSpec& spec = session.spec();
      std::vector<client::NamedTensor> in;
      for (size_t m = 0; m < spec.matrices.size(); ++m) {
        in.push_back({spec.matrices[m].name, spec.matrices[m].dtype, spec.matrices[m].shape,
                      grads.at(m)});
      }
      absl::StatusOr<std::vector<client::NamedTensor>> out =
          session.StepTensors(step, in, result);
      if (!out.ok()) return out.status();
      std::vector<std::string> spans;
      for (const client::NamedTensor& t : *out) spans.push_back(t.data);
      return spans;
    }
    case Api::kZeroCopy: {
      if (absl::Status s = FillGradientView(session, step, grads); !s.ok()) return s;
      absl::StatusOr<client::StepResult> r = session.StepInPlace(step);
      if (!r.ok()) return r.status();
      if (result != nullptr) *result = *r;
      return ReadUpdateView(session, step);
    }
  }
  return absl::InternalError("unknown api");
}

absl::StatusOr<Trajectory> RunTrajectory(client::Client& client, const common::JobSpec& spec,
                                         Api api, const MatrixBytes& grads) {
  absl::StatusOr<std::string> token = client.CreateJob(spec);
  if (!token.ok()) return token.status();
  const int world = spec.world_size;
  Trajectory out;
  out.updates.resize(world);
  out.layout.resize(world);
  out.transport.resize(world);
  std::vector<absl::Status> status(world);
  std::vector<std::unique_ptr<client::RankSession>> sessions(world);
  for (int r = 0; r < world; ++r) {
    auto s = client.Attach(spec.job_id, r, *token, false, ApiTransport(api));
    if (!s.ok()) return s.status();
    sessions[r] = *std::move(s);
    out.layout[r] = sessions[r]->spans();
    out.transport[r] = sessions[r]->transport();
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      for (size_t t = 0; t < grads.size(); ++t) {
        auto u = StepWith(api, *sessions[r], static_cast<int64_t>(t), grads[t]);
        if (!u.ok()) {
          status[r] = absl::Status(u.status().code(),
                                   absl::StrCat(ApiName(api), " rank ", r, " step ", t, ": ",
                                                std::string(u.status().message())));
          // The other ranks would wait for this one: end the job's step for them.
          (void)client.DeleteJob(spec.job_id, *token);
          return;
        }
        out.updates[r].push_back(*std::move(u));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  sessions.clear();
  (void)client.DeleteJob(spec.job_id, *token);
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return out;
}

std::vector<absl::StatusOr<std::vector<std::string>>> StepAllRanks(
    client::Client& client, const std::string& job_id, const std::string& token,
    const std::vector<client::RankSession*>& sessions, const std::vector<Api>& apis,
    int64_t step, const std::vector<std::string>& grads) {
  std::vector<absl::StatusOr<std::vector<std::string>>> out(
      sessions.size(), absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (size_t r = 0; r < sessions.size(); ++r) {
    threads.emplace_back([&, r] {
      out[r] = StepWith(apis[r], *sessions[r], step, grads);
      if (!out[r].ok()) (void)client.DeleteJob(job_id, token);
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

std::string FlatRankBuffer(const common::JobSpec& spec, int rank,
                           const std::vector<std::string>& grads) {
  const size_t esize = common::DTypeSize(spec.matrices[0].dtype);
  std::string out(common::RankBufferElements(spec, rank) * esize, '\0');
  for (const common::ShardSpan& s : common::RankSpans(spec, rank)) {
    const std::string bytes =
        integration::Slice(grads.at(s.matrix), spec.matrices[s.matrix].dtype, s.offset, s.length);
    std::memcpy(out.data() + s.rank_offset * esize, bytes.data(), bytes.size());
  }
  return out;
}

std::string ProcCounts::ToString() const {
  return absl::StrCat("fds=", fds, " memfd_maps=", memfd_maps, " VmLck=", vmlck_kb, " kB");
}

int64_t VmLckKb(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "VmLck:")) {
      std::istringstream fields(line.substr(6));
      int64_t kb = -1;
      fields >> kb;
      return kb;
    }
  }
  return -1;
}

ProcCounts MeasureProcess(pid_t pid) {
  ProcCounts c;
  if (DIR* d = opendir(absl::StrCat("/proc/", pid, "/fd").c_str())) {
    c.fds = 0;
    while (dirent* e = readdir(d)) c.fds += e->d_name[0] != '.';
    closedir(d);
  }
  std::ifstream maps(absl::StrCat("/proc/", pid, "/maps"));
  if (maps) {
    c.memfd_maps = 0;
    std::string line;
    while (std::getline(maps, line)) c.memfd_maps += absl::StrContains(line, "memfd:muond");
  }
  c.vmlck_kb = VmLckKb(pid);
  return c;
}

bool WaitForCounts(pid_t pid, const ProcCounts& want, double timeout_seconds, ProcCounts* last) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_seconds);
  while (true) {
    *last = MeasureProcess(pid);
    if (*last == want) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// ---------------------------------------------------------------------------------------------
// RawShmPeer

absl::StatusOr<std::unique_ptr<RawShmPeer>> RawShmPeer::Attach(const std::string& socket_path,
                                                               const std::string& job_id,
                                                               int rank,
                                                               const std::string& token) {
  std::unique_ptr<RawShmPeer> p(new RawShmPeer());
  p->conn_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, socket_path.c_str(), sizeof(addr.sun_path) - 1);
  if (p->conn_ < 0 || connect(p->conn_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::UnavailableError(absl::StrCat("connect ", socket_path, ": ", strerror(errno)));
  }
  v1::ShmAttachRequest req;
  req.set_job_id(job_id);
  req.set_rank(rank);
  req.set_token(token);
  const std::string bytes = req.SerializeAsString();
  if (send(p->conn_, bytes.data(), bytes.size(), MSG_NOSIGNAL) < 0) {
    return absl::UnavailableError(absl::StrCat("send: ", strerror(errno)));
  }
  std::string buf(1 << 20, '\0');
  iovec iov{buf.data(), buf.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * shm::kNumFds)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t n = recvmsg(p->conn_, &msg, MSG_CMSG_CLOEXEC);
  if (n <= 0) return absl::UnavailableError("the daemon closed the connection");
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      const size_t nfds = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      if (nfds != shm::kNumFds) return absl::InternalError(absl::StrCat(nfds, " descriptors"));
      std::memcpy(p->fds_, CMSG_DATA(c), sizeof(p->fds_));
    }
  }
  if (!p->reply_.ParseFromArray(buf.data(), static_cast<int>(n))) {
    return absl::InternalError("malformed attach reply");
  }
  if (p->reply_.code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(p->reply_.code()), p->reply_.message());
  }
  if (p->fds_[4] < 0) return absl::InternalError("no descriptors with the attach reply");
  p->region_bytes_ = 2 * p->reply_.buffer_bytes();
  void* g = mmap(nullptr, p->region_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, p->fds_[0], 0);
  void* u = mmap(nullptr, p->region_bytes_, PROT_READ, MAP_SHARED, p->fds_[1], 0);
  void* r = mmap(nullptr, shm::kRingBytes, PROT_READ | PROT_WRITE, MAP_SHARED, p->fds_[2], 0);
  if (g == MAP_FAILED || u == MAP_FAILED || r == MAP_FAILED) {
    return absl::InternalError(absl::StrCat("mmap: ", strerror(errno)));
  }
  p->grad_ = static_cast<char*>(g);
  p->update_ = static_cast<const char*>(u);
  p->ring_ = static_cast<shm::Ring*>(r);
  return p;
}

RawShmPeer::~RawShmPeer() {
  if (grad_ != nullptr) munmap(grad_, region_bytes_);
  if (update_ != nullptr) munmap(const_cast<char*>(update_), region_bytes_);
  if (ring_ != nullptr) munmap(ring_, shm::kRingBytes);
  for (int fd : fds_) {
    if (fd >= 0) close(fd);
  }
  if (conn_ >= 0) close(conn_);
}

shm::Submission RawShmPeer::Valid(int64_t step) const {
  shm::Submission s{};
  s.seq = ring_->header.sub_head.load();
  s.step = step;
  s.generation = reply_.generation();
  s.buffer = static_cast<uint32_t>(step % 2);
  s.offset = 0;
  s.size = reply_.buffer_bytes();
  return s;
}

void RawShmPeer::Publish(const shm::Submission& sub, uint64_t head) {
  ring_->subs[sub.seq % shm::kRingSlots] = sub;
  ring_->header.sub_head.store(head, std::memory_order_release);
  const uint64_t one = 1;
  ssize_t unused = write(fds_[3], &one, sizeof(one));
  (void)unused;
}

absl::StatusOr<shm::Completion> RawShmPeer::NextCompletion(double timeout_seconds) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_seconds);
  while (true) {
    const uint64_t tail = ring_->header.comp_tail.load(std::memory_order_relaxed);
    if (ring_->header.comp_head.load(std::memory_order_acquire) > tail) {
      const shm::Completion c = ring_->comps[tail % shm::kRingSlots];
      ring_->header.comp_tail.store(tail + 1, std::memory_order_release);
      return c;
    }
    pollfd fds[2] = {{fds_[4], POLLIN, 0}, {conn_, POLLRDHUP, 0}};
    if (poll(fds, 2, 20) > 0) {
      if (fds[0].revents & POLLIN) {
        uint64_t count;
        ssize_t unused = read(fds_[4], &count, sizeof(count));
        (void)unused;
        continue;
      }
      if (fds[1].revents & (POLLRDHUP | POLLHUP | POLLERR)) {
        return absl::UnavailableError("the daemon ended the shared-memory session");
      }
    }
    if (Clock::now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("no completion within ", timeout_seconds, " s"));
    }
  }
}

absl::Status RawShmPeer::Ring(const shm::Submission& sub, double timeout_seconds) {
  Publish(sub, sub.seq + 1);
  while (true) {
    absl::StatusOr<shm::Completion> c = NextCompletion(timeout_seconds);
    if (!c.ok()) return c.status();
    if (c->seq != sub.seq) continue;  // an earlier submission's
    return absl::Status(static_cast<absl::StatusCode>(c->code),
                        std::string(c->message, strnlen(c->message, shm::kMessageBytes)));
  }
}

bool RawShmPeer::WaitHangUp(double timeout_seconds) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_seconds);
  while (Clock::now() < deadline) {
    pollfd p{conn_, POLLIN | POLLRDHUP, 0};
    if (poll(&p, 1, 20) > 0) {
      char byte;
      if (p.revents & (POLLHUP | POLLRDHUP | POLLERR)) return true;
      if ((p.revents & POLLIN) && recv(conn_, &byte, 1, MSG_DONTWAIT) == 0) return true;
    }
  }
  return false;
}

}  // namespace muond::shmtest
