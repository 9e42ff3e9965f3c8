// The status page of the metrics address: `/` is one HTML page (its CSS, JavaScript and SVG
// drawing inline, compiled into the binary: no external script, font or stylesheet, so it works on
// an air-gapped node) that fetches `/api/v1/status` (server/ops/status_json.h) every few seconds
// and redraws itself without reloading: the daemon, each job with its ranks and their transport,
// the last steps of each job as stacked bars per phase, the step-time history as a line chart,
// and checkpoint operations in progress.
//
// The page counts its own failures (script errors, console errors, loads the content security
// policy blocked, failed fetches) in the `data-errors` attribute of <body> and its successful
// redraws in `data-refreshes`, so a headless browser's DOM dump shows whether it worked
// (tests/ops/status_page_browser_test.sh).
//
// Thread-safety: the functions are pure.
#ifndef MUOND_SERVER_OPS_STATUS_PAGE_H_
#define MUOND_SERVER_OPS_STATUS_PAGE_H_

#include <string>
#include <vector>

#include "server/ops/metrics_http.h"

namespace muond::server {

inline constexpr char kStatusPagePath[] = "/";
inline constexpr char kStatusJsonPath[] = "/api/v1/status";

// The HTML of `/`.
const std::string& StatusPageHtml();

// The pages `/` and `/api/v1/status` for MetricsServerOptions::pages, the JSON rendered by
// `render_json` (StatusSource::Render). The HTML is served with a Content-Security-Policy that
// lets it load nothing but its own JSON.
std::vector<MetricsPage> StatusPages(std::function<std::string()> render_json);

}  // namespace muond::server

#endif  // MUOND_SERVER_OPS_STATUS_PAGE_H_
