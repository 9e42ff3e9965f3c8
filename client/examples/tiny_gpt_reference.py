"""What train_tiny_gpt.py compares against: apply mode's in-process reference (ApplyModeReference,
independent of MuonWithAuxAdam), and the optimizer-state bytes each side holds (the trainer's
optimizers, the reference's, and muond's JobStatus momentum_bytes through `muonctl status --json`)."""
import json
import os
import shutil
import subprocess

import torch
import torch.distributed as dist

import muon_offload
from rounding_bound import parameter_norm

HERE = os.path.dirname(os.path.abspath(__file__))
ADAM_BETAS, ADAM_EPS = (0.9, 0.95), 1e-10


class ApplyModeReference:
    """The in-process reference of apply mode, independent of MuonWithAuxAdam: the trainer's
    gradients (`trainer`: its parameters in job order) gathered over the ranks and summed in rank
    order (as an all-reduce in the parameters' dtype), divided by the world size, then
    muon_offload.reference.ApplyReference (fp32 masters, torch.optim.AdamW(foreach=False), the
    reference Muon math); the reference model's parameters are set from masters.to(param dtype)."""

    def __init__(self, groups, trainer, max_grad_norm):
        self.trainer = trainer
        self.params, tensors = [], []
        for i, group in enumerate(groups):
            kind = "muon" if group["use_muon"] else "adamw"
            for name, p in group["params"]:
                self.params.append(p)
                tensors.append({"name": name, "param": p, "optimizer": kind, "group": f"g{i}"})
        self.lr = {f"g{i}": g["lr"] for i, g in enumerate(groups)}
        self.wd = {f"g{i}": g["weight_decay"] for i, g in enumerate(groups)}
        self.ref = muon_offload.ApplyReference(tensors, betas=ADAM_BETAS, eps=ADAM_EPS,
                                               max_grad_norm=max_grad_norm)

    @torch.no_grad()
    def step(self, factor, world):
        """Steps from the trainer's gradients; before its optimizer steps, so at the parameters w
        the trainer's loss was computed at. Returns |g w|_2 of the rounding bound."""
        flat = torch.cat([p.grad.float().reshape(-1) for p in self.trainer])  # exact
        every = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(every, flat)
        dtype = self.params[0].dtype
        total = every[0].to(dtype)
        for other in every[1:]:
            total.add_(other.to(dtype))
        grads, at = [], 0
        for p in self.params:
            grads.append(total[at:at + p.numel()].view(p.shape))
            at += p.numel()
        sensitivity = parameter_norm(self.trainer, total, world)
        self.ref.step(grads, {k: v * factor for k, v in self.lr.items()}, self.wd,
                      grad_divisor=world)
        for p, m in zip(self.params, self.ref.params(dtype)):
            p.copy_(m)
        return sensitivity

    @torch.no_grad()
    def qk_clip(self, pairs, threshold, alpha, max_logits):
        """QK-Clip (DESIGN.md 4e) of the reference's masters, written here from the formula:
        `pairs` [(q, k, heads)] of the reference model's parameters, `max_logits` per pair the
        step's per-head maxima over the ranks."""
        index = {id(p): i for i, p in enumerate(self.params)}
        for (q, k, heads), s in zip(pairs, max_logits):
            s = s.double()
            gamma = torch.where(s > threshold, threshold / s, torch.ones_like(s))
            rows = q.shape[0] // heads
            for w, factor in ((q, gamma ** alpha), (k, gamma ** (1 - alpha))):
                m = self.ref.masters[index[id(w)]]
                m.copy_((m.double() * factor.repeat_interleave(rows)[:, None]).float())
                w.copy_(m.to(w.dtype))

    def state_dict(self):
        return self.ref.state_dict()

    def load_state_dict(self, state):
        self.ref.load_state_dict(state)


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def optimizer_state_bytes(opt):
    """Bytes of the tensors a torch optimizer keeps in its state (AdamW moments, momentum)."""
    return sum(tensor_bytes(state.values()) for state in opt.state.values())


def daemon_job_bytes(args, job_id):
    """JobStatus momentum_bytes of the job, through `muonctl status --json` (None when muonctl
    cannot say)."""
    muonctl = args.muonctl or os.path.join(HERE, "..", "..", "build", "bin", "muonctl")
    if not os.path.exists(muonctl):
        muonctl = shutil.which("muonctl")
    if not muonctl:
        return None
    cmd = [muonctl] + (["--address", args.address] if args.address else []) + \
        ["status", "--json", "--metrics-address", "off"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for job in json.loads(out).get("jobs", []):
        if job.get("job_id") == job_id:
            return int(job["momentum_bytes"])
    return None


def state_bytes_report(opt, opt_ref, args, rank):
    """Optimizer-state bytes in this trainer process (both optimizers) and in muond."""
    out = {"mode": args.mode, "trainer_optimizer_state_bytes": optimizer_state_bytes(opt),
           "trainer_param_bytes": tensor_bytes([p for g in opt.param_groups
                                                for p in g["params"]]),
           "daemon_job_bytes": daemon_job_bytes(args, opt.job_id) if rank == 0 else None}
    if args.mode == "apply":
        out["trainer_workspace_bytes"] = opt.offload.workspace_bytes() if opt.offload else 0
        out["reference_state_bytes"] = opt_ref.ref.state_bytes()
    else:
        out["reference_state_bytes"] = optimizer_state_bytes(opt_ref)
    return out


def print_state_bytes(report):
    mode = report["mode"]
    daemon = report["daemon_job_bytes"]
    print(f"optimizer state, mode {mode}: trainer process {report['trainer_optimizer_state_bytes']} "
          "bytes (" + ("AdamW moments of the non-Muon parameters; the momentum is in muond"
                       if mode == "update" else "none: masters, momentum and AdamW are in muond")
          + f"); parameters {report['trainer_param_bytes']} bytes", flush=True)
    if mode == "apply":
        print(f"  trainer staging buffers (per step, no state): "
              f"{report['trainer_workspace_bytes']} bytes", flush=True)
    print(f"  in-process reference (everything in the trainer): {report['reference_state_bytes']} "
          "bytes", flush=True)
    print("  muond JobStatus momentum_bytes: " +
          (f"{daemon} bytes" if daemon is not None else "unknown (muonctl not found)"),
          flush=True)
