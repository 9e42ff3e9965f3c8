// The Muon / Newton-Schulz kernels (DESIGN.md 3) in OpenCL C 1.2 (valid OpenCL C 2.0 as well).
//
// One source, two consumers: the build compiles it to SPIR-V for the Level Zero backend
// (clang-14 -cc1 -triple spir64, llvm-spirv-14; embedded in the binary), and the tests build the
// same text with clBuildProgram on PoCL to check every kernel and the whole update on the CPU.
// The host side that sequences these kernels is muon_kernel_driver.cc.
//
// Conventions shared with the driver:
//  - buffers are passed as untyped global pointers plus an element offset and a dtype code
//    (DTYPE_*); bf16 is stored as ushort (the upper half of an fp32), fp16 as half through
//    vload_half/vstore_half_rte, so no fp16 extension is needed;
//  - arithmetic is fp32 whatever the storage; a value is rounded once, when it is stored;
//  - matrices are batches of row-major blocks, contiguous, with an explicit batch stride.
//
// No contraction of a * b + c into an fma anywhere in this file: the momentum EMA must round
// exactly as the host's Lerp (server/optim/muon_math.cc, built with -ffp-contract=off) so that the
// stored momentum is bit-identical across backends. The GEMM and the reductions use fma()
// explicitly where they want it.
#pragma OPENCL FP_CONTRACT OFF

#define DTYPE_F32 0
#define DTYPE_BF16 1
#define DTYPE_F16 2

// GEMM and transpose tile edge; the driver launches these kernels with local size TILE x TILE.
#define TILE 16
// Work-group size of the one-dimensional kernels and the reductions.
#define GROUP 64

float LoadValue(const global void* p, long i, int dtype) {
  if (dtype == DTYPE_BF16) return as_float(((uint)((const global ushort*)p)[i]) << 16);
  if (dtype == DTYPE_F16) return vload_half((size_t)i, (const global half*)p);
  return ((const global float*)p)[i];
}

// Round to nearest even, NaN kept quiet (as LibTorch's c10::BFloat16 does).
ushort ToBfloat16(float f) {
  uint u = as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (ushort)((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (ushort)(u >> 16);
}

void StoreValue(global void* p, long i, int dtype, float v) {
  if (dtype == DTYPE_BF16) {
    ((global ushort*)p)[i] = ToBfloat16(v);
  } else if (dtype == DTYPE_F16) {
    vstore_half_rte(v, (size_t)i, (global half*)p);
  } else {
    ((global float*)p)[i] = v;
  }
}

// Batched GEMM with the polynomial combination in its epilogue:
//   out[z] = alpha * op(A[z]) op(B[z]) + beta * C[z] + diag * I
// op(A) is m x k, op(B) is k x n, C and out are m x n; op(X) = X^T when x_trans, else X. Each
// matrix is row-major with leading dimension ld* at offset *_off + z * *_stride (elements).
// Accumulates in fp32 over local-memory tiles; out is rounded once to out_dtype. C is read only
// when beta != 0 (pass any buffer otherwise); out must not alias A, B or C.
// Global size: (ceil(n / TILE) * TILE, ceil(m / TILE) * TILE, batch); local (TILE, TILE, 1).
kernel void gemm(const global void* a, long a_off, long a_stride, int lda, int a_trans,
                 int a_dtype, const global void* b, long b_off, long b_stride, int ldb,
                 int b_trans, int b_dtype, const global void* c, long c_off, long c_stride,
                 int ldc, int c_dtype, global void* out, long out_off, long out_stride, int ldo,
                 int out_dtype, int m, int n, int k, float alpha, float beta, float diag) {
  local float tile_a[TILE][TILE + 1];
  local float tile_b[TILE][TILE + 1];
  const int col = (int)get_global_id(0);
  const int row = (int)get_global_id(1);
  const int lx = (int)get_local_id(0);
  const int ly = (int)get_local_id(1);
  const long z = (long)get_global_id(2);
  a_off += z * a_stride;
  b_off += z * b_stride;
  float acc = 0.0f;
  for (int k0 = 0; k0 < k; k0 += TILE) {
    const int ak = k0 + lx;  // tile_a[ly][lx] = op(A)(row, ak)
    float va = 0.0f;
    if (row < m && ak < k) {
      va = LoadValue(a, a_off + (a_trans ? (long)ak * lda + row : (long)row * lda + ak), a_dtype);
    }
    tile_a[ly][lx] = va;
    const int bk = k0 + ly;  // tile_b[ly][lx] = op(B)(bk, col)
    float vb = 0.0f;
    if (bk < k && col < n) {
      vb = LoadValue(b, b_off + (b_trans ? (long)col * ldb + bk : (long)bk * ldb + col), b_dtype);
    }
    tile_b[ly][lx] = vb;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int t = 0; t < TILE; ++t) acc = fma(tile_a[ly][t], tile_b[t][lx], acc);
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (row < m && col < n) {
    float v = alpha * acc;
    if (beta != 0.0f) {
      v = beta * LoadValue(c, c_off + z * c_stride + (long)row * ldc + col, c_dtype) + v;
    }
    if (row == col) v = v + diag;
    StoreValue(out, out_off + z * out_stride + (long)row * ldo + col, out_dtype, v);
  }
}

// Copy with cast, optional transpose and scaling (the normalization, the casts between compute
// dtypes, the transposes of tall blocks and the final scale):
//   dst[z](i, j) = f(src[z](i, j)), or f(src[z](j, i)) when transpose (src[z] is then cols x rows),
//   f(v) = (use_denom ? v / denom[z] : v) * factor.
// dst[z] is rows x cols at dst_off + z * rows * cols; src[z] at src_off + z * rows * cols.
// Transposes go through a local-memory tile so that reads and writes are both along rows.
// Global size: (ceil(cols / TILE) * TILE, ceil(rows / TILE) * TILE, batch); local (TILE, TILE, 1).
kernel void convert(const global void* src, long src_off, int src_dtype, int transpose,
                    global void* dst, long dst_off, int dst_dtype, int rows, int cols,
                    const global float* denom, int use_denom, float factor) {
  local float tile[TILE][TILE + 1];
  const int lx = (int)get_local_id(0);
  const int ly = (int)get_local_id(1);
  const int j0 = (int)get_group_id(0) * TILE;
  const int i0 = (int)get_group_id(1) * TILE;
  const long z = (long)get_global_id(2);
  const long block = (long)rows * cols;
  src_off += z * block;
  dst_off += z * block;
  const float d = use_denom ? denom[z] : 1.0f;
  if (transpose) {
    // src is cols x rows: read its row j0 + ly, columns i0 + lx (contiguous in lx).
    const int sr = j0 + ly;
    const int sc = i0 + lx;
    float v = 0.0f;
    if (sr < cols && sc < rows) v = LoadValue(src, src_off + (long)sr * rows + sc, src_dtype);
    tile[ly][lx] = v;
  }
  barrier(CLK_LOCAL_MEM_FENCE);  // reached by every work-item of the group
  const int i = i0 + ly;
  const int j = j0 + lx;
  if (i < rows && j < cols) {
    // src(j, i) from the tile, or src(i, j) directly.
    float v = transpose ? tile[lx][ly] : LoadValue(src, src_off + (long)i * cols + j, src_dtype);
    if (use_denom) v = v / d;
    StoreValue(dst, dst_off + (long)i * cols + j, dst_dtype, v * factor);
  }
}

// Frobenius norm, first pass: partial[z * parts + g] = sum of x^2 over the elements
// g * GROUP + lid + t * parts * GROUP of block z (block_len elements at x_off + z * block_len).
// Global size: (parts * GROUP, batch); local (GROUP, 1).
kernel void sum_squares(const global void* x, long x_off, int dtype, long block_len, int parts,
                        global float* partial) {
  local float sums[GROUP];
  const int lid = (int)get_local_id(0);
  const int g = (int)get_group_id(0);
  const long z = (long)get_global_id(1);
  float acc = 0.0f;
  for (long i = (long)g * GROUP + lid; i < block_len; i += (long)parts * GROUP) {
    const float v = LoadValue(x, x_off + z * block_len + i, dtype);
    acc = fma(v, v, acc);
  }
  sums[lid] = acc;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int s = GROUP / 2; s > 0; s >>= 1) {
    if (lid < s) sums[lid] = sums[lid] + sums[lid + s];
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (lid == 0) partial[z * parts + g] = sums[0];
}

// Frobenius norm, second pass: denom[z] = sqrt(sum of partial[z * parts ..]) * k + eps, the
// normalization denominator of DESIGN.md 3. Global size: (GROUP, batch); local (GROUP, 1).
kernel void norm_denominator(const global float* partial, int parts, float k, float eps,
                             global float* denom) {
  local float sums[GROUP];
  const int lid = (int)get_local_id(0);
  const long z = (long)get_global_id(1);
  float acc = 0.0f;
  for (int i = lid; i < parts; i += GROUP) acc = acc + partial[z * parts + i];
  sums[lid] = acc;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int s = GROUP / 2; s > 0; s >>= 1) {
    if (lid < s) sums[lid] = sums[lid] + sums[lid + s];
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (lid == 0) denom[z] = sqrt(sums[0]) * k + eps;
}

// flags[flag] |= 1 when any of the n fp32 values at x_off is NaN or infinite (an exponent test:
// unaffected by any fast-math setting). Grid-stride; any one-dimensional launch size.
kernel void flag_nonfinite(const global float* x, long x_off, long n, volatile global int* flags,
                           int flag) {
  int bad = 0;
  for (long i = (long)get_global_id(0); i < n; i += (long)get_global_size(0)) {
    if ((as_uint(x[x_off + i]) & 0x7f800000u) == 0x7f800000u) bad = 1;
  }
  if (bad) atomic_or(&flags[flag], 1);
}

// p[0 .. n) = value. Grid-stride.
kernel void fill_int(global int* p, long n, int value) {
  for (long i = (long)get_global_id(0); i < n; i += (long)get_global_size(0)) p[i] = value;
}

// torch.lerp's formula, exactly as the host's Lerp (server/optim/muon_math.cc).
float Lerp(float start, float end, float weight) {
  return fabs(weight) < 0.5f ? start + weight * (end - start)
                             : end - (end - start) * (1.0f - weight);
}

// DESIGN.md 3 steps 1 and 2 on n fp32 elements, in place:
//   momentum <- lerp(momentum, grad, 1 - beta); update <- nesterov ? lerp(grad, momentum, beta)
//   : momentum, where update overwrites grad (grad[i] is read before it is written). Grid-stride.
kernel void muon_momentum(global float* grad_update, global float* momentum, long n,
                          float one_minus_beta, float beta, int nesterov) {
  for (long i = (long)get_global_id(0); i < n; i += (long)get_global_size(0)) {
    const float g = grad_update[i];
    const float m = Lerp(momentum[i], g, one_minus_beta);
    momentum[i] = m;
    grad_update[i] = nesterov ? Lerp(g, m, beta) : m;
  }
}
