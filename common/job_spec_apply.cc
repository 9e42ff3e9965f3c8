// Apply mode (DESIGN.md 4b) in job specs: its job.json fields, their canonical form and their
// rules. An update-mode spec never carries them, so its job.json stays as it was.
#include <cmath>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/job_spec_json.h"
#include "common/names.h"

namespace muond::common {

std::string_view JobModeName(JobMode m) {
  switch (m) {
    case JobMode::kUpdate:
      return "update";
    case JobMode::kApply:
      return "apply";
  }
  return "unknown";
}

absl::StatusOr<JobMode> ParseJobMode(std::string_view name) {
  if (name == "update") return JobMode::kUpdate;
  if (name == "apply") return JobMode::kApply;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown mode ", Quoted(std::string(name)), " (accepted: update, apply)"));
}

std::string_view OptimizerName(Optimizer o) {
  switch (o) {
    case Optimizer::kMuon:
      return "muon";
    case Optimizer::kAdamW:
      return "adamw";
  }
  return "unknown";
}

absl::StatusOr<Optimizer> ParseOptimizer(std::string_view name) {
  if (name == "muon") return Optimizer::kMuon;
  if (name == "adamw") return Optimizer::kAdamW;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown optimizer ", Quoted(std::string(name)), " (accepted: muon, adamw)"));
}

namespace json_fields {
namespace {

absl::Status ParseGroups(const Json& groups, std::vector<ParamGroup>* out) {
  if (!groups.is_array()) return FieldError("groups", "expected an array");
  if (groups.size() > kMaxParamGroups) {
    return FieldError("groups", absl::StrCat(groups.size(), " groups; at most ", kMaxParamGroups));
  }
  for (size_t i = 0; i < groups.size(); ++i) {
    const std::string path = absl::StrCat("groups[", i, "]");
    const Json& g = groups[i];
    if (!g.is_object()) return FieldError(path, "expected an object");
    RETURN_IF_ERROR(CheckKnownFields(g, path + ".", {"name", "lr", "weight_decay"}));
    ParamGroup group;
    if (g.find("name") == g.end()) return FieldError(path + ".name", "missing");
    RETURN_IF_ERROR(ReadString(g, "name", path + ".name", &group.name));
    if (g.find("lr") == g.end()) return FieldError(path + ".lr", "missing");
    RETURN_IF_ERROR(ReadDouble(g, "lr", path + ".lr", &group.lr));
    RETURN_IF_ERROR(ReadDouble(g, "weight_decay", path + ".weight_decay", &group.weight_decay));
    out->push_back(std::move(group));
  }
  return absl::OkStatus();
}

absl::Status ParseAdamW(const Json& adamw, AdamWConfig* out) {
  if (!adamw.is_object()) return FieldError("adamw", "expected an object");
  RETURN_IF_ERROR(CheckKnownFields(adamw, "adamw.", {"betas", "eps"}));
  if (const auto it = adamw.find("betas"); it != adamw.end()) {
    if (!it->is_array() || it->size() != 2 || !(*it)[0].is_number() || !(*it)[1].is_number()) {
      return FieldError("adamw.betas", "expected an array of two numbers");
    }
    out->beta1 = (*it)[0].get<double>();
    out->beta2 = (*it)[1].get<double>();
  }
  return ReadDouble(adamw, "eps", "adamw.eps", &out->eps);
}

}  // namespace

absl::Status ParseApplyFields(const Json& root, JobSpec* spec) {
  RETURN_IF_ERROR(ReadEnum(root, "mode", "mode", ParseJobMode, &spec->mode));
  if (const auto it = root.find("groups"); it != root.end()) {
    RETURN_IF_ERROR(ParseGroups(*it, &spec->groups));
  }
  if (const auto it = root.find("adamw"); it != root.end()) {
    RETURN_IF_ERROR(ParseAdamW(*it, &spec->adamw));
  }
  RETURN_IF_ERROR(ReadDouble(root, "max_grad_norm", "max_grad_norm", &spec->max_grad_norm));
  return ReadString(root, "init_from", "init_from", &spec->init_from);
}

absl::Status ParseTensorApplyFields(const Json& tensor, const std::string& path, MatrixSpec* spec) {
  RETURN_IF_ERROR(
      ReadEnum(tensor, "optimizer", path + ".optimizer", ParseOptimizer, &spec->optimizer));
  RETURN_IF_ERROR(ReadString(tensor, "group", path + ".group", &spec->group));
  spec->param_dtype = spec->dtype;
  return ReadEnum(tensor, "param_dtype", path + ".param_dtype", ParseDType, &spec->param_dtype);
}

void WriteApplyFields(const JobSpec& spec, Json* root) {
  if (spec.mode != JobMode::kApply) {
    // Update mode clips too (the norm over the job's matrices and the trainer's share).
    if (spec.max_grad_norm != 0) (*root)["max_grad_norm"] = spec.max_grad_norm;
    return;
  }
  (*root)["mode"] = std::string(JobModeName(spec.mode));
  Json tensors = std::move((*root)["matrices"]);
  root->erase("matrices");
  for (size_t i = 0; i < tensors.size() && i < spec.matrices.size(); ++i) {
    const MatrixSpec& m = spec.matrices[i];
    tensors[i]["optimizer"] = std::string(OptimizerName(m.optimizer));
    tensors[i]["group"] = m.group;
    tensors[i]["param_dtype"] = std::string(DTypeName(m.param_dtype));
  }
  (*root)["tensors"] = std::move(tensors);
  Json groups = Json::array();
  for (const ParamGroup& g : spec.groups) {
    groups.push_back({{"name", g.name}, {"lr", g.lr}, {"weight_decay", g.weight_decay}});
  }
  (*root)["groups"] = std::move(groups);
  (*root)["adamw"] = {{"betas", {spec.adamw.beta1, spec.adamw.beta2}}, {"eps", spec.adamw.eps}};
  (*root)["max_grad_norm"] = spec.max_grad_norm;
  (*root)["init_from"] = spec.init_from;
}

}  // namespace json_fields

void FillApplyDefaults(JobSpec* spec) {
  if (spec->mode != JobMode::kApply) return;
  for (MatrixSpec& m : spec->matrices) {
    if (m.group.empty()) m.group = std::string(OptimizerName(m.optimizer));
  }
}

namespace {

absl::Status Invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

absl::Status ValidateUpdateMode(const JobSpec& spec) {
  for (const MatrixSpec& m : spec.matrices) {
    if (m.optimizer != Optimizer::kMuon || !m.group.empty()) {
      return Invalid(absl::StrCat("tensor ", Quoted(m.name),
                                  ": optimizer and group apply to mode 'apply' only"));
    }
  }
  if (!spec.groups.empty() || !spec.init_from.empty()) {
    return Invalid("groups and init_from apply to mode 'apply' only");
  }
  if (!std::isfinite(spec.max_grad_norm) || spec.max_grad_norm < 0) {
    return Invalid(absl::StrCat("max_grad_norm ", spec.max_grad_norm, " must be finite and >= 0"));
  }
  if (spec.max_grad_norm > 0 && spec.two_phase()) {
    // The norm spans the nodes; only apply mode has the global clip of many nodes (DESIGN.md 4c).
    return Invalid(
        "max_grad_norm in mode 'update' clips by the norm on one node: a multi-node job clips "
        "globally in mode 'apply' only");
  }
  return absl::OkStatus();
}

absl::Status ValidateGroups(const JobSpec& spec) {
  if (spec.groups.empty() || spec.groups.size() > kMaxParamGroups) {
    return Invalid(absl::StrCat("groups: mode 'apply' needs 1..", kMaxParamGroups,
                                " parameter groups, got ", spec.groups.size()));
  }
  std::set<std::string_view> names;
  for (size_t i = 0; i < spec.groups.size(); ++i) {
    const ParamGroup& g = spec.groups[i];
    RETURN_IF_ERROR(ValidateTensorName(g.name, absl::StrCat("groups[", i, "].name")));
    if (!names.insert(g.name).second) {
      return Invalid(absl::StrCat("groups[", i, "]: group ", Quoted(g.name), " appears twice"));
    }
    if (!std::isfinite(g.lr) || g.lr < 0 || !std::isfinite(g.weight_decay) || g.weight_decay < 0) {
      return Invalid(absl::StrCat("groups[", i, "] ", Quoted(g.name), ": lr ", g.lr,
                                  " and weight_decay ", g.weight_decay,
                                  " must be finite and >= 0"));
    }
  }
  for (const MatrixSpec& m : spec.matrices) {
    if (names.count(m.group) == 0) {
      return Invalid(absl::StrCat("tensor ", Quoted(m.name), ": group ", Quoted(m.group),
                                  " is not one of the job's groups"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateApplyMode(const JobSpec& spec) {
  if (JobModeName(spec.mode) == "unknown") return Invalid("mode out of range");
  if (spec.mode == JobMode::kUpdate) return ValidateUpdateMode(spec);
  if (spec.transport_probe) return Invalid("a transport probe runs in mode 'update' only");
  RETURN_IF_ERROR(ValidateGroups(spec));
  const AdamWConfig& a = spec.adamw;
  if (!(a.beta1 >= 0 && a.beta1 < 1) || !(a.beta2 >= 0 && a.beta2 < 1) ||
      !(std::isfinite(a.eps) && a.eps > 0)) {
    return Invalid(absl::StrCat("adamw: betas [", a.beta1, ", ", a.beta2, "] must be in [0, 1) ",
                                "and eps ", a.eps, " finite and > 0"));
  }
  if (!std::isfinite(spec.max_grad_norm) || spec.max_grad_norm < 0) {
    return Invalid(absl::StrCat("max_grad_norm ", spec.max_grad_norm, " must be finite and >= 0"));
  }
  if (spec.init_from.size() > kMaxInitFromBytes || spec.init_from.find('\0') != std::string::npos) {
    return Invalid(absl::StrCat("init_from: a path of at most ", kMaxInitFromBytes,
                                " bytes without NUL is expected"));
  }
  for (const MatrixSpec& m : spec.matrices) {
    if (DTypeName(m.param_dtype) == "unknown" || OptimizerName(m.optimizer) == "unknown") {
      return Invalid(absl::StrCat("tensor ", Quoted(m.name),
                                  ": param_dtype or optimizer out of "
                                  "range"));
    }
    if (spec.explicit_layout.empty() && (spec.zero_stage == 1 || spec.zero_stage == 2) &&
        m.param_dtype != spec.matrices[0].param_dtype) {
      return Invalid(absl::StrCat("zero_stage ", spec.zero_stage,
                                  " partitions are one flat buffer of one dtype, but "
                                  "tensor ",
                                  Quoted(m.name), " has param_dtype ",
                                  std::string(DTypeName(m.param_dtype)), " and tensor ",
                                  Quoted(spec.matrices[0].name), " has ",
                                  std::string(DTypeName(spec.matrices[0].param_dtype))));
    }
  }
  return absl::OkStatus();
}

}  // namespace muond::common
