// QK-Clip (MuonClip, DESIGN.md 4e) in job specs: the "qk_clip" block of job.json, its canonical
// form, its rules, and the check of a step's per-head maxima.
#include <cmath>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/job_spec_json.h"
#include "common/names.h"

namespace muond::common {
namespace json_fields {

absl::Status ParseQkClipField(const Json& root, JobSpec* spec) {
  const auto it = root.find("qk_clip");
  if (it == root.end()) return absl::OkStatus();
  const Json& q = *it;
  if (!q.is_object()) return FieldError("qk_clip", "expected an object");
  RETURN_IF_ERROR(CheckKnownFields(q, "qk_clip.", {"threshold", "alpha", "pairs"}));
  if (q.find("threshold") == q.end()) return FieldError("qk_clip.threshold", "missing");
  RETURN_IF_ERROR(ReadDouble(q, "threshold", "qk_clip.threshold", &spec->qk_clip.threshold));
  RETURN_IF_ERROR(ReadDouble(q, "alpha", "qk_clip.alpha", &spec->qk_clip.alpha));
  const auto pairs = q.find("pairs");
  if (pairs == q.end()) return FieldError("qk_clip.pairs", "missing");
  if (!pairs->is_array() || pairs->empty()) {
    return FieldError("qk_clip.pairs", "expected an array of at least one pair");
  }
  if (pairs->size() > kMaxQkClipPairs) {
    return FieldError("qk_clip.pairs",
                      absl::StrCat(pairs->size(), " pairs; at most ", kMaxQkClipPairs));
  }
  for (size_t i = 0; i < pairs->size(); ++i) {
    const std::string path = absl::StrCat("qk_clip.pairs[", i, "]");
    const Json& p = (*pairs)[i];
    if (!p.is_object()) return FieldError(path, "expected an object");
    RETURN_IF_ERROR(CheckKnownFields(p, path + ".", {"q", "k", "q_heads", "kv_heads", "head_dim"}));
    QkClipPair pair;
    for (const char* key : {"q", "k", "q_heads", "kv_heads", "head_dim"}) {
      if (p.find(key) == p.end()) return FieldError(absl::StrCat(path, ".", key), "missing");
    }
    RETURN_IF_ERROR(ReadString(p, "q", path + ".q", &pair.q));
    RETURN_IF_ERROR(ReadString(p, "k", path + ".k", &pair.k));
    RETURN_IF_ERROR(ReadInt64(p, "q_heads", path + ".q_heads", &pair.q_heads));
    RETURN_IF_ERROR(ReadInt64(p, "kv_heads", path + ".kv_heads", &pair.kv_heads));
    RETURN_IF_ERROR(ReadInt64(p, "head_dim", path + ".head_dim", &pair.head_dim));
    spec->qk_clip.pairs.push_back(std::move(pair));
  }
  return absl::OkStatus();
}

void WriteQkClipField(const JobSpec& spec, Json* root) {
  if (!spec.qk_clip.enabled()) return;
  Json pairs = Json::array();
  for (const QkClipPair& p : spec.qk_clip.pairs) {
    pairs.push_back({{"q", p.q},
                     {"k", p.k},
                     {"q_heads", p.q_heads},
                     {"kv_heads", p.kv_heads},
                     {"head_dim", p.head_dim}});
  }
  (*root)["qk_clip"] = {{"threshold", spec.qk_clip.threshold},
                        {"alpha", spec.qk_clip.alpha},
                        {"pairs", std::move(pairs)}};
}

}  // namespace json_fields

namespace {

absl::Status Invalid(const std::string& path, const std::string& problem) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", problem));
}

// Checks that tensor `name` (the pair's `role`) exists, is a 2-D Muon tensor of one head whose
// rows are `heads` x `head_dim`; its index into *index and its columns into *in.
absl::Status CheckPairTensor(const JobSpec& spec, const std::map<std::string, uint32_t>& by_name,
                             const std::string& path, const std::string& name, int64_t heads,
                             int64_t head_dim, const char* heads_key, uint32_t* index,
                             int64_t* in) {
  const auto it = by_name.find(name);
  if (it == by_name.end()) {
    return Invalid(path, absl::StrCat("tensor ", Quoted(name), " is not a tensor of the job"));
  }
  const MatrixSpec& m = spec.matrices[it->second];
  if (m.optimizer != Optimizer::kMuon) {
    return Invalid(path, absl::StrCat("tensor ", Quoted(name),
                                      " is optimized by AdamW; QK-Clip applies to Muon tensors"));
  }
  // heads * head_dim without overflow: both are >= 1 and bounded by the rows first.
  if (m.shape.size() != 2 || m.num_heads != 1 || heads > m.shape[0] || head_dim > m.shape[0] ||
      heads * head_dim != m.shape[0]) {
    std::string shape;
    for (size_t d = 0; d < m.shape.size(); ++d) absl::StrAppend(&shape, d ? ", " : "", m.shape[d]);
    return Invalid(path, absl::StrCat("tensor ", Quoted(name), " has shape [", shape, "]",
                                      m.num_heads != 1 ? " and num_heads > 1" : "", "; expected [",
                                      heads_key, " * head_dim, in] = [", heads, " * ", head_dim,
                                      ", in] with num_heads 1"));
  }
  *index = it->second;
  *in = m.shape[1];
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateQkClip(const JobSpec& spec) {
  const QkClip& c = spec.qk_clip;
  if (!c.enabled()) return absl::OkStatus();
  if (spec.mode != JobMode::kApply) {
    return Invalid("qk_clip", "QK-Clip rescales the master weights: mode 'apply' only");
  }
  if (spec.multinode.nodes > 0) {
    return Invalid("qk_clip",
                   "QK-Clip is not supported on a node of a multi-node job (a pair's query and "
                   "key tensors may be owned by different nodes); run it on one node");
  }
  if (!std::isfinite(c.threshold) || c.threshold <= 0) {
    return Invalid("qk_clip.threshold", absl::StrCat(c.threshold, " must be finite and > 0"));
  }
  if (!(c.alpha >= 0 && c.alpha <= 1)) {
    return Invalid("qk_clip.alpha", absl::StrCat(c.alpha, " must be in [0, 1]"));
  }
  if (c.pairs.size() > kMaxQkClipPairs) {
    return Invalid("qk_clip.pairs",
                   absl::StrCat(c.pairs.size(), " pairs; at most ", kMaxQkClipPairs));
  }
  std::map<std::string, uint32_t> by_name;
  for (uint32_t t = 0; t < spec.matrices.size(); ++t) by_name.emplace(spec.matrices[t].name, t);
  std::map<uint32_t, std::string> used;  // tensor -> the pair field that named it
  size_t logits = 0;
  for (size_t i = 0; i < c.pairs.size(); ++i) {
    const QkClipPair& p = c.pairs[i];
    const std::string path = absl::StrCat("qk_clip.pairs[", i, "]");
    if (p.q_heads < 1 || p.kv_heads < 1 || p.head_dim < 1) {
      return Invalid(path, absl::StrCat("q_heads ", p.q_heads, ", kv_heads ", p.kv_heads,
                                        " and head_dim ", p.head_dim, " must be >= 1"));
    }
    if (p.q_heads % p.kv_heads != 0) {
      return Invalid(path,
                     absl::StrCat("kv_heads ", p.kv_heads, " does not divide q_heads ", p.q_heads));
    }
    if (p.q == p.k) return Invalid(path, absl::StrCat("q and k are the same tensor ", Quoted(p.q)));
    uint32_t q = 0, k = 0;
    int64_t q_in = 0, k_in = 0;
    RETURN_IF_ERROR(CheckPairTensor(spec, by_name, path + ".q", p.q, p.q_heads, p.head_dim,
                                    "q_heads", &q, &q_in));
    RETURN_IF_ERROR(CheckPairTensor(spec, by_name, path + ".k", p.k, p.kv_heads, p.head_dim,
                                    "kv_heads", &k, &k_in));
    if (q_in != k_in) {
      return Invalid(path, absl::StrCat("q has ", q_in, " columns and k ", k_in,
                                        "; both project the same input"));
    }
    for (const auto& [t, role] : {std::pair<uint32_t, std::string>{q, path + ".q"},
                                  std::pair<uint32_t, std::string>{k, path + ".k"}}) {
      const auto [at, fresh] = used.emplace(t, role);
      if (!fresh) {
        return Invalid(role,
                       absl::StrCat("tensor ", Quoted(spec.matrices[t].name), " is already in ",
                                    at->second, "; a tensor may be in one pair only"));
      }
    }
    logits += static_cast<size_t>(p.q_heads);
    if (logits > kMaxQkClipLogits) {
      return Invalid("qk_clip.pairs",
                     absl::StrCat("more than ", kMaxQkClipLogits, " query heads in all"));
    }
  }
  return absl::OkStatus();
}

std::vector<std::pair<uint32_t, uint32_t>> QkClipTensors(const JobSpec& spec) {
  std::map<std::string, uint32_t> by_name;
  for (uint32_t t = 0; t < spec.matrices.size(); ++t) by_name.emplace(spec.matrices[t].name, t);
  std::vector<std::pair<uint32_t, uint32_t>> out;
  for (const QkClipPair& p : spec.qk_clip.pairs) out.emplace_back(by_name.at(p.q), by_name.at(p.k));
  return out;
}

absl::Status CheckMaxLogits(const JobSpec& spec, const std::vector<float>& logits,
                            const std::string& where) {
  const QkClip& c = spec.qk_clip;
  if (!c.enabled()) {
    if (logits.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": the step carries ", logits.size(),
                     " max attention logits, but the job has no qk_clip pairs"));
  }
  size_t at = 0;
  for (const QkClipPair& p : c.pairs) {
    if (logits.size() < at + static_cast<size_t>(p.q_heads)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the step carries ", logits.size(),
                       " max attention logits; QK-Clip pair q=", Quoted(p.q), " needs its ",
                       p.q_heads, " per-head values (", c.logits(), " in all, pair after pair)"));
    }
    for (int64_t h = 0; h < p.q_heads; ++h, ++at) {
      if (!std::isfinite(logits[at])) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": the max attention logit of head ",
                                                       h, " of QK-Clip pair q=", Quoted(p.q),
                                                       " is not finite (", logits[at], ")"));
      }
    }
  }
  if (at != logits.size()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": the step carries ", logits.size(),
                                                   " max attention logits; the job's QK-Clip "
                                                   "pairs have ",
                                                   at, " query heads"));
  }
  return absl::OkStatus();
}

}  // namespace muond::common
