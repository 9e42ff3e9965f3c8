#!/usr/bin/python3
"""How much of the optimizer step stays on the trainer's critical path with muond.

Usage: critical_path_bench.py [--muond PATH] [--lib PATH] [--layers 8] [--hidden 512] [--steps 3]
                              [--warmup 1] [--bucket-bytes N] [--modes update,apply]
                              [--daemon-threads 0]

The trainer is an EMULATED GPU trainer: a GPT-like model (--layers blocks, each with the Muon
matrices q, k, v, o (hidden x hidden), mlp up (4*hidden x hidden) and down (hidden x 4*hidden) and
a norm weight; an embedding (256 x hidden), a final norm and an output head (256 x hidden) on
AdamW), all fp32 CPU tensors. Every block is a torch.autograd.Function whose forward and backward
sleep (time.sleep: the host waits as if for a GPU kernel) and return cheap but real tensors: the
backward hands every weight a fixed random tensor scaled by a scalar of the incoming gradient
(finite, different every step). The host CPU is therefore idle during forward and backward, as
it is on a GPU node.

Calibration (same run): T_opt is the median wall time of step() of the in-process optimizer
(MuonWithAuxAdam(backend="local"): Muon on the hidden matrices, AdamW on the rest) over 3 steps
after 1 warmup step. Backward then sleeps T_opt in total (T_opt / layers per block), forward
T_opt / 2. T_fb is the mean time of forward + backward alone with those sleeps.

Configurations, per mode of --modes ("update", "apply"):
  in-process  backend="local" (the baseline of both modes: apply mode has no local backend);
  sync        muond, stream=False (step() sends the whole step);
  streaming   muond, stream=True, bucket_bytes (default: one block's Muon matrices, so each
              block's gradients leave as they are produced during backward);
  delayed     muond, stream=True, delay=1, delay_warmup=1.
and in apply mode the fp16 recipe through the routes that keep streaming:
  fp16        muond, stream=True, a DynamicLossScaler (the loss scaled by 2^16 before backward,
              the scale sent as the step's divisor while backward streams) and max_grad_norm in
              muond, its threshold twice the largest global gradient norm the emulated trainer
              produces (clipping on, not triggering: steady-state training);
  fp16-clip   the same with a threshold a quarter of the smallest norm: every step clips, so muond
              decides the clip when the step is sealed and recomputes the tensors it computed
              before that with clip 1 (streamed during backward), reported without a target;
and in update mode its clipping route:
  clip        muond, stream=True, max_grad_norm a quarter of the smallest norm (every step clips:
              muond sums the Muon matrices' squares as they stream, adds the AdamW share sent
              with the last part, decides the clip at the seal and recomputes the matrices
              computed before it; step() clips AdamW by the
              returned sum), reported without a target.
Each runs on a fresh copy of the model (same seed): --warmup unmeasured steps, then --steps
measured ones. Step time: from the start of forward to the return of step(); exposed = mean step
time - T_fb, the part of the optimizer the trainer waited for.

Output: a table, then (last lines)
  result: critical_path ratio=<exposed(streaming) / T_opt> target=0.25
  result: delayed ratio=<exposed(delayed) / T_opt> target=0.05
  result: critical_path_fp16 ratio=<exposed(fp16) / T_opt> target=0.10   (with apply mode)
each the worst (largest) over the modes run, clamped at 0. Exit 0 when the run completed (met
targets or not), 1 on errors (then no result lines are printed).
"""
import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
VOCAB = 256
BATCH = 8  # rows of the emulated activations (their size does not matter: nothing is computed)
SEED = 1234
TARGETS = {"critical_path": 0.25, "delayed": 0.05, "critical_path_fp16": 0.10}
CONFIGS = ("in-process", "sync", "streaming", "delayed", "clip", "fp16", "fp16-clip")
APPLY_ONLY = ("fp16", "fp16-clip")
UPDATE_ONLY = ("clip",)
LOSS_SCALE = 2.0 ** 16


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--muond", default=os.path.join(ROOT, "build", "bin", "muond"))
    ap.add_argument("--lib", default=os.path.join(ROOT, "build", "lib", "libmuond_client.so"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3, help="measured steps per configuration")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured steps per configuration")
    ap.add_argument("--bucket-bytes", type=int, default=None,
                    help="streaming bucket size (default: one block's Muon matrices, "
                         "12*hidden*hidden*4 bytes)")
    ap.add_argument("--modes", default="update,apply")
    ap.add_argument("--daemon-threads", type=int, default=0,
                    help="muond --threads (default 0: one per CPU)")
    args = ap.parse_args()
    if args.layers < 6:
        ap.error("--layers must be at least 6")
    if args.hidden < 512:
        ap.error("--hidden must be at least 512")
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    if args.warmup < 0:
        ap.error("--warmup must be at least 0")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("update", "apply") for m in modes):
        ap.error("--modes takes a comma-separated list of 'update' and 'apply'")
    args.modes = list(dict.fromkeys(modes))
    if args.bucket_bytes is None:
        args.bucket_bytes = 12 * args.hidden * args.hidden * 4
    if args.bucket_bytes <= 0:
        ap.error("--bucket-bytes must be positive")
    for path in (args.muond, args.lib):
        if not os.path.exists(path):
            ap.error(f"{path} does not exist (build the project, or pass --muond/--lib)")
    return args


ARGS = parse_args()
os.environ["MUOND_CLIENT_LIB"] = ARGS.lib
sys.path.insert(0, os.path.join(ROOT, "client", "python"))

import torch  # noqa: E402

import muon_offload as mo  # noqa: E402
from muon_offload import MuondError, MuonWithAuxAdam  # noqa: E402

NCPU = os.cpu_count() or 1
torch.set_num_threads(NCPU)


# ----- the emulated GPU trainer -----

class Sleeps:
    """The emulated kernel times (seconds), set by the calibration."""
    fwd = 0.0        # per block
    bwd = 0.0        # per block
    loss_scale = 1.0  # the fp16 recipe's: the emulated gradients carry it, as real ones do


def _gpu(seconds):
    if seconds > 0:
        time.sleep(seconds)


def _grads(bases, g_out):
    # A scalar of the incoming gradient (different every step, since the input is) times a fixed
    # random tensor per weight: real, finite gradients that cost the host next to nothing.
    s = (1.0 + torch.tanh(g_out.sum() / Sleeps.loss_scale)) * Sleeps.loss_scale
    return tuple(b * s for b in bases)


class Embed(torch.autograd.Function):
    """x = x0 + tiny(embedding); backward: the embedding's gradient (no sleep: AdamW part)."""

    @staticmethod
    def forward(ctx, x0, emb, base):
        ctx.base = base
        return x0 + 1e-6 * emb[0, 0]

    @staticmethod
    def backward(ctx, g_out):
        return None, _grads((ctx.base,), g_out)[0], None


class Block(torch.autograd.Function):
    """One transformer block: forward and backward sleep like GPU kernels; the forward output
    depends on every weight (so autograd reaches each), the backward returns a gradient for each."""

    @staticmethod
    def forward(ctx, x, bases, *weights):
        _gpu(Sleeps.fwd)
        ctx.bases = bases
        tiny = weights[0][0, 0]
        for w in weights[1:]:
            tiny = tiny + w.view(-1)[0]
        return x + 1e-6 * tiny

    @staticmethod
    def backward(ctx, g_out):
        _gpu(Sleeps.bwd)
        return (g_out, None) + _grads(ctx.bases, g_out)


class Head(torch.autograd.Function):
    """Final norm and output head (AdamW part, no sleep)."""

    @staticmethod
    def forward(ctx, x, bases, norm, head):
        ctx.bases = bases
        return x + 1e-6 * (norm[0] + head[0, 0])

    @staticmethod
    def backward(ctx, g_out):
        return (g_out, None) + _grads(ctx.bases, g_out)


BLOCK_NAMES = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.up", "mlp.down", "norm")


def block_shapes(h):
    return ((h, h), (h, h), (h, h), (h, h), (4 * h, h), (h, 4 * h), (h,))


class Model:
    """The parameters ((name, tensor) lists per optimizer group) and the fixed gradient bases."""

    def __init__(self, layers, hidden, bases=None):
        gen = torch.Generator().manual_seed(SEED)
        self.hidden = hidden
        self.muon, self.adam = [], []

        def param(name, shape, muon, scale):
            t = (torch.randn(shape, generator=gen) * scale).requires_grad_()
            (self.muon if muon else self.adam).append((name, t))
            return t

        self.emb = param("embed", (VOCAB, hidden), False, 0.02)
        self.blocks = []
        for i in range(layers):
            ws = []
            for name, shape in zip(BLOCK_NAMES, block_shapes(hidden)):
                if len(shape) == 1:  # the block's norm weight (AdamW)
                    w = param(f"block{i}.{name}", shape, False, 0.0)
                    with torch.no_grad():
                        w.fill_(1.0)
                else:
                    w = param(f"block{i}.{name}", shape, True, hidden ** -0.5)
                ws.append(w)
            self.blocks.append(ws)
        self.norm = param("norm_f", (hidden,), False, 0.0)
        with torch.no_grad():
            self.norm.fill_(1.0)
        self.head = param("head", (VOCAB, hidden), False, 0.02)
        if bases is None:
            bgen = torch.Generator().manual_seed(SEED + 1)
            bases = {n: torch.randn(t.shape, generator=bgen) * 1e-2
                     for n, t in self.muon + self.adam}
        self.bases = bases
        self._block_bases = [tuple(bases[f"block{i}.{n}"] for n in BLOCK_NAMES)
                             for i in range(layers)]
        self._head_bases = (bases["norm_f"], bases["head"])

    def groups(self):
        return [dict(params=list(self.muon), use_muon=True, lr=0.02, weight_decay=0.01),
                dict(params=list(self.adam), use_muon=False, lr=3e-4, weight_decay=0.0)]

    def forward_backward(self, step, loss_scale=1.0):
        x0 = torch.randn((BATCH, self.hidden), generator=torch.Generator().manual_seed(step))
        x = Embed.apply(x0, self.emb, self.bases["embed"])
        for ws, bases in zip(self.blocks, self._block_bases):
            x = Block.apply(x, bases, *ws)
        y = Head.apply(x, self._head_bases, self.norm, self.head)
        loss = (y * y).mean()
        (loss * loss_scale).backward()  # the fp16 recipe's scaled loss (1: the others)
        return loss


# ----- the daemon -----

class Daemon:
    def __init__(self, muond, threads):
        self.tmp = tempfile.TemporaryDirectory(prefix="muond-critical-path-")
        self.address = f"unix://{self.tmp.name}/muond.sock"
        self.log_path = os.path.join(self.tmp.name, "muond.log")
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [muond, "--listen", self.address, "--state-dir", os.path.join(self.tmp.name, "state"),
             "--threads", str(threads), "--metrics-address", "off"], stderr=self.log)
        deadline = time.time() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"muond exited {self.proc.returncode}:\n{self.read_log()}")
            try:
                with mo.Client(self.address) as c:
                    c.health(0.5)
                return
            except MuondError:
                if time.time() > deadline:
                    self.proc.kill()
                    self.proc.wait()
                    raise RuntimeError(f"muond did not become healthy:\n{self.read_log()}")
                time.sleep(0.1)

    def read_log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self):
        """SIGTERM; returns muond's exit code."""
        code = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        else:
            code = self.proc.returncode
        self.log.close()
        return code

    def cleanup(self):
        self.tmp.cleanup()


# ----- measurements -----

def grad_norm_bounds(model):
    """The smallest and largest global norm of the emulated (unscaled) gradients: each is its
    base times 1 + tanh(x), in (0, 2) times the bases' norm."""
    norm = sum(float(b.double().square().sum()) for b in model.bases.values()) ** 0.5
    return 0.0, 2.0 * norm


def skipped(config, mode):
    """Configurations of one mode only."""
    return (config in APPLY_ONLY and mode != "apply") or (config in UPDATE_ONLY and
                                                          mode != "update")


def make_optimizer(model, config, mode, address, bucket_bytes):
    groups = model.groups()
    if config == "in-process":
        return MuonWithAuxAdam(groups, backend="local")
    kw = dict(address=address, mode=mode, compute_dtype="float32", bucket_bytes=bucket_bytes)
    if config in APPLY_ONLY:
        _, high = grad_norm_bounds(model)
        # Every step's gradient has 1 + tanh(x) >= 1 - tanh(|x|) > 0.5 of the bases' norm here
        # (|x| small: the loss's gradient is tiny), so a quarter of it clips every step.
        clip = 2.0 * high if config == "fp16" else 0.25 * high / 2.0
        return MuonWithAuxAdam(groups, stream=True, max_grad_norm=clip,
                               loss_scaler=mo.DynamicLossScaler(init_scale=LOSS_SCALE), **kw)
    if config == "clip":
        _, high = grad_norm_bounds(model)
        return MuonWithAuxAdam(groups, stream=True, max_grad_norm=0.25 * high / 2.0, **kw)
    if config == "sync":
        return MuonWithAuxAdam(groups, stream=False, **kw)
    if config == "streaming":
        return MuonWithAuxAdam(groups, stream=True, **kw)
    return MuonWithAuxAdam(groups, stream=True, delay=1, delay_warmup=1, **kw)


def calibrate(args):
    """T_opt: the median step() time of the in-process optimizer (1 warmup + 3 measured steps)
    with real gradients; no sleeps."""
    Sleeps.fwd = Sleeps.bwd = 0.0
    model = Model(args.layers, args.hidden)
    opt = MuonWithAuxAdam(model.groups(), backend="local")
    times = []
    for i in range(4):
        opt.zero_grad()
        model.forward_backward(10_000 + i)
        t0 = time.perf_counter()
        opt.step()
        if i >= 1:
            times.append(time.perf_counter() - t0)
    opt.close()
    return statistics.median(times), model.bases


def measure_fb(args, bases):
    """T_fb: mean forward + backward time (the sleeps set), no optimizer step."""
    model = Model(args.layers, args.hidden, bases)
    opt = MuonWithAuxAdam(model.groups(), backend="local")  # for zero_grad only
    times = []
    for i in range(args.warmup + args.steps):
        opt.zero_grad()
        t0 = time.perf_counter()
        model.forward_backward(i)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    opt.close()
    return statistics.mean(times)


def run_config(args, bases, config, mode, address):
    """Mean step time (forward start to step() return) over the measured steps."""
    model = Model(args.layers, args.hidden, bases)
    opt = make_optimizer(model, config, mode, address, args.bucket_bytes)
    Sleeps.loss_scale = LOSS_SCALE if config in APPLY_ONLY else 1.0
    stats = {"fallbacks": 0, "skipped": 0}
    try:
        times = []
        for i in range(args.warmup + args.steps):
            opt.zero_grad()
            t0 = time.perf_counter()
            model.forward_backward(i, Sleeps.loss_scale)
            opt.step()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
            stats["skipped"] += int(opt.last_step_skipped)
        if config == "delayed":
            opt.drain()  # not timed
        for _, p in model.muon + model.adam:
            if not torch.isfinite(p).all():
                raise RuntimeError(f"{config}/{mode}: non-finite parameters after the steps")
        stats["fallbacks"] = getattr(opt, "stream_fallbacks", 0)
        if config in APPLY_ONLY and (stats["fallbacks"] or stats["skipped"]):
            raise RuntimeError(f"{config}/{mode}: {stats['fallbacks']} step(s) fell back to a "
                               f"whole send, {stats['skipped']} skipped: the recipe's routes "
                               "must keep every step streamed")
    finally:
        opt.close(delete_job=True)
        Sleeps.loss_scale = 1.0
    return statistics.mean(times)


def main():
    args = ARGS
    errors = []
    started = time.perf_counter()
    t_opt, bases = calibrate(args)
    Sleeps.bwd = t_opt / args.layers
    Sleeps.fwd = t_opt / (2 * args.layers)
    t_fb = measure_fb(args, bases)
    print(f"critical_path_bench: layers={args.layers} hidden={args.hidden} steps={args.steps} "
          f"warmup={args.warmup} bucket_bytes={args.bucket_bytes} modes={','.join(args.modes)} "
          f"cpus={NCPU} daemon_threads={args.daemon_threads}")
    print(f"T_opt (in-process optimizer step, median) = {t_opt:.3f} s")
    print(f"emulated GPU: forward {Sleeps.fwd * args.layers:.3f} s "
          f"({Sleeps.fwd * 1e3:.1f} ms/block), backward {Sleeps.bwd * args.layers:.3f} s "
          f"({Sleeps.bwd * 1e3:.1f} ms/block)")
    print(f"T_fb (forward + backward, no step, mean) = {t_fb:.3f} s")
    sys.stdout.flush()

    results = {}  # (mode, config) -> mean step seconds, or None on error
    daemon = Daemon(args.muond, args.daemon_threads)
    daemon_code = None
    try:
        baseline = None
        for mode in args.modes:
            for config in CONFIGS:
                if skipped(config, mode):
                    continue
                if config == "in-process" and baseline is not None:
                    results[(mode, config)] = baseline  # the same local optimizer
                    continue
                try:
                    results[(mode, config)] = run_config(args, bases, config, mode,
                                                         daemon.address)
                    if config == "in-process":
                        baseline = results[(mode, config)]
                except Exception:  # noqa: BLE001 - reported, the run goes on
                    results[(mode, config)] = None
                    errors.append((mode, config, traceback.format_exc()))
    finally:
        daemon_code = daemon.stop()
        if errors or daemon_code != 0:
            log = daemon.read_log()
            sys.stderr.write("----- muond log (tail) -----\n" + log[-8000:] + "\n")
        daemon.cleanup()

    print()
    print(f"{'mode':<8} {'configuration':<12} {'step s':>8} {'exposed s':>10} "
          f"{'exposed/T_opt':>14}")
    for mode in args.modes:
        for config in CONFIGS:
            if skipped(config, mode):
                continue
            step = results.get((mode, config))
            if step is None:
                print(f"{mode:<8} {config:<12} {'ERROR':>8}")
                continue
            exposed = step - t_fb
            note = "  (local baseline)" if config == "in-process" else ""
            print(f"{mode:<8} {config:<12} {step:8.3f} {exposed:10.3f} "
                  f"{exposed / t_opt:14.3f}{note}")
    print(f"T_opt = {t_opt:.3f} s, T_fb = {t_fb:.3f} s, wall {time.perf_counter() - started:.0f} s")
    for mode, config, tb in errors:
        sys.stderr.write(f"----- {mode}/{config} failed -----\n{tb}\n")
    if daemon_code != 0:
        sys.stderr.write(f"muond exited {daemon_code} on SIGTERM (expected 0)\n")
    if errors or daemon_code != 0:
        print("critical_path_bench: FAILED (see stderr)")
        return 1

    def worst(config):
        r = max((results[(m, config)] - t_fb) / t_opt for m in args.modes)
        return max(r, 0.0)

    print(f"note: the daemon and the emulated GPU trainer share this host's {NCPU} cores; "
          "on a GPU node the trainer's compute does not use them")
    print(f"result: critical_path ratio={worst('streaming'):.3f} "
          f"target={TARGETS['critical_path']}")
    print(f"result: delayed ratio={worst('delayed'):.3f} target={TARGETS['delayed']}")
    if "apply" in args.modes:
        fp16 = max((results[("apply", "fp16")] - t_fb) / t_opt, 0.0)
        print(f"result: critical_path_fp16 ratio={fp16:.3f} "
              f"target={TARGETS['critical_path_fp16']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
