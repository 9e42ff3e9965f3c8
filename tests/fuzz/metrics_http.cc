// Fuzz target: the metrics endpoint's request path as the daemon sees it
// (server/ops/metrics_http.cc reads a connection in pieces, bounded by max_request_bytes, finds
// the end of the request head with HeadLength and answers it with Answer,
// server/ops/metrics_http_request.cc). Input: 2 bytes choosing max_request_bytes (64..8255), then
// pieces, each a length byte L and L + 1 bytes, as recv() would return them.
// Properties: the answer does not depend on how the bytes were cut into pieces (it equals the
// answer to the same bytes in one piece); every answer is a whole HTTP/1.1 response whose
// Content-Length is its body's length (HEAD: no body).
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/strings/numbers.h"
#include "common/metrics.h"
#include "server/ops/metrics_http_request.h"
#include "tests/fuzz/fuzz_check.h"

namespace http = muond::server::http;

namespace {

const muond::common::MetricsRegistry& TestRegistry() {
  static auto* registry = [] {
    auto* r = new muond::common::MetricsRegistry();
    r->AddCounter("muond_fuzz_total", "A counter.")
        .value()
        ->Add({{"job", "a\"b\\c\n"}})
        .Increment();
    r->AddGauge("muond_fuzz_gauge", "A gauge.").value()->Add({}).Set(-1.5);
    return r;
  }();
  return *registry;
}

// What the daemon's Read() answers once the request head is in, or 431; "" while incomplete.
std::string Serve(std::string* in, std::string_view piece, size_t max_request_bytes) {
  const size_t from = in->size() < 2 ? 0 : in->size() - 2;
  const size_t room = max_request_bytes - in->size();
  in->append(piece.data(), std::min(piece.size(), room));
  const size_t head_length = http::HeadLength(*in, from);
  if (head_length != std::string_view::npos) {
    return http::Answer(std::string_view(*in).substr(0, head_length), TestRegistry());
  }
  if (in->size() >= max_request_bytes) return "431";
  return "";
}

void CheckResponse(const std::string& r) {
  if (r == "431") return;
  FUZZ_CHECK(r.rfind("HTTP/1.1 ", 0) == 0, r);
  const size_t end = r.find("\r\n\r\n");
  FUZZ_CHECK(end != std::string::npos, r);
  const size_t cl = r.find("Content-Length: ");
  FUZZ_CHECK(cl != std::string::npos && cl < end, r);
  uint64_t length = 0;
  FUZZ_CHECK(absl::SimpleAtoi(r.substr(cl + 16, r.find("\r\n", cl) - cl - 16), &length), r);
  const size_t body = r.size() - end - 4;
  FUZZ_CHECK(body == length || body == 0, r);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const size_t max_request_bytes = 64 + ((data[0] | (size_t{data[1]} << 8)) & 8191);
  std::string whole, in, answer;
  for (size_t at = 2; at < size;) {
    const size_t n = std::min<size_t>(size_t{data[at]} + 1, size - at - 1);
    if (n == 0) break;
    const std::string piece(reinterpret_cast<const char*>(data) + at + 1, n);
    at += 1 + n;
    whole += piece;
    if (answer.empty()) answer = Serve(&in, piece, max_request_bytes);
  }
  std::string at_once;
  const std::string one_piece = Serve(&at_once, whole, max_request_bytes);
  FUZZ_CHECK(answer == one_piece, "pieces answered\n" + answer + "\nat once\n" + one_piece);
  if (!answer.empty()) CheckResponse(answer);
  return 0;
}
