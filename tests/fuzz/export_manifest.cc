// Fuzz target: a full-state export manifest (<job>.manifest.json) as CreateJob's import_dir hands
// it to the daemon (common/state_export.cc ParseManifest). The directory is the creator's, so the
// file is anything a local user writes.
//
// Input: 1 byte of fix-ups, then the manifest. Fix-up bit 0 sets the manifest's "checksum" to the
// right value (so the field checks after it are reached, not only the checksum). Properties: no
// exception; a refusal is INVALID_ARGUMENT or DATA_LOSS naming the file; an accepted manifest
// writes back (ManifestToJson) to a manifest that parses to the same text.
#include <cstdint>
#include <string>

#include "common/crc32c.h"
#include "common/state_export.h"
#include "nlohmann/json.hpp"
#include "tests/fuzz/fuzz_check.h"

namespace {

using Json = nlohmann::json;
namespace se = muond::common::state_export;

constexpr char kPath[] = "/exports/n0.manifest.json";

std::string FixChecksum(const std::string& text) {
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return text;
  j.erase("checksum");
  const std::string body = j.dump(-1, ' ', false, Json::error_handler_t::replace);
  j["checksum"] = muond::common::Crc32c(body.data(), body.size());
  return j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] & 1) text = FixChecksum(text);
  auto m = se::ParseManifest(text, kPath);
  if (!m.ok()) {
    const absl::StatusCode code = m.status().code();
    FUZZ_CHECK(code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kDataLoss,
               m.status().ToString());
    FUZZ_CHECK(m.status().message().rfind(kPath, 0) == 0,
               "the message does not name the file: " + m.status().ToString());
    return 0;
  }
  const std::string written = se::ManifestToJson(*m);
  auto again = se::ParseManifest(written, kPath);
  FUZZ_CHECK(again.ok(), "its own JSON refused: " + again.status().ToString() + "\n" + written);
  FUZZ_CHECK(se::ManifestToJson(*again) == written, "JSON round trip differs:\n" + written);
  FUZZ_CHECK(se::PayloadHeader(*m).size() % 8 == 0, "payload header not padded to 8 bytes");
  return 0;
}
