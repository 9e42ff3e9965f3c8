// `muonctl step`: one rank's step from a safetensors file (normative formats):
//   - zero_stage 0, world size 1: one tensor per matrix, named by the matrix, in its full shape;
//   - zero_stage 1/2 (and explicit layouts): one 1-D tensor `partition` with the rank's buffer
//     (P = ceil(total / world_size) elements for 1/2, tail padded);
//   - zero_stage 3: per matrix a 1-D tensor named by the matrix with the rank's chunk
//     (ceil(numel / world_size) elements, padded).
// OUT has the same names, shapes and dtypes; padding is zero. Apply-mode jobs (DESIGN.md 4b):
// the step carries --lr GROUP=VALUE for every group (--wd, --grad-divisor optional), and OUT holds
// the rank's new parameters, laid out the same but in each tensor's param dtype. A job with
// qk_clip (DESIGN.md 4e) also takes --max-logits FILE: one float32 tensor per pair, named by the
// pair's q tensor, with the largest attention logit of each of its q_heads query heads.
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/muonctl_util.h"
#include "client/span_placement.h"
#include "common/job_spec_proto.h"
#include "common/layout.h"
#include "common/safetensors.h"
#include "common/status_macros.h"

namespace muond::client {
namespace {

std::string Names(const common::SafetensorsFile& file) {
  std::vector<std::string> names;
  for (const common::TensorInfo& t : file.tensors()) names.push_back("'" + t.name + "'");
  return names.empty() ? "none" : absl::StrJoin(names, ", ");
}

// Checks that `t` is a 1-D tensor of `n` elements of `dtype`.
absl::Status Expect1D(const common::TensorInfo& t, uint64_t n, common::DType dtype,
                      const std::string& why) {
  if (t.shape.size() != 1 || static_cast<uint64_t>(t.shape[0]) != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", t.name, "' has shape [", absl::StrJoin(t.shape, ", "),
                     "]; expected [", n, "] (", why, ")"));
  }
  if (t.dtype != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", t.name, "' is ", std::string(common::DTypeName(t.dtype)), "; expected ",
        std::string(common::DTypeName(dtype))));
  }
  return absl::OkStatus();
}

struct StepOutput {
  std::vector<NamedTensor> tensors;
  StepResult result;
};

// zero_stage 1/2 or an explicit layout: one `partition` tensor.
absl::StatusOr<StepOutput> StepPartition(RankSession& s, int64_t step,
                                         const common::SafetensorsFile& in) {
  const common::JobSpec& spec = s.spec();
  const uint64_t n = s.buffer_elements();
  const common::TensorInfo* t = in.Find("partition");
  if (t == nullptr || in.tensors().size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a job with ", spec.explicit_layout.empty() ? absl::StrCat("zero_stage ", spec.zero_stage)
                                                    : std::string("an explicit layout"),
        " takes one 1-D tensor 'partition' with rank ", s.rank(), "'s ", n,
        " elements; the file holds ", Names(in)));
  }
  RETURN_IF_ERROR(Expect1D(*t, n, spec.matrices[0].dtype, "the rank's partition"));
  StepOutput out;
  const common::DType out_dtype = OutputDType(spec, spec.matrices[0]);
  NamedTensor u{"partition", out_dtype, t->shape,
                std::string(n * common::DTypeSize(out_dtype), '\0')};
  ASSIGN_OR_RETURN(out.result, s.StepBuffer(step, in.Data(*t).data(), u.data.data()));
  out.tensors.push_back(std::move(u));
  return out;
}

// zero_stage 3: per matrix, the rank's padded chunk.
absl::StatusOr<StepOutput> StepChunks(RankSession& s, int64_t step,
                                      const common::SafetensorsFile& in) {
  const common::JobSpec& spec = s.spec();
  const uint64_t world = static_cast<uint64_t>(spec.world_size);
  std::map<std::string, const common::TensorInfo*> by_name;
  for (const common::TensorInfo& t : in.tensors()) by_name[t.name] = &t;
  StepOutput out;
  std::vector<const common::TensorInfo*> inputs;
  for (const common::MatrixSpec& ms : spec.matrices) {
    auto it = by_name.find(ms.name);
    if (it == by_name.end()) {
      return absl::InvalidArgumentError(absl::StrCat("the chunk of matrix '", ms.name,
                                                     "' is missing (the file holds ", Names(in),
                                                     ")"));
    }
    const uint64_t chunk = (static_cast<uint64_t>(ms.numel()) + world - 1) / world;
    RETURN_IF_ERROR(Expect1D(*it->second, chunk, ms.dtype, "the rank's padded chunk"));
    inputs.push_back(it->second);
    const common::DType out_dtype = OutputDType(spec, ms);
    out.tensors.push_back({ms.name, out_dtype, it->second->shape,
                           std::string(chunk * common::DTypeSize(out_dtype), '\0')});
    by_name.erase(it);
  }
  if (!by_name.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", by_name.begin()->first,
                                                   "' is not a matrix of job '", spec.job_id,
                                                   "'"));
  }
  // A rank's span of a stage 3 matrix starts its chunk.
  std::vector<GradientSpan> grads;
  std::vector<UpdateSpan> updates;
  for (const common::ShardSpan& span : s.spans()) {
    grads.push_back({span.matrix, span.offset, in.Data(*inputs[span.matrix]).data(), span.length});
    updates.push_back({span.matrix, span.offset, out.tensors[span.matrix].data.data(), span.length});
  }
  ASSIGN_OR_RETURN(out.result, s.Step(step, grads, updates));
  return out;
}

absl::StatusOr<StepOutput> StepWhole(RankSession& s, int64_t step,
                                     const common::SafetensorsFile& in) {
  std::vector<NamedTensor> grads;
  for (const common::TensorInfo& t : in.tensors()) {
    grads.push_back({t.name, t.dtype, t.shape, std::string(in.Data(t))});
  }
  StepOutput out;
  ASSIGN_OR_RETURN(out.tensors, s.StepTensors(step, grads, &out.result));
  return out;
}

// The hyperparameters of a step of `spec` from the --lr/--wd/--grad-divisor flags: nullopt for
// an update-mode job (INVALID_ARGUMENT when the flags are given anyway); ResolveStepHyper's
// errors for an apply-mode job.
absl::StatusOr<std::optional<StepHyper>> HyperForJob(const common::JobSpec& spec,
                                                     const std::optional<StepHyper>& flags) {
  if (spec.mode != common::JobMode::kApply) {
    if (!flags) return std::nullopt;
    return absl::InvalidArgumentError(absl::StrCat(
        "job '", spec.job_id, "' is in mode 'update' (the trainer applies the update): --lr, --wd "
        "and --grad-divisor are for mode 'apply' jobs"));
  }
  const StepHyper hyper = flags.value_or(StepHyper{});
  RETURN_IF_ERROR(ResolveStepHyper(spec, hyper).status());
  return hyper;
}

// QK-Clip (DESIGN.md 4e): the per-head maxima of --max-logits FILE, one float32 tensor per pair
// of `spec` named by its q tensor with q_heads values (normative), in pair order. Without the
// flag: empty (a qk_clip job's step is then refused by the session, naming --max-logits).
absl::StatusOr<std::vector<float>> MaxLogitsForJob(const common::JobSpec& spec, const Args& a) {
  const auto flag = a.flags.find("max-logits");
  if (flag == a.flags.end()) return std::vector<float>();
  if (!spec.qk_clip.enabled()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-logits: job '", spec.job_id, "' has no qk_clip pairs (job.json \"qk_clip\")"));
  }
  ASSIGN_OR_RETURN(common::SafetensorsFile file, common::SafetensorsFile::ReadFile(flag->second));
  std::vector<float> logits;
  std::map<std::string, bool> names;
  for (const common::QkClipPair& p : spec.qk_clip.pairs) names[p.q] = true;
  for (const common::TensorInfo& t : file.tensors()) {
    if (names.count(t.name) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag->second, ": tensor '", t.name,
                       "' is not the q tensor of a QK-Clip pair of job '", spec.job_id, "'"));
    }
  }
  for (const common::QkClipPair& p : spec.qk_clip.pairs) {
    const common::TensorInfo* t = file.Find(p.q);
    if (t == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          flag->second, ": no tensor '", p.q, "' (the max attention logit of each of the pair's ",
          p.q_heads, " query heads, float32); the file holds ", Names(file)));
    }
    if (absl::Status e = Expect1D(*t, static_cast<uint64_t>(p.q_heads), common::DType::kFloat32,
                                  "one value per query head");
        !e.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(flag->second, ": ", e.message()));
    }
    const std::string_view data = file.Data(*t);
    const size_t at = logits.size();
    logits.resize(at + static_cast<size_t>(p.q_heads));
    std::memcpy(logits.data() + at, data.data(), static_cast<size_t>(p.q_heads) * sizeof(float));
  }
  RETURN_IF_ERROR(common::CheckMaxLogits(spec, logits, "--max-logits " + flag->second));
  return logits;
}

}  // namespace

absl::Status CmdStep(Client& client, const Args& a) {
  for (const char* f : {"job", "rank", "step", "grads", "out"}) {
    if (a.flags.count(f) == 0) return absl::InvalidArgumentError(absl::StrCat("step needs --", f));
  }
  ASSIGN_OR_RETURN(int64_t rank, IntFlag(a, "rank"));
  ASSIGN_OR_RETURN(int64_t step, IntFlag(a, "step"));
  ASSIGN_OR_RETURN(std::string token, Token(a));
  ASSIGN_OR_RETURN(const std::optional<StepHyper> hyper_flags, StepHyperFlags(a));
  const std::string& in_path = a.flags.at("grads");
  ASSIGN_OR_RETURN(common::SafetensorsFile in, common::SafetensorsFile::ReadFile(in_path));
  if (rank < 0 || rank > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("--rank ", rank, " is out of range"));
  }
  Transport transport = Transport::kAuto;
  if (a.flags.count("transport") != 0) {
    ASSIGN_OR_RETURN(transport, ParseTransport(a.flags.at("transport")));
  }
  // The job's mode decides which flags the step takes. Checked before attaching: a refused
  // command must not touch the rank's session (its detach would abort a step other ranks are in).
  ASSIGN_OR_RETURN(const v1::JobStatus status, client.GetJob(a.flags.at("job"), token));
  ASSIGN_OR_RETURN(const common::JobSpec job_spec, common::JobSpecFromProto(status.spec()));
  ASSIGN_OR_RETURN(const std::optional<StepHyper> hyper, HyperForJob(job_spec, hyper_flags));
  ASSIGN_OR_RETURN(std::vector<float> max_logits, MaxLogitsForJob(job_spec, a));
  // Each muonctl run is a new process acting for the rank: it takes the rank over (a previous
  // muonctl for it has exited) and detaches when done.
  ASSIGN_OR_RETURN(auto session, client.Attach(a.flags.at("job"), static_cast<int>(rank), token,
                                               /*takeover=*/true, transport));
  if (hyper) RETURN_IF_ERROR(session->SetHyper(*hyper));
  if (!max_logits.empty()) RETURN_IF_ERROR(session->SetMaxLogits(std::move(max_logits)));
  const common::JobSpec& spec = session->spec();
  absl::StatusOr<StepOutput> out;
  if (!spec.explicit_layout.empty() || spec.zero_stage == 1 || spec.zero_stage == 2) {
    out = StepPartition(*session, step, in);
  } else if (spec.zero_stage == 3) {
    out = StepChunks(*session, step, in);
  } else {
    out = StepWhole(*session, step, in);
  }
  if (!out.ok()) {
    return absl::Status(out.status().code(), absl::StrCat(in_path, ": ", out.status().message()));
  }
  const char* via = session->transport() == Transport::kShm ? "shm" : "grpc";
  if (out->result.skipped) {
    // Nothing was computed: no update file is written (an existing one is left as it was).
    std::printf("step %lld: job %s rank %lld (%s): skipped: a rank's gradients held a NaN or Inf "
                "(job option nonfinite=skip); nothing changed, no update written, next step "
                "%lld\n",
                static_cast<long long>(step), spec.job_id.c_str(), static_cast<long long>(rank), via,
                static_cast<long long>(step + 1));
    return absl::OkStatus();
  }
  std::vector<common::TensorRef> refs;
  for (const NamedTensor& u : out->tensors) refs.push_back({u.name, u.dtype, u.shape, u.data});
  RETURN_IF_ERROR(common::WriteSafetensorsFile(
      a.flags.at("out"), refs, {{"job", spec.job_id}, {"step", std::to_string(step)},
                                {"rank", std::to_string(rank)}}));
  const StepResult& r = out->result;
  std::printf("step %lld: job %s rank %lld (%s): %zu tensors, %llu bytes in, %llu bytes out, "
              "step time %.3f s%s -> %s\n",
              static_cast<long long>(step), spec.job_id.c_str(), static_cast<long long>(rank), via,
              out->tensors.size(), static_cast<unsigned long long>(r.bytes_in),
              static_cast<unsigned long long>(r.bytes_out), r.compute_seconds,
              r.replayed ? " (replayed)" : "", a.flags.at("out").c_str());
  return absl::OkStatus();
}

}  // namespace muond::client
