// The node-local shared-memory data plane's wire format (DESIGN.md section 5).
//
// A rank attaches over a Unix SOCK_SEQPACKET socket (muond.v1.ShmAttachRequest, one datagram); the
// daemon answers with muond.v1.ShmAttachResponse and, in the same datagram, five descriptors
// (SCM_RIGHTS), in this order:
//   0  gradient region (memfd, 2 buffers of `buffer_bytes`; the client writes, the daemon reads)
//   1  update region   (memfd, 2 buffers; sealed F_SEAL_FUTURE_WRITE: the client can only read)
//   2  ring            (memfd, kRingBytes: RingHeader, submissions, completions)
//   3  doorbell        (eventfd: the client writes 1 after publishing a submission)
//   4  completion      (eventfd: the daemon writes 1 after publishing a completion)
// Step t uses buffer t % B of both regions, B the job's step_buffers (1 or 2; each region holds B
// buffers of ShmAttachResponse.buffer_bytes). The connection stays open for the session: its
// hang-up ends the session (a step in flight is aborted and the job fenced).
//
// Refusals are a ShmAttachResponse with a non-zero code and no descriptors, after which the daemon
// closes the connection. It may send one before reading the request (RESOURCE_EXHAUSTED: too many
// connections, or out of descriptors), or when no attach completed in time (DEADLINE_EXCEEDED); a
// client must therefore read the answer even when its send failed (EPIPE) or its first receive
// reported ECONNRESET. An attach request is one datagram of at most 64 KiB by default.
//
// The ring is single-producer/single-consumer each way. Indices only grow; slot = index % kRingSlots.
// The daemon treats everything the client writes as hostile: indices, sizes and strings are
// validated, and a malformed ring ends the session.
#ifndef MUOND_COMMON_SHM_PROTOCOL_H_
#define MUOND_COMMON_SHM_PROTOCOL_H_

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace muond::common::shm {

inline constexpr uint32_t kRingMagic = 0x6d756f6e;  // "muon"
inline constexpr uint32_t kRingVersion = 3;
inline constexpr uint32_t kRingSlots = 8;
inline constexpr size_t kMessageBytes = 240;
inline constexpr int kNumFds = 5;
// Sent by the client on the socket to end its session cleanly (a hang-up without it is a death).
inline constexpr char kDetachByte = 'D';

// What a submission asks (Submission::kind).
inline constexpr uint32_t kSubmitStep = 0;
// Apply mode: "buffer 0 of the gradient region holds my initial parameters", each span at its
// ShmSpan.param_byte_offset in the tensor's param_dtype. `step` must be -1 and `buffer` 0; the
// completion's step is -1. Refused while a step is in flight.
inline constexpr uint32_t kSubmitInitParams = 1;

// Apply mode: the hyperparameters of a step, at ShmAttachResponse.hyper_byte_offset of the step's
// gradient buffer (8-byte aligned): float64 lr[G], then float64 weight_decay[G], then the float64
// gradient divisor, with G the job's groups in order; then the presence mask, one byte per job
// tensor in order: 0 the tensor has a gradient this step, 1 it has none (skipped, DESIGN.md 4b;
// any other value is refused); the mask starts after two more float64: the global clip's mode
// (0: none, 1: speculate, 2: clip by the global sum; server/engine/step_state.h ClipSource) and the
// global raw sum of squares. Then, for a job with QK-Clip (DESIGN.md 4e), at
// MaxLogitsOffset(G, T) (4-byte aligned), L float32: the rank's largest attention logit of each
// query head, pair after pair (L = QkClip::logits()). HyperBytes(G, T, L) bytes.
inline constexpr size_t MaxLogitsOffset(size_t groups, size_t tensors) {
  return ((2 * groups + 3) * sizeof(double) + tensors + 3) / 4 * 4;
}
inline constexpr size_t HyperBytes(size_t groups, size_t tensors, size_t logits = 0) {
  return logits == 0 ? (2 * groups + 3) * sizeof(double) + tensors
                     : MaxLogitsOffset(groups, tensors) + logits * sizeof(float);
}

// Update mode with max_grad_norm: at ShmAttachResponse.hyper_byte_offset of the step's gradient
// buffer (8-byte aligned), one float64: the rank's sum of squares of its gradients outside the job
// (the tensors the trainer updates itself), which the step's norm adds to the job's matrices'.
// Read with the rank's last part (a whole-buffer step's one submission); finite and >= 0, else the
// step is refused (a non-finite one as a non-finite gradient). The step's completion carries the
// whole norm's raw sum of squares (Completion::grad_sum_sq).
inline constexpr size_t kOutsideSumSqBytes = sizeof(double);

// A part of a step (DESIGN.md 5, "parts"): [offset, offset + size) of the step's gradient buffer
// holds whole spans of the rank, and more parts follow. The rank's last part is a kSubmitStep, so a
// whole-buffer kSubmitStep (offset 0, size buffer_bytes) is a step in one part. Every span lies in
// exactly one part; a part that cuts a span, overlaps an earlier part of the step, lies outside
// the buffer, or follows the last part is refused (INVALID_ARGUMENT) and the step with it. Each
// submission gets one completion: a part's when the daemon took it (its spans are checked and
// queued), the last part's when the step ended. A client keeps at most kRingSlots submissions
// without their completion (the completion ring holds that many). Apply mode: the hyperparameters
// are read with the first part.
inline constexpr uint32_t kSubmitStepPart = 2;

// One doorbell: "the gradients of `step` are in buffer `buffer` at [offset, offset + size)".
// A valid one has buffer == step % step_buffers, offset + size <= buffer_bytes and the session's
// generation; an initial-parameter submission covers the whole buffer.
struct Submission {
  uint64_t seq;
  int64_t step;
  uint64_t generation;
  uint32_t buffer;
  uint32_t kind;  // kSubmitStep or kSubmitInitParams
  uint64_t offset;
  uint64_t size;
};

// The outcome of a submission: code 0 (OK) means the update of `step` is in buffer step % B of the
// update region. Otherwise `code` is a gRPC status code and `message` says why (NUL-terminated).
struct Completion {
  uint64_t seq;
  int64_t step;
  int32_t code;
  uint32_t flags;  // kCompletionReplayed | kCompletionSkipped (with code 0)
  double seconds;
  // Apply mode: RankUpdate::grad_sum_sq (a node's raw sum of squares); update mode with
  // max_grad_norm: the step's whole raw sum of squares (the trainer clips its own tensors by it).
  double grad_sum_sq;
  char message[kMessageBytes];
};

// Completion flags. Replayed: a retry of the step that committed last; the update region holds its
// committed bytes. Skipped: the step was skipped (a non-finite gradient on some rank, job option
// "nonfinite": "skip"): nothing in the job's state changed and the update region was not written.
inline constexpr uint32_t kCompletionReplayed = 1;
inline constexpr uint32_t kCompletionSkipped = 2;

struct RingHeader {
  uint32_t magic;
  uint32_t version;
  uint64_t generation;
  std::atomic<uint64_t> sub_head;   // written by the client
  std::atomic<uint64_t> sub_tail;   // written by the daemon
  std::atomic<uint64_t> comp_head;  // written by the daemon
  std::atomic<uint64_t> comp_tail;  // written by the client
};

// Progress words (ShmAttachResponse.progress_byte_offset in the update region, one int64 per
// span of the rank, in span order): step + 1 once span i's update (apply mode: new parameters) of
// `step` is in buffer step % B of the update region, written by the daemon (release) as each
// batch of matrices finishes, before the step's completion; the completion eventfd is written
// after each batch. A word says the bytes are final for that step if the step commits: a step
// that fails after some words were set commits nothing, and its bytes must not be kept. Jobs that
// clip the gradient norm (max_grad_norm) recompute a clipped step, so their words are set only
// when the step committed (with its completion).
inline constexpr size_t ProgressBytes(size_t spans) { return spans * sizeof(int64_t); }

struct Ring {
  RingHeader header;
  Submission subs[kRingSlots];
  Completion comps[kRingSlots];
};

inline constexpr size_t kRingBytes = 4096;
static_assert(sizeof(Ring) <= kRingBytes, "the ring must fit its region");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "ring indices must be lock-free");

}  // namespace muond::common::shm

#endif  // MUOND_COMMON_SHM_PROTOCOL_H_
