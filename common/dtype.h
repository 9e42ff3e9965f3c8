// Element types muond moves and computes in, and host-side conversions between them.
//
// Gradients and updates travel in float32, bfloat16 or float16; momentum is always float32.
// Conversions round to nearest even (as PyTorch does) and are thread-compatible pure functions.
#ifndef MUOND_COMMON_DTYPE_H_
#define MUOND_COMMON_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"

namespace muond::common {

enum class DType { kFloat32, kBFloat16, kFloat16 };

// Bytes per element.
size_t DTypeSize(DType dtype);
// "float32", "bfloat16", "float16": the names used in job.json and the API.
std::string_view DTypeName(DType dtype);
// Parses a name of DTypeName (also accepts "fp32", "bf16", "fp16"); INVALID_ARGUMENT otherwise,
// naming the bad value and the accepted ones.
absl::StatusOr<DType> ParseDType(std::string_view name);
// "F32", "BF16", "F16": the names safetensors headers use.
std::string_view SafetensorsDTypeName(DType dtype);
// INVALID_ARGUMENT for any other safetensors dtype, naming it.
absl::StatusOr<DType> ParseSafetensorsDType(std::string_view name);

// Widens n elements of `src_dtype` at `src` into float32 at `dst`.
void ToFloat32(DType src_dtype, const void* src, size_t n, float* dst);
// Narrows n float32 elements at `src` into `dst_dtype` at `dst`, rounding to nearest even;
// NaN stays NaN, overflow becomes +-inf (float16).
void FromFloat32(const float* src, size_t n, DType dst_dtype, void* dst);
// Index of the first element that is NaN or +-inf, or -1 when all are finite.
int64_t FindNonFinite(const float* data, size_t n);
// The same for n elements of `dtype` at `data`, read in place (no conversion).
int64_t FindNonFiniteRaw(DType dtype, const void* data, size_t n);

}  // namespace muond::common

#endif  // MUOND_COMMON_DTYPE_H_
