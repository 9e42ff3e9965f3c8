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
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "server/storage/durable_file.h"
#include "server/jobs/parallel_bytes.h"

namespace muond::server::checkpoint {
namespace {

using durable::ErrnoStatus;
using durable::Fd;
using durable::FsyncDir;
using durable::IoPoint;
using durable::RemoveTree;
using Json = nlohmann::json;

constexpr char kFormat[] = "muond-checkpoint";
constexpr int kFormatVersion = 1;
constexpr char kPayload[] = "momentum.safetensors";
constexpr char kManifest[] = "manifest.json";
constexpr char kPrefix[] = "gen-";
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;


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
    const std::string digits =
        name.substr(std::strlen(kPrefix), digits_end == std::string::npos
                                              ? std::string::npos
                                              : digits_end - std::strlen(kPrefix));
    int64_t g = 0;
    if (digits.empty() || !absl::SimpleAtoi(digits, &g)) continue;
    out.push_back({g, name, digits_end == std::string::npos ? "" : name.substr(digits_end)});
  }
  ::closedir(d);
  std::sort(out.begin(), out.end(),
            [](const Entry& a, const Entry& b) { return a.generation > b.generation; });
  return out;
}

// Reading a file of a complete generation: a missing file or an I/O error is damage to the
// generation (DATA_LOSS), not a passing condition.
absl::Status ReadError(int err, const char* call, const std::string& path) {
  if (err == ENOENT || err == EIO) {
    return absl::DataLossError(absl::StrCat(call, " ", path, ": ", std::strerror(err)));
  }
  return ErrnoStatus(err, call, path);
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

absl::Status PreadAll(int fd, void* data, size_t n, uint64_t offset, const std::string& path) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, std::min<size_t>(n, size_t{64} << 20),
                              static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      return ReadError(errno, "read", path);
    }
    if (r == 0) return absl::DataLossError(absl::StrCat(path, ": truncated at byte ", offset));
    p += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
  return absl::OkStatus();
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
  Json j = Json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::DataLossError(absl::StrCat(path, ": not valid JSON"));
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
  if (j.value("format", "") != kFormat || j.value("format_version", 0) != kFormatVersion) {
    return absl::DataLossError(absl::StrCat(path, ": not a muond checkpoint of format version ",
                                            kFormatVersion));
  }
  try {
    info->generation = j.at("generation").get<int64_t>();
    info->step = j.at("step").get<int64_t>();
    info->created_unix_ms = j.at("created_unix_ms").get<int64_t>();
    info->bytes = j.at("payload_bytes").get<uint64_t>();
  } catch (const Json::exception& e) {
    return absl::DataLossError(absl::StrCat(path, ": ", e.what()));
  }
  *manifest = std::move(j);
  return absl::OkStatus();
}

// Reads and verifies a complete generation directory.
absl::StatusOr<Loaded> Verify(const std::string& gen_dir) {
  Loaded out;
  out.info.path = gen_dir;
  Json manifest;
  RETURN_IF_ERROR(ReadManifest(gen_dir, &manifest, &out.info));
  auto spec = common::ParseJobSpecJson(manifest["job"].dump());
  if (!spec.ok()) {
    return absl::DataLossError(
        absl::StrCat(gen_dir, "/", kManifest, ": job spec: ", spec.status().message()));
  }
  out.spec = *std::move(spec);

  const std::string path = absl::StrCat(gen_dir, "/", kPayload);
  const int f = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f < 0) return ReadError(errno, "open", path);
  Fd fd(f);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, "fstat", path);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size != out.info.bytes) {
    return absl::DataLossError(absl::StrCat(path, ": ", size, " bytes, the manifest says ",
                                            out.info.bytes, " (truncated or replaced)"));
  }
  uint64_t header_len = 0;
  if (size < 8) return absl::DataLossError(absl::StrCat(path, ": truncated header"));
  RETURN_IF_ERROR(PreadAll(fd.get(), &header_len, 8, 0, path));
  if (header_len > kMaxHeaderBytes || 8 + header_len > size) {
    return absl::DataLossError(absl::StrCat(path, ": bad header length ", header_len));
  }
  std::string header(header_len, '\0');
  RETURN_IF_ERROR(PreadAll(fd.get(), header.data(), header_len, 8, path));
  if (!manifest["payload_header_crc32c"].is_number_unsigned() ||
      common::Crc32c(header.data(), header.size()) !=
          manifest["payload_header_crc32c"].get<uint32_t>()) {
    return absl::DataLossError(absl::StrCat(path, ": header checksum mismatch"));
  }
  Json h = Json::parse(header, nullptr, /*allow_exceptions=*/false);
  if (h.is_discarded() || !h.is_object()) {
    return absl::DataLossError(absl::StrCat(path, ": header is not valid JSON"));
  }
  const uint64_t data_start = 8 + header_len;
  struct Read {
    uint64_t offset;
    uint32_t crc;
  };
  std::vector<Read> reads;
  try {
    const Json& tensors = manifest.at("tensors");
    for (const Json& t : tensors) {
      const std::string name = t.at("name").get<std::string>();
      const std::vector<int64_t> shape = t.at("shape").get<std::vector<int64_t>>();
      const std::vector<uint64_t> off = t.at("data_offsets").get<std::vector<uint64_t>>();
      const uint32_t crc = t.at("crc32c").get<uint32_t>();
      const auto it = h.find(name);
      if (it == h.end() || it->value("dtype", "") != "F32" ||
          it->at("shape").get<std::vector<int64_t>>() != shape ||
          it->at("data_offsets").get<std::vector<uint64_t>>() != off || off.size() != 2 ||
          off[1] < off[0]) {
        return absl::DataLossError(
            absl::StrCat(path, ": tensor '", name, "' differs between header and manifest"));
      }
      uint64_t numel = 1;
      for (int64_t d : shape) {
        if (d <= 0) return absl::DataLossError(absl::StrCat(path, ": tensor '", name, "' shape"));
        numel *= static_cast<uint64_t>(d);
      }
      if (off[1] - off[0] != numel * sizeof(float) || data_start + off[1] > size) {
        return absl::DataLossError(
            absl::StrCat(path, ": tensor '", name, "' has a bad size or offsets"));
      }
      out.names.push_back(name);
      out.data.emplace_back(numel);
      reads.push_back({data_start + off[0], crc});
    }
  } catch (const Json::exception& e) {
    return absl::DataLossError(absl::StrCat(gen_dir, "/", kManifest, ": ", e.what()));
  }
  // Every tensor read and checked, spread over the CPUs (page-cache copies and CRC32C).
  std::vector<absl::Status> read_status(reads.size());
  ParallelFor(reads.size(), size, [&](size_t i) {
    std::vector<float>& v = out.data[i];
    const size_t bytes = v.size() * sizeof(float);
    read_status[i] = PreadAll(fd.get(), v.data(), bytes, reads[i].offset, path);
    if (!read_status[i].ok()) return;
    const uint32_t got = common::Crc32c(v.data(), bytes);
    if (got != reads[i].crc) {
      read_status[i] = absl::DataLossError(
          absl::StrFormat("%s: tensor '%s' checksum mismatch (crc32c %08x, manifest %08x)", path,
                          out.names[i], got, reads[i].crc));
    }
  });
  for (const absl::Status& st : read_status) RETURN_IF_ERROR(st);
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

}  // namespace


Store::Store(std::string dir, int keep) : dir_(std::move(dir)), keep_(std::max(1, keep)) {}

absl::StatusOr<GenerationInfo> Store::Write(const common::JobSpec& spec, int64_t step,
                                            const MatrixSource& source) {
  RETURN_IF_ERROR(durable::MakeDirs(dir_));
  auto entries = ScanDir(dir_);
  if (!entries.ok()) return entries.status();
  int64_t generation = 1;
  for (const Entry& e : *entries) {
    generation = std::max(generation, e.generation + 1);
    if (e.suffix == ".tmp") {
      // An interrupted write (the process died): never a generation.
      if (absl::Status s = RemoveTree(absl::StrCat(dir_, "/", e.name)); !s.ok()) {
        MUOND_LOG(WARNING) << "checkpoint: " << s.message();
      }
    }
  }
  const std::string final_dir = absl::StrCat(dir_, "/", GenerationName(generation));
  const std::string tmp_dir = absl::StrCat(final_dir, ".tmp");

  GenerationInfo info;
  info.generation = generation;
  info.step = step;
  info.created_unix_ms = absl::ToUnixMillis(absl::Now());
  info.path = final_dir;

  auto write = [&]() -> absl::Status {
    RETURN_IF_ERROR(durable::Mkdir(tmp_dir));
    // The safetensors header: offsets follow from the shapes.
    Json header = Json::object();
    Json tensors = Json::array();
    uint64_t offset = 0;
    for (const common::MatrixSpec& m : spec.matrices) {
      const uint64_t bytes = static_cast<uint64_t>(m.numel()) * sizeof(float);
      header[m.name] = {{"dtype", "F32"}, {"shape", m.shape}, {"data_offsets", {offset, offset + bytes}}};
      tensors.push_back({{"name", m.name}, {"shape", m.shape}, {"dtype", "float32"},
                         {"data_offsets", {offset, offset + bytes}}});
      offset += bytes;
    }
    header["__metadata__"] = {{"format", kFormat},
                              {"job_id", spec.job_id},
                              {"generation", std::to_string(generation)},
                              {"step", std::to_string(step)}};
    std::string header_text = header.dump();
    header_text.append((8 - header_text.size() % 8) % 8, ' ');
    const uint64_t header_len = header_text.size();
    const uint32_t header_crc = common::Crc32c(header_text.data(), header_text.size());
    info.bytes = 8 + header_len + offset;

    const std::string payload = absl::StrCat(tmp_dir, "/", kPayload);
    {
      Fd fd;
      RETURN_IF_ERROR(durable::OpenForWrite(payload, &fd));
      RETURN_IF_ERROR(durable::WriteAll(fd.get(), &header_len, 8, payload));
      RETURN_IF_ERROR(durable::WriteAll(fd.get(), header_text.data(), header_text.size(), payload));
      std::vector<float> buf;
      for (size_t i = 0; i < spec.matrices.size(); ++i) {
        RETURN_IF_ERROR(source(i, &buf));
        if (buf.size() != static_cast<size_t>(spec.matrices[i].numel())) {
          return absl::InternalError(absl::StrCat("checkpoint: matrix '", spec.matrices[i].name,
                                                  "' has ", buf.size(), " elements, expected ",
                                                  spec.matrices[i].numel()));
        }
        const size_t bytes = buf.size() * sizeof(float);
        tensors[i]["crc32c"] = common::Crc32c(buf.data(), bytes);
        RETURN_IF_ERROR(durable::WriteAll(fd.get(), buf.data(), bytes, payload));
      }
      RETURN_IF_ERROR(durable::Fsync(fd.get(), IoPoint::kFsyncFile, payload));
    }
    Json manifest = {{"format", kFormat},
                     {"format_version", kFormatVersion},
                     {"generation", generation},
                     {"step", step},
                     {"created_unix_ms", info.created_unix_ms},
                     {"job", Json::parse(common::JobSpecToJson(spec))},
                     {"payload", kPayload},
                     {"payload_bytes", info.bytes},
                     {"payload_header_crc32c", header_crc},
                     {"tensors", std::move(tensors)}};
    manifest["checksum"] = JsonChecksum(manifest);
    const std::string manifest_text = manifest.dump(1) + "\n";
    const std::string manifest_path = absl::StrCat(tmp_dir, "/", kManifest);
    {
      Fd fd;
      RETURN_IF_ERROR(durable::OpenForWrite(manifest_path, &fd));
      RETURN_IF_ERROR(
          durable::WriteAll(fd.get(), manifest_text.data(), manifest_text.size(), manifest_path));
      RETURN_IF_ERROR(durable::Fsync(fd.get(), IoPoint::kFsyncFile, manifest_path));
    }
    RETURN_IF_ERROR(FsyncDir(tmp_dir));
    RETURN_IF_ERROR(durable::Rename(tmp_dir, final_dir));
    return FsyncDir(dir_);
  };
  if (absl::Status s = write(); !s.ok()) {
    struct stat st;
    if (::stat(final_dir.c_str(), &st) == 0) {
      // Renamed, but the directory fsync failed: the generation may not survive a crash, so it
      // is not reported as saved; remove it rather than leave an undurable "success" behind.
      (void)RemoveTree(final_dir);
    }
    (void)RemoveTree(tmp_dir);
    return absl::Status(s.code(), absl::StrCat("checkpoint of job '", spec.job_id,
                                               "' generation ", generation, ": ", s.message()));
  }
  // Keep the newest keep_ complete generations.
  int kept = 0;
  for (const Entry& e : *entries) {
    if (!e.suffix.empty()) continue;
    if (++kept < keep_) continue;  // this write is one of the keep_
    if (absl::Status s = RemoveTree(absl::StrCat(dir_, "/", e.name)); !s.ok()) {
      MUOND_LOG(WARNING) << "checkpoint: pruning: " << s.message();
    }
  }
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
    auto loaded = Verify(path);
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
    MUOND_LOG(WARNING) << "checkpoint: " << loaded.status().message() << "; set aside as "
                       << moved;
    set_aside.push_back(moved);
    problems.push_back(std::string(loaded.status().message()));
    // An explicit generation or step does not fall back to another one.
    if (selector.generation >= 0 || selector.step >= 0) break;
  }
  return absl::DataLossError(absl::StrCat("no good ", what, " in ", dir_, ": ",
                                          absl::StrJoin(problems, "; "), " (set aside: ",
                                          absl::StrJoin(set_aside, ", "), ")"));
}

}  // namespace muond::server::checkpoint
