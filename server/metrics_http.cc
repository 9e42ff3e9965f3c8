#include "server/metrics_http.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <pthread.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <string_view>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "civetweb.h"
#include "common/logging.h"

// civetweb's threads in a process with a large static TLS. Debian's libcivetweb is built with a
// fixed thread stack size (USE_STACK_SIZE, ~100 KiB), and glibc carves every thread's static TLS
// out of its stack: pthread_create fails with EINVAL when the TLS does not fit. muond loads
// LibTorch, OpenBLAS and glog, whose static TLS is ~100 KiB together, so civetweb could not start
// a single thread there ("Cannot create threads"). This definition interposes on the libc one for
// the whole process (the executable's dynamic symbols come first) and raises any smaller request
// to 1 MiB; a larger request is passed through unchanged. Thread stacks are virtual memory, so
// the cost is address space only.
extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t size) {
  using SetStackSize = int (*)(pthread_attr_t*, size_t);
  static const SetStackSize next =
      reinterpret_cast<SetStackSize>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  if (next == nullptr) return ENOSYS;
  return next(attr, std::max<size_t>(size, size_t{1} << 20));
}

namespace muond::server {
namespace {

constexpr char kMetricsPath[] = "/metrics";

struct ListenAddress {
  std::string host;  // As civetweb wants it: "127.0.0.1" or "[::1]".
  bool ipv6 = false;
  int port = 0;
};

absl::Status BadAddress(const std::string& address, std::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("metrics address \"", address, "\" is not HOST:PORT: ", std::string(why)));
}

absl::StatusOr<ListenAddress> ParseListenAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return BadAddress(address, "no port");
  std::string host = address.substr(0, colon);
  const std::string port_text = address.substr(colon + 1);
  if (port_text.empty() || port_text.size() > 5 ||
      port_text.find_first_not_of("0123456789") != std::string::npos ||
      std::stoi(port_text) > 65535) {
    return BadAddress(address, "the port must be a number from 0 to 65535");
  }
  ListenAddress out;
  out.port = std::stoi(port_text);
  if (host == "localhost") host = "127.0.0.1";
  unsigned char buf[sizeof(in6_addr)];
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    const std::string literal = host.substr(1, host.size() - 2);
    if (inet_pton(AF_INET6, literal.c_str(), buf) != 1) {
      return BadAddress(address, "the host in brackets is not an IPv6 address");
    }
    out.ipv6 = true;
  } else if (inet_pton(AF_INET, host.c_str(), buf) != 1) {
    return BadAddress(address,
                      "the host must be an IPv4 address, \"localhost\" or [an IPv6 address]");
  }
  out.host = host;
  return out;
}

// Sends a short plain-text response; returns the status for civetweb's access log.
int SendPlain(mg_connection* conn, int status, const std::string& body,
              const char* allow = nullptr) {
  mg_response_header_start(conn, status);
  mg_response_header_add(conn, "Content-Type", "text/plain; charset=utf-8", -1);
  if (allow != nullptr) mg_response_header_add(conn, "Allow", allow, -1);
  const std::string length = std::to_string(body.size());
  mg_response_header_add(conn, "Content-Length", length.c_str(), -1);
  mg_response_header_send(conn);
  mg_write(conn, body.data(), body.size());
  return status;
}

// Opens and closes one TCP connection to the listener (see ~MetricsServer). Errors are ignored.
void PokeListener(bool ipv6, const std::string& host, int port) {
  sockaddr_storage storage;
  std::memset(&storage, 0, sizeof(storage));
  socklen_t length = 0;
  if (ipv6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&storage);
    a->sin6_family = AF_INET6;
    a->sin6_port = htons(static_cast<uint16_t>(port));
    const std::string literal = host.substr(1, host.size() - 2);  // Strip the brackets.
    if (inet_pton(AF_INET6, literal.c_str(), &a->sin6_addr) != 1 ||
        IN6_IS_ADDR_UNSPECIFIED(&a->sin6_addr)) {
      a->sin6_addr = in6addr_loopback;
    }
    length = sizeof(*a);
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&storage);
    a->sin_family = AF_INET;
    a->sin_port = htons(static_cast<uint16_t>(port));
    if (inet_pton(AF_INET, host.c_str(), &a->sin_addr) != 1 || a->sin_addr.s_addr == INADDR_ANY) {
      a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    }
    length = sizeof(*a);
  }
  const int fd = socket(storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  (void)connect(fd, reinterpret_cast<const sockaddr*>(&storage), length);
  close(fd);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& address,
                                                                    common::Registry* registry) {
  absl::StatusOr<ListenAddress> listen = ParseListenAddress(address);
  if (!listen.ok()) return listen.status();

  static std::once_flag init_once;
  std::call_once(init_once, [] { mg_init_library(0); });
  if (listen->ipv6 && mg_check_feature(MG_FEATURES_IPV6) == 0) {
    return absl::UnavailableError(
        absl::StrCat("metrics address \"", address, "\": this civetweb build has no IPv6 support"));
  }

  const std::string ports = absl::StrCat(listen->host, ":", listen->port);
  // No document_root: civetweb serves no files, only the handler below.
  // clang-format off
  const char* options[] = {
      "listening_ports", ports.c_str(),
      "num_threads", "2",
      "enable_keep_alive", "no",
      "request_timeout_ms", "10000",
      nullptr,
  };
  // clang-format on
  mg_callbacks callbacks;
  std::memset(&callbacks, 0, sizeof(callbacks));
  callbacks.log_message = &MetricsServer::LogMessage;

  std::unique_ptr<MetricsServer> server(new MetricsServer(registry));
  mg_init_data init;
  std::memset(&init, 0, sizeof(init));
  init.callbacks = &callbacks;
  init.user_data = server.get();
  init.configuration_options = options;
  unsigned error_code = 0;
  char error_text[256] = {0};
  mg_error_data error;
  error.code = &error_code;
  error.text = error_text;
  error.text_buffer_size = sizeof(error_text);
  server->listen_host_ = listen->host;
  server->listen_ipv6_ = listen->ipv6;
  server->context_ = mg_start2(&init, &error);
  if (server->context_ == nullptr) {
    absl::MutexLock lock(&server->startup_mu_);
    // civetweb logs the cause ("cannot bind to ...: 98 (Address already in use)") and then returns
    // only its summary, also logged, as the error text.
    const std::string why = !server->startup_errors_.empty() ? server->startup_errors_
                            : error_text[0] != 0             ? std::string(error_text)
                                                             : "civetweb failed";
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on \"", address, "\": ", why));
  }

  mg_server_port bound[4];
  std::memset(bound, 0, sizeof(bound));
  const int n = mg_get_server_ports(server->context_, 4, bound);
  if (n < 1 || bound[0].port <= 0) {
    return absl::InternalError(
        absl::StrCat("metrics address \"", address, "\": cannot read the bound port back"));
  }
  server->port_ = bound[0].port;
  server->address_ = absl::StrCat(listen->host, ":", server->port_);
  // "/" is a prefix of every path: the handler answers 404 itself for anything but /metrics.
  mg_set_request_handler(server->context_, "/", &MetricsServer::HandleRequest, server.get());
  server->started_.store(true);
  return server;
}

MetricsServer::~MetricsServer() {
  if (context_ == nullptr) return;
  // civetweb's accept loop checks its stop flag only between polls, which time out every 2 s; a
  // connection arriving after mg_stop has raised the flag ends the wait at once. Without this every
  // daemon shutdown (and every test that stops a server) would take 2 s longer.
  std::atomic<bool> stopped{false};
  std::thread waker([this, &stopped] {
    while (!stopped.load()) {
      PokeListener(listen_ipv6_, listen_host_, port_);
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  mg_stop(context_);
  stopped.store(true);
  waker.join();
}

int MetricsServer::LogMessage(const mg_connection* conn, const char* message) {
  const mg_context* context = conn != nullptr ? mg_get_context(conn) : nullptr;
  auto* self =
      context != nullptr ? static_cast<MetricsServer*>(mg_get_user_data(context)) : nullptr;
  if (self != nullptr && !self->started_.load()) {
    // During Start: kept for its Status, which is more useful than civetweb's own error text
    // ("Failed to setup server ports" without the reason).
    absl::MutexLock lock(&self->startup_mu_);
    absl::StrAppend(&self->startup_errors_, self->startup_errors_.empty() ? "" : "; ", message);
  } else {
    MUOND_LOG(WARNING) << "metrics http: " << message;
  }
  return 1;  // Handled: civetweb writes nothing itself.
}

int MetricsServer::HandleRequest(mg_connection* conn, void* cbdata) {
  const MetricsServer* self = static_cast<const MetricsServer*>(cbdata);
  const mg_request_info* info = mg_get_request_info(conn);
  const std::string_view path = info->local_uri != nullptr ? info->local_uri : "";
  const std::string_view method = info->request_method != nullptr ? info->request_method : "";
  if (path != kMetricsPath) {
    return SendPlain(conn, 404, "Not found: metrics are served at /metrics\n");
  }
  const bool head = method == "HEAD";
  if (method != "GET" && !head) {
    return SendPlain(conn, 405, "Method not allowed: use GET\n", "GET, HEAD");
  }
  const std::string body = self->registry_->Serialize();
  mg_response_header_start(conn, 200);
  mg_response_header_add(conn, "Content-Type", kContentType, -1);
  mg_response_header_add(conn, "Cache-Control", "no-store", -1);
  const std::string length = std::to_string(body.size());
  mg_response_header_add(conn, "Content-Length", length.c_str(), -1);
  mg_response_header_send(conn);
  if (!head) mg_write(conn, body.data(), body.size());
  return 200;
}

}  // namespace muond::server
