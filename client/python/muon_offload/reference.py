"""The Muon update of DESIGN.md section 3 in PyTorch, in-process and in fp32: the reference that a
trainer runs side by side with muond, and the math of MuonWithAuxAdam(backend="local").

The operations follow the daemon's CPU path (server/muon): the EMA as a lerp, the norm over
each block, X / (||X||_F * k + 1e-7), then per iteration A = X X^T, B = b A + c A A, X = a X + B X
as batched products, so that with fp32 compute the two agree to rounding. Pure functions on tensors,
and ApplyReference: apply mode (DESIGN.md 4b) with fp32 masters, for tests and examples.
"""
import math

import torch

STANDARD = (3.4445, -4.7750, 2.0315)
POLAR_EXPRESS = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
)
POLAR_EXPRESS_TAIL = (1.875, -1.25, 0.375)
POLAR_EXPRESS_SAFETY = 1.01
NORM_EPSILON = 1e-7
GRAM_RESTART_AFTER = 2
NS_METHODS = ("standard", "gram", "polar_express")
SCALE_MODES = ("original", "match_rms_adamw", "none")


def sum_of_squares(tensors):
    """The float64 sum of squares of `tensors` (None entries skipped), one host sync."""
    parts = [torch.linalg.vector_norm(t.detach(), 2, dtype=torch.float64).square()
             for t in tensors if t is not None]
    if not parts:
        return 0.0
    return float(torch.stack([x.cpu() for x in parts]).sum())


def clip_coefficient(sum_sq, max_norm):
    """muond's clip coefficient (server/optim/grad_norm.h): min(1, max_norm / (sqrt(sum_sq) +
    1e-6)) in float64, rounded to float32 once; exactly 1 without clipping (max_norm 0/None)."""
    if not max_norm:
        return 1.0
    coef = min(1.0, float(max_norm) / (math.sqrt(sum_sq) + 1e-6))
    return float(torch.tensor(coef, dtype=torch.float32))


def geometry(shape, num_heads=1):
    """(batch, rows, cols) of the blocks Newton-Schulz orthogonalizes: [r, c] as num_heads blocks
    of r/H rows, [E, r, c] as E*H blocks, conv [out, in, kh, kw] as [out, in*kh*kw]."""
    h = max(1, int(num_heads))
    if len(shape) == 2:
        return h, shape[0] // h, shape[1]
    if len(shape) == 3:
        return shape[0] * h, shape[1] // h, shape[2]
    if len(shape) == 4:
        return h, shape[0] // h, shape[1] * shape[2] * shape[3]
    raise ValueError(f"a Muon matrix has 2 to 4 dimensions, got shape {list(shape)}")


def scale(mode, rows, cols):
    if mode == "original":
        return math.sqrt(max(1.0, rows / cols))
    if mode == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if mode == "none":
        return 1.0
    raise ValueError(f"unknown scale mode '{mode}' (accepted: {', '.join(SCALE_MODES)})")


def coefficients(method, i, steps):
    if method != "polar_express":
        return STANDARD
    a, b, c = POLAR_EXPRESS[i] if i < len(POLAR_EXPRESS) else POLAR_EXPRESS_TAIL
    if i != steps - 1:
        f = POLAR_EXPRESS_SAFETY
        a, b, c = a / f, b / (f * f * f), c / (f * f * f * f * f)
    return a, b, c


def _direct(x, method, steps):
    for i in range(steps):
        a, b, c = coefficients(method, i, steps)
        gram = torch.bmm(x, x.transpose(1, 2))
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a, alpha=1.0)
    return x


def _gram(x0, method, steps):
    # The polynomial on R = X X^T: P = a I + b R + c R R, Q <- P Q, R <- P R P; X = Q X0 at the
    # end, restarting X0 <- Q X0 after GRAM_RESTART_AFTER iterations.
    r = torch.bmm(x0, x0.transpose(1, 2))
    q = None
    for i in range(steps):
        if i == GRAM_RESTART_AFTER:
            x0 = torch.bmm(q, x0)
            r = torch.bmm(x0, x0.transpose(1, 2))
            q = None
        a, b, c = coefficients(method, i, steps)
        p = torch.baddbmm(r, r, r, beta=b, alpha=c)
        p.diagonal(0, 1, 2).add_(a)
        if i + 1 < steps and i + 1 != GRAM_RESTART_AFTER:
            r = torch.bmm(p, torch.bmm(r, p))
        q = p if q is None else torch.bmm(p, q)
    return torch.bmm(q, x0)


def newton_schulz(blocks, method="standard", steps=5):
    """NS of each [rows, cols] block of a [batch, rows, cols] fp32 tensor (a new tensor)."""
    if method not in NS_METHODS:
        raise ValueError(f"unknown ns_method '{method}' (accepted: {', '.join(NS_METHODS)})")
    transposed = blocks.size(1) > blocks.size(2)
    view = blocks.transpose(1, 2) if transposed else blocks
    k = POLAR_EXPRESS_SAFETY if method == "polar_express" else 1.0
    denom = torch.linalg.vector_norm(view, 2, dim=(1, 2), keepdim=True)
    denom.mul_(k).add_(NORM_EPSILON)
    x = torch.div(view, denom).contiguous()
    if method == "gram" and x.size(1) != x.size(2):
        x = _gram(x, method, steps)
    else:
        x = _direct(x, method, steps)
    return x.transpose(1, 2) if transposed else x


def lerp(start, end, weight):
    """start + weight * (end - start) in fp32, from the nearer end, with one rounding per operation
    (as the daemon computes the EMA; torch.lerp may fuse a multiply-add and round differently)."""
    w = float(torch.tensor(weight, dtype=torch.float32))
    if abs(w) < 0.5:
        return torch.add(start, torch.mul(torch.sub(end, start), w))
    one_minus_w = float(torch.tensor(1.0, dtype=torch.float32) - torch.tensor(w, dtype=torch.float32))
    return torch.sub(end, torch.mul(torch.sub(end, start), one_minus_w))


@torch.no_grad()
def muon_update(grad, momentum, beta=0.95, nesterov=True, ns_method="standard", ns_steps=5,
                scale_mode="original", num_heads=1):
    """One Muon step of a matrix: updates `momentum` (fp32, the gradient's shape) in place and
    returns U in the gradient's dtype and shape (DESIGN.md 3, fp32 compute)."""
    g = grad.detach().to(torch.float32)
    momentum.copy_(lerp(momentum, g, 1.0 - beta))
    u = lerp(g, momentum, beta) if nesterov else momentum.clone()
    batch, rows, cols = geometry(list(grad.shape), num_heads)
    if batch * rows * cols != grad.numel():
        raise ValueError(f"shape {list(grad.shape)} with num_heads {num_heads} is not a Muon matrix")
    u = newton_schulz(u.reshape(batch, rows, cols), ns_method, ns_steps)
    u = torch.mul(u, scale(scale_mode, rows, cols))
    return u.reshape(grad.shape).to(grad.dtype)


class ApplyReference:
    """Apply mode (DESIGN.md 4b) in this process, written apart from MuonWithAuxAdam and muond so
    that a bug shared by the two cannot hide: fp32 master weights kept here, Muon tensors through
    muon_update (M <- lerp(M, G, 1-beta), U as DESIGN.md 3) and W <- W*(1 - lr*wd) - lr*U,
    AdamW tensors through torch.optim.AdamW(foreach=False), one param group per tensor so each
    step's lr and weight_decay come from the tensor's job group. Gradients: divided by the
    gradient divisor, then clipped as torch.nn.utils.clip_grad_norm_ over all tensors when
    max_grad_norm is set.

    tensors: dicts {"name", "param" (initial value, any dtype), "optimizer" ("muon" | "adamw"),
    "group", optional "num_heads"}, in job order. The Muon config as muon_update takes it.
    """

    def __init__(self, tensors, momentum=0.95, nesterov=True, ns_method="standard", ns_steps=5,
                 scale_mode="original", betas=(0.9, 0.95), eps=1e-10, max_grad_norm=None):
        self.tensors = [dict(t) for t in tensors]
        self.masters = [t["param"].detach().to(torch.float32).clone() for t in tensors]
        self.muon = dict(beta=momentum, nesterov=nesterov, ns_method=ns_method,
                         ns_steps=ns_steps, scale_mode=scale_mode)
        self.max_grad_norm = max_grad_norm
        self.momentum = {i: torch.zeros_like(m) for i, (t, m) in
                         enumerate(zip(tensors, self.masters)) if t["optimizer"] == "muon"}
        self._adam_index = [i for i, t in enumerate(tensors) if t["optimizer"] == "adamw"]
        self.adamw = None
        if self._adam_index:
            self.adamw = torch.optim.AdamW(
                [{"params": [self.masters[i]]} for i in self._adam_index], lr=0.0,
                betas=tuple(betas), eps=eps, weight_decay=0.0, foreach=False)
        self.last_grad_norm = None

    @torch.no_grad()
    def step(self, grads, lr, weight_decay, grad_divisor=1.0):
        """One step: `grads` one per tensor (any dtype; None: the tensor has no gradient and is
        skipped, as torch.optim.AdamW skips it: no decay, no state or step count change), `lr`
        and `weight_decay` dicts by group name."""
        g = [None if x is None else torch.div(x.detach().to(torch.float32), float(grad_divisor))
             for x in grads]
        if self.max_grad_norm:
            for master, gi in zip(self.masters, g):
                master.grad = gi
            self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(self.masters,
                                                                       self.max_grad_norm))
            g = [master.grad for master in self.masters]
        for i, m in self.momentum.items():
            if g[i] is None:
                continue
            t = self.tensors[i]
            u = muon_update(g[i], m, num_heads=t.get("num_heads", 1), **self.muon)
            rate, decay = lr[t["group"]], weight_decay[t["group"]]
            w = self.masters[i]
            w.mul_(1.0 - rate * decay)
            w.sub_(torch.mul(u, rate))
        if self.adamw is not None:
            for group, i in zip(self.adamw.param_groups, self._adam_index):
                name = self.tensors[i]["group"]
                group["lr"], group["weight_decay"] = lr[name], weight_decay[name]
                self.masters[i].grad = g[i]
            self.adamw.step()
        for master in self.masters:
            master.grad = None

    def params(self, dtype):
        """The masters in `dtype` (rounded to nearest even, as the trainer's parameters)."""
        return [m.to(dtype) for m in self.masters]

    def state_bytes(self):
        """Bytes of optimizer state this reference holds: masters, momentum, AdamW moments."""
        tensors = list(self.masters) + list(self.momentum.values())
        if self.adamw is not None:
            for state in self.adamw.state.values():
                tensors += [v for v in state.values() if torch.is_tensor(v)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def state_dict(self):
        """The reference's state (masters, momentum, AdamW), for torch.save."""
        return {"masters": [m.clone() for m in self.masters],
                "momentum": {i: m.clone() for i, m in self.momentum.items()},
                "adamw": self.adamw.state_dict() if self.adamw is not None else None}

    def load_state_dict(self, state):
        with torch.no_grad():
            for m, saved in zip(self.masters, state["masters"]):
                m.copy_(saved)
            for i, saved in state["momentum"].items():
                self.momentum[int(i)].copy_(saved)
        if self.adamw is not None:
            self.adamw.load_state_dict(state["adamw"])
