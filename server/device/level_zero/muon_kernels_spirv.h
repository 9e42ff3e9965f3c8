// The SPIR-V module of kernels/muon_kernels.cl, compiled at build time (clang-14 + llvm-spirv-14)
// and embedded by embed_binary.cmake into the generated muon_kernels_spirv.cc.
#ifndef MUOND_SERVER_DEVICE_LEVEL_ZERO_MUON_KERNELS_SPIRV_H_
#define MUOND_SERVER_DEVICE_LEVEL_ZERO_MUON_KERNELS_SPIRV_H_

#include <cstddef>

namespace muond::server::device::level_zero {

// The module's bytes (4-byte aligned: SPIR-V is a stream of 32-bit words) and its size in bytes.
extern const unsigned char kMuonKernelsSpirv[];
extern const size_t kMuonKernelsSpirvSize;

}  // namespace muond::server::device::level_zero

#endif  // MUOND_SERVER_DEVICE_LEVEL_ZERO_MUON_KERNELS_SPIRV_H_
