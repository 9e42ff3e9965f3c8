// Compressed optimizer state (DESIGN.md 4, "state": {"momentum_dtype", "adamw_dtype"}): how a
// state array is stored in bfloat16 or int8 and how a step reads, updates and stores it again.
//
// - bfloat16: round to nearest even (as torch's float -> bfloat16 cast); 2 bytes per element.
// - int8, signed state (Muon's momentum, AdamW's first moment): linear absmax in blocks of
//   kStateBlock consecutive elements of the row-major tensor, as the 8-bit Muon work quantizes
//   the momentum: per block an fp32 scale s = absmax / 127 (raised by the fewest ulps that make
//   (127 * s) / 127 == s in fp32, so that encoding decoded values gives back the same scale and
//   codes: a checkpoint or export in fp32 reloads bit for bit), codes q = clamp(nearbyint(x /
//   s), -127, 127) (ties to even), value q * s. 1 + 4 / kStateBlock bytes per element.
// - int8, AdamW's second moment (non-negative): a logarithmic map in blocks of kStateBlock, per
//   block an fp32 scale = max v; code 0 is 0, code k in 1..255 is scale * 2^((k - 255) / 16).
//   Why not linear: v spans many orders of magnitude within a block, and a linear code rounds the
//   small entries to 0, whose update lr * m / (sqrt(v) + eps) then blows up by orders of magnitude
//   (the failure 8-bit Adam, Dettmers et al. 2022, avoids with its non-linear "dynamic" map). A log
//   map has the same relative precision at every magnitude: at most 2^(1/32) - 1 = 2.2 % on v
//   (1.1 % on sqrt(v)) down to 2^-15.9 of the block's largest; anything smaller but non-zero is
//   stored as that smallest code, an overestimate, which only shrinks its step.
//
// A step decodes a block into fp32, applies its update in fp32 (bit for bit the fp32 path's
// formula) and encodes the result. A block of zeros has scale 0 and decodes to zeros. No
// function here produces a NaN from finite input. Decoding then encoding again gives the same
// bits (bf16 always; int8 for normal fp32 scales: a block whose scale is subnormal may not).
//
// Held arrays (the state stores, server/engine): an array of n elements held as `dtype` lives in
// StoredWords(dtype, n) 32-bit words: fp32 values; bf16 codes; int8 the StateBlocks(n) fp32
// scales, then the n codes.
//
// Thread-safety: pure functions on caller-owned memory.
#ifndef MUOND_SERVER_OPTIM_STATE_CODEC_H_
#define MUOND_SERVER_OPTIM_STATE_CODEC_H_

#include <cstddef>
#include <cstdint>

#include "common/job_spec.h"

namespace muond::server {

using common::kStateBlock;
using common::StateBlocks;
using common::StateDType;

// Bytes n elements take held as `dtype` (int8: codes and scales).
inline constexpr uint64_t StateBytes(StateDType dtype, size_t n) {
  return common::StoredStateBytes(dtype, n);
}
// 32-bit words an array of n elements held as `dtype` takes (StateBytes rounded up).
inline constexpr size_t StoredWords(StateDType dtype, size_t n) {
  return static_cast<size_t>((StateBytes(dtype, n) + 3) / 4);
}
// Which int8 map an array takes: linear absmax (signed: momentum, AdamW's m) or logarithmic
// (non-negative: AdamW's v). bf16 and fp32 ignore it.
enum class StateRole { kSigned, kNonNegative };

// bfloat16, nearest even.
void EncodeBf16(const float* x, size_t n, uint16_t* out);
void DecodeBf16(const uint16_t* in, size_t n, float* x);

// Signed linear absmax int8 (see above). `scales`: StateBlocks(n) floats.
void EncodeLinearInt8(const float* x, size_t n, int8_t* q, float* scales);
void DecodeLinearInt8(const int8_t* q, const float* scales, size_t n, float* x);
// The scale of a block whose largest magnitude is `absmax` (see above).
float LinearScale(float absmax);

// Non-negative logarithmic int8 (see above). x >= 0 (a negative value is stored as 0).
void EncodeLogInt8(const float* x, size_t n, uint8_t* q, float* scales);
void DecodeLogInt8(const uint8_t* q, const float* scales, size_t n, float* x);

// Elements [begin, begin + len) of a held array of n elements: decoded into x[0, len), or
// encoded from x[0, len). `begin` is a multiple of kStateBlock and begin + len is one or n (whole
// blocks). fp32 arrays copy.
void DecodeStored(StateDType dtype, StateRole role, const float* stored, size_t n, size_t begin,
                  size_t len, float* x);
void EncodeStored(StateDType dtype, StateRole role, const float* x, size_t n, size_t begin,
                  size_t len, float* stored);
// The whole array, over the CPUs when it is large.
void DecodeStoredAll(StateDType dtype, StateRole role, const float* stored, size_t n, float* x);
void EncodeStoredAll(StateDType dtype, StateRole role, const float* x, size_t n, float* stored);

// Muon's momentum step (DESIGN.md 3 step 1) on stored momentum, block by block: decode, then
// momentum <- lerp(momentum, grad, 1 - beta) in fp32 exactly as ApplyMomentum (muon_math.h), the
// fp32 result into `momentum` (what the update is computed from), and its encoding into the
// output. The input and output codes (and scales) may be the same arrays.
void MomentumStepBf16(const common::MuonConfig& config, const float* grad, const uint16_t* in,
                      size_t n, float* momentum, uint16_t* out);
void MomentumStepInt8(const common::MuonConfig& config, const float* grad, const int8_t* q_in,
                      const float* scales_in, size_t n, float* momentum, int8_t* q_out,
                      float* scales_out);

}  // namespace muond::server

#endif  // MUOND_SERVER_OPTIM_STATE_CODEC_H_
