#include "server/storage/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <mutex>
#include <string_view>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "common/json_depth.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "server/storage/checkpoint_payload.h"
#include "server/storage/durable_file.h"

namespace muond::server::checkpoint {
namespace {

using durable::ErrnoStatus;
using durable::Fd;
using durable::FsyncDir;
using durable::IoPoint;
using durable::RemoveTree;
using Json = nlohmann::json;

constexpr int kFormatVersion = 1;
constexpr char kPayload[] = "momentum.safetensors";
constexpr char kManifest[] = "manifest.json";
constexpr char kPrefix[] = "gen-";

std::string GenerationName(int64_t g) { return absl::StrFormat("%s%012d", kPrefix, g); }

// Directory entries named gen-<digits><suffix>; suffix "" for complete generations.
struct Entry {
  int64_t generation;
  std::string name;
  std::string suffix;  // "", ".tmp", ".broken", ...
};

absl::StatusOr<std::vector<Entry>> ScanDir(const std::string& dir) {
  std::vector<Entry> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    if (errno == ENOENT) return out;
    return ErrnoStatus(errno, "opendir", dir);
  }
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.rfind(kPrefix, 0) != 0) continue;
    const size_t digits_end = name.find_first_not_of("0123456789", std::strlen(kPrefix));
    const std::string digits = name.substr(
        std::strlen(kPrefix),
        digits_end == std::string::npos ? std::string::npos : digits_end - std::strlen(kPrefix));
    int64_t g = 0;
    if (digits.empty() || !absl::SimpleAtoi(digits, &g)) continue;
    out.push_back({g, name, digits_end == std::string::npos ? "" : name.substr(digits_end)});
  }
  ::closedir(d);
  std::sort(out.begin(), out.end(),
            [](const Entry& a, const Entry& b) { return a.generation > b.generation; });
  return out;
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, uint64_t limit) {
  const int f = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f < 0) return ReadError(errno, "open", path);
  Fd fd(f);
  std::string out;
  char buf[65536];
  while (true) {
    const ssize_t r = ::read(fd.get(), buf, sizeof buf);
    if (r < 0) {
      if (errno == EINTR) continue;
      return ReadError(errno, "read", path);
    }
    if (r == 0) break;
    out.append(buf, static_cast<size_t>(r));
    if (out.size() > limit) {
      return absl::DataLossError(absl::StrCat(path, ": larger than ", limit, " bytes"));
    }
  }
  return out;
}

uint32_t JsonChecksum(const Json& manifest_without_checksum) {
  const std::string text = manifest_without_checksum.dump();
  return common::Crc32c(text.data(), text.size());
}

// The manifest's common fields, read without verifying the payload.
absl::Status ReadManifest(const std::string& gen_dir, Json* manifest, GenerationInfo* info) {
  const std::string path = absl::StrCat(gen_dir, "/", kManifest);
  auto text = ReadSmallFile(path, kMaxHeaderBytes);
  if (!text.ok()) return text.status();
  bool too_deep = false;
  Json j = common::ParseJsonWithDepthLimit<Json>(*text, &too_deep);
  if (j.is_discarded() || !j.is_object()) {
    return absl::DataLossError(absl::StrCat(path, ": not valid JSON"));
  }
  if (too_deep) {
    return absl::DataLossError(
        absl::StrCat(path, ": nested deeper than ", common::kMaxJsonDepth, " levels"));
  }
  const auto sum = j.find("checksum");
  if (sum == j.end() || !sum->is_number_unsigned()) {
    return absl::DataLossError(absl::StrCat(path, ": no checksum"));
  }
  const uint64_t want = sum->get<uint64_t>();
  Json body = j;
  body.erase("checksum");
  if (JsonChecksum(body) != want) {
    return absl::DataLossError(absl::StrCat(path, ": manifest checksum mismatch"));
  }
  // Looked up, not j.value(): value() throws when a key holds another type than its default.
  const auto format = j.find("format");
  const auto version = j.find("format_version");
  if (format == j.end() || !format->is_string() || *format != kFormat || version == j.end() ||
      !version->is_number_integer() || *version != kFormatVersion) {
    return absl::DataLossError(
        absl::StrCat(path, ": not a muond checkpoint of format version ", kFormatVersion));
  }
  // Each field's type checked before it is read (get<T>() throws on another type): an error names
  // the file and the key.
  for (const char* key : {"generation", "step", "created_unix_ms", "payload_bytes"}) {
    const auto it = j.find(key);
    const bool want_unsigned = std::string_view(key) == "payload_bytes";
    if (it == j.end() || !(want_unsigned ? it->is_number_unsigned() : it->is_number_integer())) {
      return absl::DataLossError(
          absl::StrCat(path, ": key '", key, "' is ", it == j.end() ? "missing" : it->type_name(),
                       ", not ", want_unsigned ? "an unsigned integer" : "an integer"));
    }
  }
  info->generation = j["generation"].get<int64_t>();
  info->step = j["step"].get<int64_t>();
  info->created_unix_ms = j["created_unix_ms"].get<int64_t>();
  info->bytes = j["payload_bytes"].get<uint64_t>();
  *manifest = std::move(j);
  return absl::OkStatus();
}

// Reads and verifies a complete generation directory: its manifest, the job spec in it, and the
// payload against the manifest (checkpoint_payload.h).
absl::StatusOr<Loaded> Verify(const std::string& gen_dir,
                              const std::function<void(uint64_t)>& on_bytes_read) {
  Loaded out;
  out.info.path = gen_dir;
  Json manifest;
  RETURN_IF_ERROR(ReadManifest(gen_dir, &manifest, &out.info));
  const std::string manifest_path = absl::StrCat(gen_dir, "/", kManifest);
  auto spec = common::ParseJobSpecJson(manifest["job"].dump());
  if (!spec.ok()) {
    return absl::DataLossError(
        absl::StrCat(manifest_path, ": job spec: ", spec.status().message()));
  }
  out.spec = *std::move(spec);
  if (out.spec.mode == common::JobMode::kApply) {
    const auto steps = manifest.find("tensor_steps");
    if (steps == manifest.end() || !steps->is_array() ||
        steps->size() != out.spec.matrices.size()) {
      return absl::DataLossError(absl::StrCat(manifest_path, ": no tensor_steps for its ",
                                              out.spec.matrices.size(), " tensors"));
    }
    for (const Json& t : *steps) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0) {
        return absl::DataLossError(absl::StrCat(manifest_path,
                                                ": a tensor_steps entry is not a "
                                                "non-negative integer"));
      }
      out.tensor_steps.push_back(t.get<int64_t>());
    }
  }
  RETURN_IF_ERROR(ReadPayload(absl::StrCat(gen_dir, "/", kPayload), manifest, manifest_path, &out,
                              on_bytes_read));
  return out;
}

// Renames a bad generation to <name>.broken (or .broken.N if taken); returns the new path.
std::string SetAside(const std::string& dir, const std::string& name) {
  const std::string from = absl::StrCat(dir, "/", name);
  for (int i = 0; i < 1000; ++i) {
    const std::string to =
        absl::StrCat(dir, "/", name, ".broken", i == 0 ? std::string() : absl::StrCat(".", i));
    struct stat st;
    if (::stat(to.c_str(), &st) == 0) continue;
    if (::rename(from.c_str(), to.c_str()) == 0) {
      (void)FsyncDir(dir);
      return to;
    }
    MUOND_LOG(WARNING) << "checkpoint: cannot set aside " << from << ": " << std::strerror(errno);
    return from;
  }
  return from;
}

// Removes the temporary directories of interrupted writes (the process died): never a
// generation.
void RemoveInterruptedWrites(const std::string& dir, const std::vector<Entry>& entries) {
  for (const Entry& e : entries) {
    if (e.suffix != ".tmp") continue;
    if (absl::Status s = RemoveTree(absl::StrCat(dir, "/", e.name)); !s.ok()) {
      MUOND_LOG(WARNING) << "checkpoint: " << s.message();
    }
  }
}

// One past the newest generation number in the directory, whatever its state (>= 1).
int64_t NextGeneration(const std::vector<Entry>& entries) {
  int64_t generation = 1;
  for (const Entry& e : entries) generation = std::max(generation, e.generation + 1);
  return generation;
}

// The manifest.json text of a generation whose payload was written with `layout` (checksummed,
// see checkpoint.h).
std::string ManifestText(const common::JobSpec& spec, const GenerationInfo& info,
                         PayloadLayout layout, const std::vector<int64_t>& tensor_steps) {
  const uint32_t header_crc = common::Crc32c(layout.header_text.data(), layout.header_text.size());
  Json manifest = {{"format", kFormat},
                   {"format_version", kFormatVersion},
                   {"generation", info.generation},
                   {"step", info.step},
                   {"created_unix_ms", info.created_unix_ms},
                   {"job", Json::parse(common::JobSpecToJson(spec))},
                   {"payload", kPayload},
                   {"payload_bytes", info.bytes},
                   {"payload_header_crc32c", header_crc},
                   {"tensors", std::move(layout.tensors)}};
  if (spec.mode == common::JobMode::kApply) manifest["tensor_steps"] = tensor_steps;
  manifest["checksum"] = JsonChecksum(manifest);
  return manifest.dump(1) + "\n";
}

// Creates `path` with `text` and fsyncs it.
absl::Status WriteSyncedFile(const std::string& path, const std::string& text) {
  Fd fd;
  RETURN_IF_ERROR(durable::OpenForWrite(path, &fd));
  RETURN_IF_ERROR(durable::WriteAll(fd.get(), text.data(), text.size(), path));
  return durable::Fsync(fd.get(), IoPoint::kFsyncFile, path);
}

// Writes generation info->generation into tmp_dir and publishes it as info->path (checkpoint.h:
// each file fsynced, tmp_dir fsynced, renamed, `dir` fsynced). Sets info->bytes.
absl::Status WriteGeneration(const std::string& dir, const std::string& tmp_dir,
                             const common::JobSpec& spec, const MatrixSource& source,
                             const std::vector<int64_t>& tensor_steps, GenerationInfo* info) {
  RETURN_IF_ERROR(durable::Mkdir(tmp_dir));
  PayloadLayout layout = LayOutPayload(spec, *info);
  info->bytes = layout.payload_bytes();
  RETURN_IF_ERROR(WritePayload(absl::StrCat(tmp_dir, "/", kPayload), spec, source, &layout));
  RETURN_IF_ERROR(WriteSyncedFile(absl::StrCat(tmp_dir, "/", kManifest),
                                  ManifestText(spec, *info, std::move(layout), tensor_steps)));
  RETURN_IF_ERROR(FsyncDir(tmp_dir));
  RETURN_IF_ERROR(durable::Rename(tmp_dir, info->path));
  return FsyncDir(dir);
}

// After a failed WriteGeneration: removes what it left.
void DiscardFailedWrite(const std::string& final_dir, const std::string& tmp_dir) {
  struct stat st;
  if (::stat(final_dir.c_str(), &st) == 0) {
    // Renamed, but the directory fsync failed: the generation may not survive a crash, so it
    // is not reported as saved; remove it rather than leave an undurable "success" behind.
    (void)RemoveTree(final_dir);
  }
  (void)RemoveTree(tmp_dir);
}

// Keeps the newest `keep` complete generations, counting the one just written (not in `entries`,
// the listing from before the write).
void PruneGenerations(const std::string& dir, const std::vector<Entry>& entries, int keep) {
  int kept = 0;
  for (const Entry& e : entries) {
    if (!e.suffix.empty()) continue;
    if (++kept < keep) continue;  // this write is one of the keep
    if (absl::Status s = RemoveTree(absl::StrCat(dir, "/", e.name)); !s.ok()) {
      MUOND_LOG(WARNING) << "checkpoint: pruning: " << s.message();
    }
  }
}

}  // namespace

Store::Store(std::string dir, int keep) : dir_(std::move(dir)), keep_(std::max(1, keep)) {}

absl::StatusOr<GenerationInfo> Store::Write(const common::JobSpec& spec, int64_t step,
                                            const MatrixSource& source,
                                            const std::vector<int64_t>& tensor_steps) {
  if (spec.mode == common::JobMode::kApply && tensor_steps.size() != spec.matrices.size()) {
    return absl::InternalError(absl::StrCat("checkpoint of job '", spec.job_id,
                                            "': ", tensor_steps.size(), " step counts for ",
                                            spec.matrices.size(), " tensors"));
  }
  RETURN_IF_ERROR(durable::MakeDirs(dir_));
  auto entries = ScanDir(dir_);
  if (!entries.ok()) return entries.status();
  RemoveInterruptedWrites(dir_, *entries);
  GenerationInfo info;
  info.generation = NextGeneration(*entries);
  info.step = step;
  info.created_unix_ms = absl::ToUnixMillis(absl::Now());
  info.path = absl::StrCat(dir_, "/", GenerationName(info.generation));
  const std::string tmp_dir = absl::StrCat(info.path, ".tmp");
  if (absl::Status s = WriteGeneration(dir_, tmp_dir, spec, source, tensor_steps, &info); !s.ok()) {
    DiscardFailedWrite(info.path, tmp_dir);
    return absl::Status(s.code(), absl::StrCat("checkpoint of job '", spec.job_id, "' generation ",
                                               info.generation, ": ", s.message()));
  }
  PruneGenerations(dir_, *entries, keep_);
  return info;
}

absl::StatusOr<std::vector<GenerationInfo>> Store::List() const {
  auto entries = ScanDir(dir_);
  if (!entries.ok()) return entries.status();
  std::vector<GenerationInfo> out;
  for (const Entry& e : *entries) {
    if (!e.suffix.empty()) continue;
    GenerationInfo info;
    info.generation = e.generation;
    info.path = absl::StrCat(dir_, "/", e.name);
    Json manifest;
    if (absl::Status s = ReadManifest(info.path, &manifest, &info); !s.ok()) {
      info.problem = std::string(s.message());
    }
    info.generation = e.generation;
    out.push_back(std::move(info));
  }
  return out;
}

absl::StatusOr<Loaded> Store::Load(const Selector& selector) {
  auto entries = ScanDir(dir_);
  if (!entries.ok()) return entries.status();
  std::vector<Entry> candidates;
  for (const Entry& e : *entries) {
    if (!e.suffix.empty()) continue;
    if (selector.generation >= 0 && e.generation != selector.generation) continue;
    if (selector.step >= 0) {
      GenerationInfo info;
      Json manifest;
      // A generation whose manifest cannot be read has no known step: not a match.
      if (!ReadManifest(absl::StrCat(dir_, "/", e.name), &manifest, &info).ok() ||
          info.step != selector.step) {
        continue;
      }
    }
    candidates.push_back(e);
  }
  const std::string what =
      selector.generation >= 0 ? absl::StrCat("generation ", selector.generation)
      : selector.step >= 0     ? absl::StrCat("a generation at step ", selector.step)
                               : std::string("a checkpoint");
  if (candidates.empty()) {
    return absl::NotFoundError(absl::StrCat("no ", what, " in ", dir_));
  }
  std::vector<std::string> set_aside, problems;
  for (const Entry& e : candidates) {
    const std::string path = absl::StrCat(dir_, "/", e.name);
    auto loaded = Verify(path, selector.on_bytes_read);
    if (loaded.ok()) {
      loaded->info.generation = e.generation;
      loaded->set_aside = set_aside;
      return loaded;
    }
    if (loaded.status().code() != absl::StatusCode::kDataLoss) {
      return absl::Status(loaded.status().code(),
                          absl::StrCat("loading ", path, ": ", loaded.status().message()));
    }
    const std::string moved = SetAside(dir_, e.name);
    MUOND_LOG(WARNING) << "checkpoint: " << loaded.status().message() << "; set aside as " << moved;
    set_aside.push_back(moved);
    problems.push_back(std::string(loaded.status().message()));
    // An explicit generation or step does not fall back to another one.
    if (selector.generation >= 0 || selector.step >= 0) break;
  }
  return absl::DataLossError(absl::StrCat("no good ", what, " in ", dir_, ": ",
                                          absl::StrJoin(problems, "; "),
                                          " (set aside: ", absl::StrJoin(set_aside, ", "), ")"));
}

}  // namespace muond::server::checkpoint
