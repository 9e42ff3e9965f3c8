"""The bound that train_tiny_gpt.py holds its apply-mode loss parity to, with bf16 or fp16
parameters: how far rounding alone can move one step's loss between the trainer (parameters from
muond) and the in-process reference (parameters from fp32 masters of its own).

The reference steps with the trainer's gradients, taken at the parameters muond returned, so each
step starts from the same state and nothing compounds through the loss. Each step's loss
difference is held to 2 lambda u (|c|_2 + |g w|_2), u the unit roundoff (2^-8 bf16, 2^-11 fp16),
lambda 6: the masters differ by float32 arithmetic only, so each parameter is equal or one rounding
apart (|dw_i| <= 2u |w_i|, w_i taken at least 2^-8 of its tensor's rms, as float32 errors scale
with the tensor), and the two forward passes round each activation a_j once (relative error
<= u). Taken as independent (Higham and Mary's probabilistic rounding model), Hoeffding's
inequality holds the first-order effects, sum_i g_i dw_i (g: the step's mean gradient) to
2 lambda u |g w|_2 and each pass's sum_j c_j delta_j (c_j = a_j dL/da_j) to lambda u |c|_2, each
exceeded with probability 2 exp(-lambda^2 / 2) < 1e-7.

The parts: bound_factor (2 lambda u), RoundingRecord (|c|_2, recorded around the trainer's forward
pass), parameter_norm (|g w|_2) and bound_verdict (the run's verdict and what the parity line
says of it).
"""
import math
import sys

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

BOUND_LAMBDA = 6.0  # Hoeffding: a term of the bound exceeded with probability 2 exp(-18)


def bound_factor(dtype, scale):
    """2 lambda u for parameters of `dtype` (torch.finfo's eps is 2u), times `scale` (1 but in
    tests, which set 0 to see the check fail)."""
    return BOUND_LAMBDA * torch.finfo(dtype).eps * scale


class RoundingRecord(TorchFunctionMode):
    """Around a forward pass: keeps every operation's output that was rounded to `dtype` (not
    views, nor the exact embedding lookup, masking and copies) with its gradient, so that after
    backward squared_sum() is sum_j (a_j dL/da_j)^2, |c|_2^2 of the bound."""
    EXACT = ("embedding", "masked_fill", "reshape")

    def __init__(self, dtype):
        super().__init__()
        self.dtype, self.outputs = dtype, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (torch.is_tensor(out) and out.dtype == self.dtype and out.requires_grad
                and out._base is None and getattr(func, "__name__", "") not in self.EXACT):
            out.retain_grad()
            self.outputs.append(out)
        return out

    def squared_sum(self):
        return sum(float((a.double() * a.grad.double()).pow(2).sum()) for a in self.outputs
                   if a.grad is not None)

    def norm(self, world):
        """|c|_2 for L the mean of the `world` ranks' losses: c_j = a_j dL/da_j over every rank's
        activations, each rank's gradients taken of its own loss, so divided by world. A
        collective: every rank calls it after its backward."""
        t = torch.tensor([self.squared_sum()], dtype=torch.float64)
        dist.all_reduce(t)
        return math.sqrt(t.item() / world / world)


@torch.no_grad()
def parameter_norm(params, total, world):
    """|g w|_2 at the parameters `params` (before the step changes them): g = total / world, total
    the sum over the ranks of the gradients, flat in the order of params; each |w_i| taken at least
    2^-8 of its tensor's rms."""
    w = torch.cat([p.double().abs().clamp(min=p.double().pow(2).mean().sqrt().item() / 256)
                   .reshape(-1) for p in params])
    return total.double().div(world).mul(w).norm().item()


def bound_verdict(args, diffs, bounds, start, worst):
    """(every step within its bound, what the parity line says of it). diffs: |loss difference|
    per step from step 0; bounds: each step's bound from `start`; worst: the step of the largest
    difference (None when no step ran). Names the step over its bound on stderr."""
    if args.mode == "update" or worst is None:
        return True, ""
    if args.param_dtype == "float32":
        return True, " (float32 parameters: no rounding bound)"
    ratio = [d / b if b > 0 else (math.inf if d else 0.0) for d, b in zip(diffs[start:], bounds)]
    ratio = [r if r == r else math.inf for r in ratio]  # a NaN difference is over its bound
    t = start + max(range(len(ratio)), key=ratio.__getitem__)  # the step nearest its bound
    u = "2^-8" if args.param_dtype == "bfloat16" else "2^-11"
    why = (f"{u} relative {args.param_dtype} rounding of every parameter and activation, first "
           f"order, Hoeffding lambda {BOUND_LAMBDA:g}, per step from the same parameters")
    if ratio[t - start] > 1:
        print(f"step {t}: |loss difference| {diffs[t]:.3e} exceeds its bound "
              f"{bounds[t - start]:.3e}: more than rounding explains between muond's parameters "
              "and the reference's", file=sys.stderr)
        return False, f"; step {t}: {diffs[t]:.3e} > bound {bounds[t - start]:.3e} ({why})"
    return True, (f" <= bound {bounds[worst - start]:.3e} ({why}); every step within its bound, "
                  f"the nearest at {100 * ratio[t - start]:.2g}% (step {t})")
