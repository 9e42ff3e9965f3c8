#include "server/ops/metrics_http_request.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <strings.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "server/ops/metrics_http.h"

namespace muond::server::http {

std::string Response(const char* status, const std::string& body, bool head,
                     const char* extra_headers, const char* content_type) {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type, "\r\n",
                      extra_headers, "Content-Length: ", body.size(),
                      "\r\nConnection: close\r\n\r\n", head ? "" : body);
}

// The length of the request head in `in` (request line and headers up to and including the line
// break before the blank line), or npos while it is incomplete. Scans from `from`.
size_t HeadLength(std::string_view in, size_t from) {
  for (size_t i = in.find('\n', from); i != std::string_view::npos; i = in.find('\n', i + 1)) {
    if (i + 1 < in.size() && in[i + 1] == '\n') return i + 1;
    if (i + 2 < in.size() && in[i + 1] == '\r' && in[i + 2] == '\n') return i + 1;
  }
  return std::string_view::npos;
}

namespace {

std::string_view NextLine(std::string_view* rest) {
  const size_t eol = rest->find('\n');
  std::string_view line = rest->substr(0, eol);
  rest->remove_prefix(eol == std::string_view::npos ? rest->size() : eol + 1);
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  return line;
}

bool NameIs(std::string_view name, std::string_view expected) {
  return name.size() == expected.size() &&
         strncasecmp(name.data(), expected.data(), name.size()) == 0;
}

struct RequestHead {
  std::string_view method;
  std::string_view path;  // The target without its query.
  bool has_body = false;
  bool has_host = false;
  std::string_view host;  // The Host header's value.
};

// Parses the request line and the headers that matter here; false when they do not parse.
bool ParseHead(std::string_view head, RequestHead* out) {
  const std::string_view line = NextLine(&head);
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos || sp1 == 0 || sp2 == sp1 + 1) return false;
  const std::string_view version = line.substr(sp2 + 1);
  if (version != "HTTP/1.1" && version != "HTTP/1.0") return false;
  out->method = line.substr(0, sp1);
  const std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  out->path = target.substr(0, target.find_first_of("?#"));
  while (!head.empty()) {
    const std::string_view header = NextLine(&head);
    const size_t colon = header.find(':');
    // No colon, an empty name or a continuation line (obsolete folding): not a header.
    if (colon == std::string_view::npos || colon == 0 || header[0] == ' ' || header[0] == '\t') {
      return false;
    }
    const std::string_view name = header.substr(0, colon);
    std::string_view value = header.substr(colon + 1);
    value.remove_prefix(std::min(value.find_first_not_of(" \t"), value.size()));
    value = value.substr(0, value.find_last_not_of(" \t") + 1);
    if (NameIs(name, "Host")) {
      if (out->has_host) return false;  // two Host headers: a request smuggling attempt
      out->has_host = true;
      out->host = value;
    } else if (NameIs(name, "Transfer-Encoding")) {
      out->has_body = true;
    } else if (NameIs(name, "Content-Length")) {
      if (value.empty() || value.find_first_not_of("0123456789") != std::string_view::npos) {
        return false;
      }
      out->has_body = out->has_body || value.find_first_not_of('0') != std::string_view::npos;
    }
  }
  return true;
}

bool IsLoopback(std::string_view host) {
  return host == "[::1]" || host.substr(0, 4) == "127.";
}

bool IsIpLiteral(std::string_view host) {
  unsigned char buf[sizeof(in6_addr)];
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    return inet_pton(AF_INET6, std::string(host.substr(1, host.size() - 2)).c_str(), buf) == 1;
  }
  return inet_pton(AF_INET, std::string(host).c_str(), buf) == 1;
}

}  // namespace

bool HostNamesServer(std::string_view value, const BoundAddress& bound) {
  // HOST[:PORT]; an IPv6 literal in brackets. Without a port the default port 80 is meant.
  std::string_view host = value;
  int port = 80;
  const size_t colon = value.rfind(':');
  if (colon != std::string_view::npos && value.find(']', colon) == std::string_view::npos) {
    const std::string_view digits = value.substr(colon + 1);
    if (digits.empty() || digits.size() > 5 ||
        digits.find_first_not_of("0123456789") != std::string_view::npos) {
      return false;
    }
    port = std::stoi(std::string(digits));
    host = value.substr(0, colon);
  }
  if (host.empty() || port != bound.port) return false;
  const bool wildcard = bound.host == "0.0.0.0" || bound.host == "[::]";
  if (NameIs(host, bound.host)) return true;
  if (NameIs(host, "localhost")) return wildcard || IsLoopback(bound.host);
  if (!wildcard) return false;
  if (IsIpLiteral(host)) return true;
  char name[256] = {};
  return gethostname(name, sizeof(name) - 1) == 0 && NameIs(host, name);
}

// The response to one request head.
std::string Answer(std::string_view head, const common::MetricsRegistry& registry,
                   const std::vector<MetricsPage>& pages, const BoundAddress& bound) {
  RequestHead request;
  if (!ParseHead(head, &request)) {
    return Response("400 Bad Request", "Bad request: not an HTTP/1.1 request\n");
  }
  const bool head_only = request.method == "HEAD";
  const MetricsPage* page = nullptr;
  for (const MetricsPage& p : pages) {
    if (request.path == p.path) page = &p;
  }
  if (page == nullptr && request.path != kMetricsPath) {
    return Response("404 Not Found", "Not found: metrics are served at /metrics\n", head_only);
  }
  // Every page (and /metrics) is read-only: GET or HEAD, without a body.
  if (request.method != "GET" && !head_only) {
    return Response("405 Method Not Allowed", "Method not allowed: use GET\n", false,
                    "Allow: GET, HEAD\r\n");
  }
  if (request.has_body) {
    return Response("413 Payload Too Large", "Payload too large: GET and HEAD take no body\n",
                    head_only);
  }
  if (page != nullptr && page->check_host && !(request.has_host && HostNamesServer(request.host, bound))) {
    return Response("421 Misdirected Request",
                    absl::StrCat("Misdirected request: the Host header '",
                                 request.has_host ? std::string(request.host).substr(0, 256)
                                                  : std::string("(none)"),
                                 "' does not name this server (", bound.host, ":", bound.port,
                                 "); the page answers only requests addressed to it\n"),
                    head_only);
  }
  if (page != nullptr) {
    const std::string headers = absl::StrCat("Cache-Control: no-store\r\n", page->extra_headers);
    return Response("200 OK", page->render(), head_only, headers.c_str(),
                    page->content_type.c_str());
  }
  return Response("200 OK", registry.Serialize(), head_only, "Cache-Control: no-store\r\n",
                  MetricsServer::kContentType);
}

}  // namespace muond::server::http
