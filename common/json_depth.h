// JSON read from outside the daemon (job.json, safetensors headers, checkpoint manifests, job
// records) is parsed with a nesting limit. nlohmann::json parses without recursion but copies,
// dumps and compares recursively: a value nested some ten thousand levels deep (a few hundred KB
// of '[') overflows the stack, and the daemon dies before any check can refuse it. Deeper values
// are dropped while they are read, so nothing deep is ever built, and the caller refuses the input.
#ifndef MUOND_COMMON_JSON_DEPTH_H_
#define MUOND_COMMON_JSON_DEPTH_H_

#include <functional>
#include <string_view>

namespace muond::common {

// Far beyond any muond format (job.json nests 4 deep), far below what overflows a thread's stack.
inline constexpr int kMaxJsonDepth = 64;

// Parses `text` as JsonT (nlohmann::json or ordered_json) without exceptions: the result is
// discarded (is_discarded()) when `text` is not JSON. Sets *too_deep when a value nests deeper
// than kMaxJsonDepth (the result then lacks those values: refuse it). `also`, when given, sees
// every parse event as a parser callback does and may drop values the same way.
template <typename JsonT>
JsonT ParseJsonWithDepthLimit(
    std::string_view text, bool* too_deep,
    const std::function<bool(int, typename JsonT::parse_event_t, JsonT&)>& also = nullptr) {
  *too_deep = false;
  const auto callback = [&](int depth, typename JsonT::parse_event_t event, JsonT& parsed) {
    if (depth > kMaxJsonDepth) {
      *too_deep = true;
      return false;
    }
    return also ? also(depth, event, parsed) : true;
  };
  return JsonT::parse(text.begin(), text.end(), callback, /*allow_exceptions=*/false);
}

}  // namespace muond::common

#endif  // MUOND_COMMON_JSON_DEPTH_H_
