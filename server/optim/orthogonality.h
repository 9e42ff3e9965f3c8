// How far an orthogonalized Muon direction is from orthogonal: for each block X (rows x cols,
// r = min(rows, cols)), the Gram matrix on its short side (X Xᵀ when rows <= cols, else Xᵀ X, r x
// r) against the identity, ||G - I||_F / sqrt(r), combined over the blocks as the root mean square.
// 0 for an exactly orthogonal direction; Muon's quintic Newton-Schulz leaves the singular values in
// a band around 1 by design (about [0.7, 1.2] for the Keller Jordan coefficients), so a healthy
// update reads a steady value of a few tenths, and a precision plan that is too loose for a model
// shows as a rise (the metric muond_update_orthogonality watches it).
//
// Thread-safety: pure functions; the products run on the system BLAS's threads.
#ifndef MUOND_SERVER_OPTIM_ORTHOGONALITY_H_
#define MUOND_SERVER_OPTIM_ORTHOGONALITY_H_

#include <cstdint>

#include "common/job_spec.h"
#include "server/optim/muon_math.h"

namespace muond::server {

// The measure above of `x`: `geometry.batch` blocks of rows x cols fp32, row-major, contiguous,
// each divided by `scale` first (the Muon update is s * O: pass s to measure O). Uses a working
// buffer of at most 256 x r floats (the Gram matrix is formed in row blocks). Accumulates in
// float64; NaN when `x` holds a non-finite value.
// REQUIRES: rows, cols, batch >= 1, scale > 0.
double OrthogonalityError(const float* x, const MatrixGeometry& geometry, double scale);

// The same for a Muon update of `spec` as the daemon returns it (DESIGN.md 3 step 4: the
// orthogonalized direction times MuonScale of the job's scale mode).
double UpdateOrthogonalityError(const common::MuonConfig& config, const common::MatrixSpec& spec,
                                const float* update);

}  // namespace muond::server

#endif  // MUOND_SERVER_OPTIM_ORTHOGONALITY_H_
