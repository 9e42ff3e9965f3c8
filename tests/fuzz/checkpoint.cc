// Fuzz target: a checkpoint generation on disk as the daemon finds it at load time
// (server/storage/checkpoint.cc, checkpoint_payload.cc): the manifest and the payload of
// generation 1, read back by Store::List and verified by Store::Load.
//
// Input: 1 byte of fix-ups, a 4-byte little-endian manifest length, the manifest, then the payload.
// Fix-ups (so that the verifier's later checks are reached, not only the checksums): bit 0 sets
// the manifest's "checksum" to the right value, bit 1 its "payload_bytes" and
// "payload_header_crc32c" from the payload, bit 2 each tensor's "crc32c" from the payload bytes at
// its offsets. Properties: List and Load never fail but with DATA_LOSS or NOT_FOUND (the directory
// is ours and readable); a generation that loads has one fp32 array per name, of its shape.
#include "server/storage/checkpoint.h"

#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/crc32c.h"
#include "nlohmann/json.hpp"
#include "tests/fuzz/fuzz_check.h"

namespace {

using Json = nlohmann::json;

uint32_t Crc(std::string_view s) { return muond::common::Crc32c(s.data(), s.size()); }

// Applies the fix-ups of `flags` to `manifest` (see above); returns its text.
std::string FixUp(std::string manifest, const std::string& payload, uint8_t flags) {
  if ((flags & 7) == 0) return manifest;
  Json j = Json::parse(manifest, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return manifest;
  uint64_t header_len = 0;
  if (payload.size() >= 8) std::memcpy(&header_len, payload.data(), 8);
  const bool has_header = payload.size() >= 8 && header_len <= payload.size() - 8;
  if (flags & 2) {
    j["payload_bytes"] = payload.size();
    if (has_header)
      j["payload_header_crc32c"] = Crc(std::string_view(payload).substr(8, header_len));
  }
  if ((flags & 4) && has_header && j.contains("tensors") && j["tensors"].is_array()) {
    for (Json& t : j["tensors"]) {
      if (!t.is_object() || !t.contains("data_offsets") || !t["data_offsets"].is_array() ||
          t["data_offsets"].size() != 2 || !t["data_offsets"][0].is_number_unsigned() ||
          !t["data_offsets"][1].is_number_unsigned()) {
        continue;
      }
      const uint64_t b = t["data_offsets"][0].get<uint64_t>();
      const uint64_t e = t["data_offsets"][1].get<uint64_t>();
      const uint64_t data = payload.size() - 8 - header_len;
      if (b <= e && e <= data) {
        t["crc32c"] = Crc(std::string_view(payload).substr(8 + header_len + b, e - b));
      }
    }
  }
  if (flags & 1) {
    j.erase("checksum");
    j["checksum"] = Crc(j.dump());
  }
  return j.dump();
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  FUZZ_CHECK(out.good(), "cannot write " + path);
}

std::string ScratchDir() {
  const char* base = std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : "/tmp";
  std::string tmpl = std::string(base) + "/muond-fuzz-checkpoint-XXXXXX";
  FUZZ_CHECK(mkdtemp(tmpl.data()) != nullptr, "mkdtemp " + tmpl);
  return tmpl;
}

bool Expected(const absl::Status& s) {
  return s.code() == absl::StatusCode::kDataLoss || s.code() == absl::StatusCode::kNotFound;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 5) return 0;
  const uint8_t flags = data[0];
  uint32_t manifest_len = 0;
  std::memcpy(&manifest_len, data + 1, 4);
  const std::string rest(reinterpret_cast<const char*>(data) + 5, size - 5);
  if (manifest_len > rest.size()) manifest_len = static_cast<uint32_t>(rest.size());
  const std::string payload = rest.substr(manifest_len);
  const std::string manifest = FixUp(rest.substr(0, manifest_len), payload, flags);

  static const std::string dir = ScratchDir();
  const std::string gen = dir + "/gen-000000000001";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(gen);
  WriteFile(gen + "/manifest.json", manifest);
  WriteFile(gen + "/momentum.safetensors", payload);

  muond::server::checkpoint::Store store(dir, 2);
  auto list = store.List();
  FUZZ_CHECK(list.ok() && list->size() == 1, list.status().ToString());
  auto loaded = store.Load({});
  if (!loaded.ok()) {
    FUZZ_CHECK(Expected(loaded.status()), loaded.status().ToString());
    FUZZ_CHECK((*list)[0].problem.empty() || loaded.status().code() == absl::StatusCode::kDataLoss,
               "List saw a problem, Load did not say DATA_LOSS");
  } else {
    FUZZ_CHECK(loaded->names.size() == loaded->data.size(), "names and arrays differ in number");
    FUZZ_CHECK((*list)[0].problem.empty(), "loaded a generation List found a problem with");
  }
  std::filesystem::remove_all(dir);
  return 0;
}
