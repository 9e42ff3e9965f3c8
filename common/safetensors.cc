// safetensors reader and writer. The header is parsed with nlohmann::ordered_json (to keep the
// header's tensor order) in its non-throwing mode; every value read from the file is checked before
// it is used as a size or an offset, because checkpoints and reference files may be truncated or
// written by someone else.
#include "common/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/json_depth.h"
#include "common/no_follow.h"
#include "common/status_macros.h"
#include "common/utf8.h"
#include "nlohmann/json.hpp"

namespace muond::common {
namespace {

using Json = nlohmann::ordered_json;

constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
constexpr char kMetadataKey[] = "__metadata__";

absl::Status Invalid(absl::string_view tensor, const std::string& problem) {
  return absl::InvalidArgumentError(absl::StrCat("safetensors: tensor '", tensor, "': ", problem));
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// numel and byte size of a shape, or an error when a dimension is negative or the product does
// not fit in int64 / uint64.
absl::StatusOr<uint64_t> ByteSize(absl::string_view tensor, DType dtype,
                                  const std::vector<int64_t>& shape) {
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0)
      return Invalid(tensor,
                     absl::StrCat("shape ", ShapeString(shape), " has a negative dimension"));
    if (__builtin_mul_overflow(numel, d, &numel)) {
      return Invalid(tensor,
                     absl::StrCat("shape ", ShapeString(shape), " overflows the element count"));
    }
  }
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(numel), DTypeSize(dtype), &bytes)) {
    return Invalid(tensor, absl::StrCat("shape ", ShapeString(shape), " overflows the byte size"));
  }
  return bytes;
}

// Parses one header entry (everything but __metadata__) into `info`; data_size bounds the offsets.
absl::Status ParseTensorEntry(const std::string& name, const Json& entry, uint64_t data_size,
                              TensorInfo* info) {
  if (name.empty()) return absl::InvalidArgumentError("safetensors: a tensor has an empty name");
  if (!entry.is_object()) return Invalid(name, "entry is not a JSON object");
  for (const auto& [key, value] : entry.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return Invalid(name, absl::StrCat("unknown field '", key, "'"));
    }
  }
  info->name = name;

  const auto dtype_it = entry.find("dtype");
  if (dtype_it == entry.end() || !dtype_it->is_string()) {
    return Invalid(name, "'dtype' is missing or not a string");
  }
  auto dtype = ParseSafetensorsDType(dtype_it->get_ref<const std::string&>());
  if (!dtype.ok()) return Invalid(name, std::string(dtype.status().message()));
  info->dtype = *dtype;

  const auto shape_it = entry.find("shape");
  if (shape_it == entry.end() || !shape_it->is_array()) {
    return Invalid(name, "'shape' is missing or not an array");
  }
  for (const Json& d : *shape_it) {
    if (d.is_number_unsigned()) {
      const uint64_t v = d.get<uint64_t>();
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Invalid(name, absl::StrCat("shape dimension ", v, " overflows the element count"));
      }
      info->shape.push_back(static_cast<int64_t>(v));
    } else if (d.is_number_integer()) {
      info->shape.push_back(d.get<int64_t>());
    } else {
      return Invalid(name, absl::StrCat("shape ", shape_it->dump(), " is not a list of integers"));
    }
  }
  ASSIGN_OR_RETURN(const uint64_t needed, ByteSize(name, info->dtype, info->shape));

  const auto off_it = entry.find("data_offsets");
  if (off_it == entry.end() || !off_it->is_array() || off_it->size() != 2 ||
      !(*off_it)[0].is_number_unsigned() || !(*off_it)[1].is_number_unsigned()) {
    return Invalid(name, "'data_offsets' must be [begin, end] with non-negative integers");
  }
  info->data_begin = (*off_it)[0].get<uint64_t>();
  info->data_end = (*off_it)[1].get<uint64_t>();
  const std::string offsets =
      absl::StrCat("data_offsets [", info->data_begin, ", ", info->data_end, "]");
  if (info->data_begin > info->data_end)
    return Invalid(name, absl::StrCat(offsets, " are reversed"));
  if (info->data_end > data_size) {
    return Invalid(name,
                   absl::StrCat(offsets, " lie outside the data section of ", data_size, " bytes"));
  }
  const uint64_t held = info->data_end - info->data_begin;
  if (held != needed) {
    return Invalid(name, absl::StrCat(offsets, " hold ", held, " bytes but ",
                                      std::string(SafetensorsDTypeName(info->dtype)), " ",
                                      ShapeString(info->shape), " needs ", needed));
  }
  return absl::OkStatus();
}

absl::Status CheckNoOverlap(const std::vector<TensorInfo>& tensors) {
  std::vector<const TensorInfo*> by_begin;
  for (const TensorInfo& t : tensors) {
    if (t.data_end > t.data_begin) by_begin.push_back(&t);  // empty tensors occupy no bytes
  }
  std::sort(by_begin.begin(), by_begin.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->data_begin < b->data_begin; });
  for (size_t i = 1; i < by_begin.size(); ++i) {
    const TensorInfo& prev = *by_begin[i - 1];
    const TensorInfo& cur = *by_begin[i];
    if (cur.data_begin < prev.data_end) {
      return absl::InvalidArgumentError(absl::StrCat(
          "safetensors: tensors '", prev.name, "' [", prev.data_begin, ", ", prev.data_end,
          "] and '", cur.name, "' [", cur.data_begin, ", ", cur.data_end, "] overlap"));
    }
  }
  return absl::OkStatus();
}

// "call(args): strerror", with the status code errno maps to (NOT_FOUND, PERMISSION_DENIED, ...).
absl::Status ErrnoError(int err, absl::string_view call, absl::string_view args) {
  return absl::Status(absl::ErrnoToStatusCode(err),
                      absl::StrCat(call, "(", args, "): ", std::strerror(err)));
}

absl::Status WriteAll(int fd, absl::string_view bytes, const std::string& path) {
  while (!bytes.empty()) {
    const ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "write", path);
    }
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

}  // namespace

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // validated by the parser not to overflow
  return n;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Parse(std::string bytes) {
  if (bytes.size() < 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        "safetensors: file of ", bytes.size(), " bytes is shorter than its 8-byte header length"));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i)
    header_len = (header_len << 8) | static_cast<unsigned char>(bytes[i]);
  if (header_len > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors: header length ", header_len,
                                                   " exceeds the limit of ", kMaxHeaderBytes));
  }
  if (header_len > bytes.size() - 8) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors: header length ", header_len,
                                                   " exceeds the ", bytes.size() - 8,
                                                   " bytes after the length field"));
  }

  // The parser silently keeps the last of duplicate keys; the callback sees every top-level key.
  std::set<std::string> seen;
  std::string duplicate;
  const auto keys = [&](int depth, Json::parse_event_t event, Json& parsed) {
    if (depth == 1 && event == Json::parse_event_t::key && parsed.is_string()) {
      if (!seen.insert(parsed.get<std::string>()).second && duplicate.empty()) {
        duplicate = parsed.get<std::string>();
      }
    }
    return true;
  };
  bool too_deep = false;
  const Json header = ParseJsonWithDepthLimit<Json>(std::string_view(bytes.data() + 8, header_len),
                                                    &too_deep, keys);
  if (header.is_discarded()) {
    return absl::InvalidArgumentError("safetensors: header is not valid JSON");
  }
  if (too_deep) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors: header nested deeper than ", kMaxJsonDepth, " levels"));
  }
  if (!header.is_object()) {
    return absl::InvalidArgumentError("safetensors: header is not a JSON object");
  }
  if (!duplicate.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors: tensor '", duplicate, "' appears more than once in the header"));
  }

  SafetensorsFile file;
  file.data_start_ = 8 + header_len;
  const uint64_t data_size = bytes.size() - file.data_start_;
  for (const auto& [name, entry] : header.items()) {
    if (name == kMetadataKey) {
      if (!entry.is_object()) {
        return absl::InvalidArgumentError("safetensors: __metadata__ is not a JSON object");
      }
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) {
          return absl::InvalidArgumentError(
              absl::StrCat("safetensors: __metadata__ value of '", key, "' is not a string"));
        }
        file.metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    TensorInfo info;
    RETURN_IF_ERROR(ParseTensorEntry(name, entry, data_size, &info));
    file.tensors_.push_back(std::move(info));
  }
  RETURN_IF_ERROR(CheckNoOverlap(file.tensors_));
  file.bytes_ = std::move(bytes);
  return file;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::ReadFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "open", path);
  std::string bytes;
  struct stat st;
  if (::fstat(fd, &st) == 0 && st.st_size > 0) bytes.reserve(static_cast<size_t>(st.st_size));
  char buf[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      return ErrnoError(err, "read", path);
    }
    if (n == 0) break;
    bytes.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  auto file = Parse(std::move(bytes));
  if (!file.ok()) {
    return absl::Status(file.status().code(), absl::StrCat(path, ": ", file.status().message()));
  }
  return file;
}

const TensorInfo* SafetensorsFile::Find(std::string_view name) const {
  for (const TensorInfo& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

std::string_view SafetensorsFile::Data(const TensorInfo& info) const {
  return std::string_view(bytes_).substr(data_start_ + info.data_begin,
                                         info.data_end - info.data_begin);
}

absl::StatusOr<std::string> SerializeSafetensors(
    const std::vector<TensorRef>& tensors, const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  if (!metadata.empty()) {
    Json meta = Json::object();
    for (const auto& [key, value] : metadata) {
      if (!IsValidUtf8(key) || !IsValidUtf8(value)) {
        return absl::InvalidArgumentError(
            absl::StrCat("safetensors: __metadata__ entry '", key, "' is not valid UTF-8"));
      }
      meta[key] = value;
    }
    header[kMetadataKey] = std::move(meta);
  }
  std::set<std::string_view> names;
  uint64_t offset = 0;
  for (const TensorRef& t : tensors) {
    if (t.name.empty())
      return absl::InvalidArgumentError("safetensors: a tensor has an empty name");
    if (t.name == kMetadataKey) return Invalid(t.name, "the name is reserved");
    if (!IsValidUtf8(t.name)) return Invalid(t.name, "the name is not valid UTF-8");
    if (!names.insert(t.name).second) return Invalid(t.name, "the name appears more than once");
    ASSIGN_OR_RETURN(const uint64_t needed, ByteSize(t.name, t.dtype, t.shape));
    if (t.data.size() != needed) {
      return Invalid(t.name, absl::StrCat("data holds ", t.data.size(), " bytes but ",
                                          std::string(SafetensorsDTypeName(t.dtype)), " ",
                                          ShapeString(t.shape), " needs ", needed));
    }
    header[t.name] = {{"dtype", SafetensorsDTypeName(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + needed}}};
    offset += needed;
  }
  std::string json = header.dump();
  // Pad with spaces so the data section starts 8-byte aligned, as the reference writer does.
  json.append((8 - json.size() % 8) % 8, ' ');

  std::string out;
  out.reserve(8 + json.size() + offset);
  for (int i = 0; i < 8; ++i)
    out.push_back(static_cast<char>((uint64_t{json.size()} >> (8 * i)) & 0xFF));
  out += json;
  for (const TensorRef& t : tensors) out.append(t.data.data(), t.data.size());
  return out;
}

absl::Status WriteSafetensorsFile(const std::string& path, const std::vector<TensorRef>& tensors,
                                  const std::map<std::string, std::string>& metadata) {
  ASSIGN_OR_RETURN(const std::string bytes, SerializeSafetensors(tensors, metadata));
  // The directory is reached without following a symbolic link, the temporary file is new
  // (O_EXCL, O_NOFOLLOW: a link planted under its name is not written through), and the rename
  // replaces the name itself: nothing a link points at is written.
  const auto [dir, name] = SplitDirName(path);
  if (name.empty() || name == "." || name == "..") {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a file name"));
  }
  ASSIGN_OR_RETURN(const int dir_fd, OpenDirectoryNoFollow(dir));
  const std::string tmp_name = absl::StrCat(".", name, ".tmp.", ::getpid());
  const std::string tmp = absl::StrCat(dir, "/", tmp_name);
  const int fd = ::openat(dir_fd, tmp_name.c_str(),
                          O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    ::close(dir_fd);
    return ErrnoError(err, "open", tmp);
  }
  absl::Status status = WriteAll(fd, bytes, tmp);
  if (status.ok() && ::fsync(fd) != 0) status = ErrnoError(errno, "fsync", tmp);
  if (::close(fd) != 0 && status.ok()) status = ErrnoError(errno, "close", tmp);
  if (status.ok() && ::renameat(dir_fd, tmp_name.c_str(), dir_fd, name.c_str()) != 0) {
    status = ErrnoError(errno, "rename", absl::StrCat(tmp, ", ", path));
  }
  if (!status.ok()) {
    ::unlinkat(dir_fd, tmp_name.c_str(), 0);  // best effort; the first error is worth reporting
    ::close(dir_fd);
    return status;
  }
  // The rename is durable only once the directory entry is on disk.
  if (::fsync(dir_fd) != 0) status = ErrnoError(errno, "fsync", dir);
  ::close(dir_fd);
  return status;
}

}  // namespace muond::common
