#include "server/device/level_zero/muon_kernels.h"

#include <algorithm>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"

namespace muond::server::device::level_zero {
namespace {

// TILE and GROUP of muon_kernels.cl.
constexpr size_t kTile = 16;
constexpr size_t kGroup = 64;
// Work-groups of the grid-stride kernels at most (enough to fill a large GPU).
constexpr int64_t kMaxStrideGroups = 4096;
// Partial sums per block of the Frobenius norm at most (one work-group each).
constexpr int64_t kMaxNormParts = 256;

size_t RoundUp(int64_t n, size_t to) { return (static_cast<size_t>(n) + to - 1) / to * to; }

LaunchSize StrideLaunch(int64_t n) {
  const int64_t groups = std::clamp<int64_t>((n + kGroup - 1) / kGroup, 1, kMaxStrideGroups);
  return {static_cast<size_t>(groups) * kGroup, 1, 1};
}

bool FitsInt(int64_t v) { return v >= 0 && v <= std::numeric_limits<int32_t>::max(); }

std::string Describe(const MatrixBatch& m) {
  return absl::StrCat("[", m.batch, ", ", m.rows, ", ", m.cols, "]");
}

}  // namespace

int32_t KernelDType(common::DType dtype) {
  switch (dtype) {
    case common::DType::kFloat32:
      return 0;
    case common::DType::kBFloat16:
      return 1;
    case common::DType::kFloat16:
      return 2;
  }
  return 0;
}

int64_t DTypeBytes(common::DType dtype) { return dtype == common::DType::kFloat32 ? 4 : 2; }

absl::Status Gemm(KernelQueue& queue, const MatrixBatch& a, bool a_trans, const MatrixBatch& b,
                  bool b_trans, const MatrixBatch* c, float alpha, float beta, float diag,
                  const MatrixBatch& out) {
  const int64_t m = a_trans ? a.cols : a.rows;
  const int64_t k = a_trans ? a.rows : a.cols;
  const int64_t kb = b_trans ? b.cols : b.rows;
  const int64_t n = b_trans ? b.rows : b.cols;
  const bool use_c = beta != 0.0f;
  if (k != kb || out.rows != m || out.cols != n || a.batch != out.batch || b.batch != out.batch ||
      (use_c && (c == nullptr || c->rows != m || c->cols != n || c->batch != out.batch))) {
    return absl::InvalidArgumentError(
        absl::StrCat("gemm: shapes do not match: a ", Describe(a), a_trans ? "^T" : "", ", b ",
                     Describe(b), b_trans ? "^T" : "", ", c ",
                     use_c && c != nullptr ? Describe(*c) : "unused", ", out ", Describe(out)));
  }
  if (out.buffer.handle == a.buffer.handle || out.buffer.handle == b.buffer.handle ||
      (use_c && out.buffer.handle == c->buffer.handle)) {
    return absl::InvalidArgumentError("gemm: out aliases an input");
  }
  if (!FitsInt(m) || !FitsInt(n) || !FitsInt(k) || !FitsInt(a.cols) || !FitsInt(b.cols)) {
    return absl::InvalidArgumentError("gemm: a dimension exceeds 2^31 - 1");
  }
  const MatrixBatch& cc = use_c ? *c : out;  // unread when beta == 0
  const std::vector<KernelArg> args = {KernelArg::Buffer(a.buffer),
                                       KernelArg::Long(a.offset),
                                       KernelArg::Long(a.rows * a.cols),
                                       KernelArg::Int(static_cast<int32_t>(a.cols)),
                                       KernelArg::Int(a_trans ? 1 : 0),
                                       KernelArg::Int(KernelDType(a.dtype)),
                                       KernelArg::Buffer(b.buffer),
                                       KernelArg::Long(b.offset),
                                       KernelArg::Long(b.rows * b.cols),
                                       KernelArg::Int(static_cast<int32_t>(b.cols)),
                                       KernelArg::Int(b_trans ? 1 : 0),
                                       KernelArg::Int(KernelDType(b.dtype)),
                                       KernelArg::Buffer(cc.buffer),
                                       KernelArg::Long(cc.offset),
                                       KernelArg::Long(cc.rows * cc.cols),
                                       KernelArg::Int(static_cast<int32_t>(cc.cols)),
                                       KernelArg::Int(KernelDType(cc.dtype)),
                                       KernelArg::Buffer(out.buffer),
                                       KernelArg::Long(out.offset),
                                       KernelArg::Long(m * n),
                                       KernelArg::Int(static_cast<int32_t>(n)),
                                       KernelArg::Int(KernelDType(out.dtype)),
                                       KernelArg::Int(static_cast<int32_t>(m)),
                                       KernelArg::Int(static_cast<int32_t>(n)),
                                       KernelArg::Int(static_cast<int32_t>(k)),
                                       KernelArg::Float(alpha),
                                       KernelArg::Float(beta),
                                       KernelArg::Float(diag)};
  return queue.Launch("gemm", args,
                      {RoundUp(n, kTile), RoundUp(m, kTile), static_cast<size_t>(out.batch)},
                      {kTile, kTile, 1});
}

absl::Status Convert(KernelQueue& queue, const MatrixBatch& src, bool transpose,
                     const KernelBufferRef* denom, float factor, const MatrixBatch& out) {
  const bool shapes_match = transpose ? (src.rows == out.cols && src.cols == out.rows)
                                      : (src.rows == out.rows && src.cols == out.cols);
  if (!shapes_match || src.batch != out.batch) {
    return absl::InvalidArgumentError(absl::StrCat("convert: shapes do not match: src ",
                                                   Describe(src), transpose ? "^T" : "", ", out ",
                                                   Describe(out)));
  }
  if (out.buffer.handle == src.buffer.handle) {
    return absl::InvalidArgumentError("convert: out aliases src");
  }
  if (!FitsInt(out.rows) || !FitsInt(out.cols)) {
    return absl::InvalidArgumentError("convert: a dimension exceeds 2^31 - 1");
  }
  const std::vector<KernelArg> args = {
      KernelArg::Buffer(src.buffer), KernelArg::Long(src.offset),
      KernelArg::Int(KernelDType(src.dtype)), KernelArg::Int(transpose ? 1 : 0),
      KernelArg::Buffer(out.buffer), KernelArg::Long(out.offset),
      KernelArg::Int(KernelDType(out.dtype)), KernelArg::Int(static_cast<int32_t>(out.rows)),
      KernelArg::Int(static_cast<int32_t>(out.cols)),
      // Unread when there is no denominator: any valid buffer will do.
      KernelArg::Buffer(denom != nullptr ? *denom : src.buffer),
      KernelArg::Int(denom != nullptr ? 1 : 0), KernelArg::Float(factor)};
  return queue.Launch(
      "convert", args,
      {RoundUp(out.cols, kTile), RoundUp(out.rows, kTile), static_cast<size_t>(out.batch)},
      {kTile, kTile, 1});
}

int32_t NormParts(int64_t block_len) {
  return static_cast<int32_t>(
      std::clamp<int64_t>((block_len + kGroup - 1) / kGroup, 1, kMaxNormParts));
}

absl::Status FrobeniusDenominator(KernelQueue& queue, const MatrixBatch& x, float k, float eps,
                                  KernelBufferRef partial, KernelBufferRef denom) {
  const int64_t block_len = x.rows * x.cols;
  const int32_t parts = NormParts(block_len);
  const std::vector<KernelArg> sum_args = {
      KernelArg::Buffer(x.buffer), KernelArg::Long(x.offset), KernelArg::Int(KernelDType(x.dtype)),
      KernelArg::Long(block_len),  KernelArg::Int(parts),     KernelArg::Buffer(partial)};
  const auto batch = static_cast<size_t>(x.batch);
  absl::Status s = queue.Launch("sum_squares", sum_args,
                                {static_cast<size_t>(parts) * kGroup, batch, 1}, {kGroup, 1, 1});
  if (!s.ok()) return s;
  const std::vector<KernelArg> norm_args = {KernelArg::Buffer(partial), KernelArg::Int(parts),
                                            KernelArg::Float(k), KernelArg::Float(eps),
                                            KernelArg::Buffer(denom)};
  return queue.Launch("norm_denominator", norm_args, {kGroup, batch, 1}, {kGroup, 1, 1});
}

absl::Status FlagNonFinite(KernelQueue& queue, KernelBufferRef x, int64_t offset, int64_t n,
                           KernelBufferRef flags, int32_t flag) {
  const std::vector<KernelArg> args = {KernelArg::Buffer(x), KernelArg::Long(offset),
                                       KernelArg::Long(n), KernelArg::Buffer(flags),
                                       KernelArg::Int(flag)};
  return queue.Launch("flag_nonfinite", args, StrideLaunch(n), {kGroup, 1, 1});
}

absl::Status FillInt(KernelQueue& queue, KernelBufferRef p, int64_t n, int32_t value) {
  const std::vector<KernelArg> args = {KernelArg::Buffer(p), KernelArg::Long(n),
                                       KernelArg::Int(value)};
  return queue.Launch("fill_int", args, StrideLaunch(n), {kGroup, 1, 1});
}

absl::Status MuonMomentum(KernelQueue& queue, KernelBufferRef grad_update, KernelBufferRef momentum,
                          int64_t n, float one_minus_beta, float beta, bool nesterov) {
  const std::vector<KernelArg> args = {KernelArg::Buffer(grad_update),
                                       KernelArg::Buffer(momentum),
                                       KernelArg::Long(n),
                                       KernelArg::Float(one_minus_beta),
                                       KernelArg::Float(beta),
                                       KernelArg::Int(nesterov ? 1 : 0)};
  return queue.Launch("muon_momentum", args, StrideLaunch(n), {kGroup, 1, 1});
}

}  // namespace muond::server::device::level_zero
