// Small helpers for absl::Status propagation, used across muond.
//
// RETURN_IF_ERROR(expr): evaluates expr (an absl::Status); returns it from the enclosing function
// when it is not OK.
// ASSIGN_OR_RETURN(lhs, expr): evaluates expr (an absl::StatusOr<T>); on error returns its status,
// otherwise moves the value into lhs (which may be a declaration such as `auto x`).
#ifndef MUOND_COMMON_STATUS_MACROS_H_
#define MUOND_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define MUOND_CONCAT_INNER_(a, b) a##b
#define MUOND_CONCAT_(a, b) MUOND_CONCAT_INNER_(a, b)

#define RETURN_IF_ERROR(expr)                   \
  do {                                          \
    ::absl::Status muond_status_ = (expr);      \
    if (!muond_status_.ok()) return muond_status_; \
  } while (0)

#define ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                           \
  if (!tmp.ok()) return tmp.status();          \
  lhs = std::move(*tmp)

#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL_(MUOND_CONCAT_(muond_statusor_, __LINE__), lhs, expr)

#endif  // MUOND_COMMON_STATUS_MACROS_H_
