#!/usr/bin/python3
"""Trains a small character-level GPT with Muon through muond, next to the same training with an
in-process Muon, and compares the two.

The model (2 transformer blocks, d=128) learns the GNU GPL v3 text that Debian ships in
/usr/share/common-licenses. Two ranks (processes) run torch.distributed with gloo; each gets its own
batches, the gradients are averaged, and the Muon matrices are split ZeRO-2 style (--zero-stage): each rank pushes
only its partition of the gradient buffer to muond (through shared memory when the daemon is on
this host), applies the update muond returns to its partition, and the ranks all-gather the new
weights. Embeddings, the output head and the layer norms use AdamW in-process.

Side by side, each rank trains a copy of the same model, from the same weights and on the same
batches, with backend="local": the Muon math of DESIGN.md section 3 in PyTorch. The script prints
both losses per step and the largest difference, and writes a plot of the two loss curves.

--mode apply (DESIGN.md 4b) offloads the whole optimizer: muond holds the fp32 master weights, the
Muon momentum and the AdamW state of every parameter, the ranks reduce-scatter their gradients into
it and get new parameters back (--param-dtype float32, bfloat16 or float16 in the model); the
trainer holds no optimizer state. The side-by-side reference is then written apart from the
optimizer: muon_offload.reference.ApplyReference (torch.optim.AdamW plus the reference Muon math on
fp32 masters of its own), whose masters set the reference model's parameters (.to(param dtype)).
It steps with the trainer's gradients, taken at the parameters muond returned, so each step starts
from the same state and nothing compounds through the loss. With bf16 or fp16 parameters, each
step's loss difference is held to a first-order bound on what rounding explains (rounding_bound.py
derives it).
Both modes print, at the end, the optimizer-state bytes held in the trainer process and by muond
(JobStatus momentum_bytes through `muonctl status --json`).

Usage: train_tiny_gpt.py [--steps N] [--address ADDR] [--plot PNG] [--json OUT]
         [--mode update|apply] [--param-dtype float32|bfloat16|float16] [--max-grad-norm X]
         [--save-at N --checkpoint DIR] [--stop-after N] [--resume DIR]
         [--inject-nonfinite-at N] [--muonctl PATH] [--node-addresses A0,A1]
         [--qk-clip TAU] [--qk-lr-mult X]
         [--momentum-dtype float32|bfloat16|int8] [--adamw-state-dtype float32|bfloat16|int8]
--save-at writes a trainer checkpoint after N steps (models, AdamW state, and a muond checkpoint
generation of the job); --resume continues from one (also after a daemon restart).
--inject-nonfinite-at puts a NaN into rank 1's gradient at step N, shows muond refusing the step,
and recomputes the gradients: the trajectory is unchanged.
--qk-clip TAU (apply mode) gives each block separate query and key projections, names them as
muond's QK-Clip pairs (DESIGN.md 4e) and sends each step's largest attention logit per head; muond
rescales the heads over TAU on its masters, and the reference does the same to its own. Each
step's largest logit (over heads, blocks and ranks) is printed, and at the end the largest logit
of a step's batch at the parameters the step returned; --qk-lr-mult X raises the query and key
projections' lr to make the logits grow (without --qk-clip they then run away).
--delay 1 runs muond's one-step delayed update (after --delay-warmup synchronous steps, default
10), with the next forward on predicted parameters (--no-predict: on the installed ones); the
in-process reference stays synchronous, and the loss at the end (the mean of the last 10 steps'
losses: one batch's loss swings by several percent from step to step) must be within 3% of its.
--momentum-dtype bfloat16 or int8 (and, in apply mode, --adamw-state-dtype) has muond hold that
state compressed (README "Memory"); the reference keeps fp32 state, so the two trajectories part,
and the loss at the end (the mean of the last 10 steps' losses) must be within 2% of the
reference's.
Every run prints the optimizer's exposed time per step (muond's step(), after gradients streamed
during backward) beside the in-process optimizer's.
Exit status: 0 when both trainings ran, the loss went down and every step's loss difference is
within its bound (apply mode, bf16 or fp16 parameters; with --delay 1 the losses at the end
within 3%, with compressed state within 2%); 1 otherwise.
"""
import argparse
import contextlib
import copy
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
from muon_offload import MuondError, MultiNodeMuonWithAuxAdam, MuonWithAuxAdam  # noqa: E402
# Beside this file: Python puts a script's own directory on sys.path, whatever the cwd.
from rounding_bound import RoundingRecord, bound_factor, bound_verdict  # noqa: E402
# The model and data, and the reference and state accounting, beside this file.
from tiny_gpt_model import TinyGPT, batch, load_text, param_groups  # noqa: E402
from tiny_gpt_reference import (ApplyModeReference, print_state_bytes,  # noqa: E402
                                state_bytes_report)


def global_mean(value, world):
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / world


def checkpoint_path(directory, rank):
    return os.path.join(directory, f"rank{rank}.pt")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


STATE_DTYPES = ("float32", "bfloat16", "int8")
END_STEPS = 10  # --delay 1: the loss at the end is the mean of the last END_STEPS steps' losses


def end_loss(losses):
    tail = losses[-END_STEPS:]
    return sum(tail) / len(tail)


def lr_factor(step, steps):
    """The LR schedule of apply mode (a LambdaLR on the muond optimizer, recomputed on its own by
    the reference): linear decay to 10%."""
    return 1.0 - 0.9 * step / max(1, steps)


def make_optimizers(model, reference, args, job_id=None, token=None):
    """(muond optimizer, side-by-side reference, LR scheduler or None); job_id/token: of the job
    a resumed trainer attaches to."""
    groups = (args.muon_lr, args.adam_lr, args.weight_decay)
    job = dict(address=args.address or None, job_id=job_id or args.job_id, token=token,
               transport=args.transport, zero_stage=args.zero_stage)
    if args.delay:
        job.update(delay=args.delay, delay_warmup=args.delay_warmup, predict=not args.no_predict)
    if args.momentum_dtype != "float32":
        job["momentum_dtype"] = args.momentum_dtype
    if args.adamw_state_dtype != "float32":
        job["adamw_state_dtype"] = args.adamw_state_dtype
    optimizer = MuonWithAuxAdam
    if args.node_addresses:  # one daemon per (emulated) node, rank r on node r (DESIGN.md 4c)
        addresses = args.node_addresses.split(",")
        job.update(address=addresses[dist.get_rank()], node_map=list(range(len(addresses))))
        optimizer = MultiNodeMuonWithAuxAdam
    if args.mode == "update":
        opt = optimizer(param_groups(model, *groups), **job)
        return opt, MuonWithAuxAdam(param_groups(reference, *groups), backend="local"), None
    job.update(mode="apply", max_grad_norm=args.max_grad_norm)
    groups = groups + (args.qk_lr_mult,)
    if args.qk_clip is not None:  # every block's attention is a pair (MHA: kv_heads = q_heads)
        job["qk_clip"] = {"threshold": args.qk_clip, "alpha": QK_ALPHA, "pairs": [
            {"q": b.q.weight, "k": b.k.weight, "q_heads": b.heads, "kv_heads": b.heads,
             "head_dim": b.q.weight.shape[0] // b.heads} for b in model.blocks]}
    opt = optimizer(param_groups(model, *groups), **job)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args.steps))
    trainer = [p for g in param_groups(model, *groups) for _, p in g["params"]]
    ref = ApplyModeReference(param_groups(reference, *groups), trainer, args.max_grad_norm)
    return opt, ref, scheduler


# --qk-clip / --qk-lr-mult: per step, the largest attention logit of any head over the ranks, seen
# in the step's forward (before the step's update and clip).
MAX_LOGITS = []
# ... and the same batch's at the parameters the step returned (after muond's clip).
MAX_LOGITS_AFTER = []
QK_ALPHA = 0.5

# Seconds each step() took, per optimizer: muond's is what the trainer waits for after backward
# (the gradients streamed during backward; with --delay 1 the update itself runs during the next
# forward and backward), the in-process optimizer's is all of its work.
STEP_SECONDS = {"muond": [], "in-process": []}


def train_step(step, model, reference, opt, opt_ref, scheduler, x, y, rank, world, args,
               refusals):
    """One step of both; returns their losses (means over the ranks) and, in apply mode with bf16
    or fp16 parameters, |c|_2 + |g w|_2 of the rounding bound."""
    apply = args.mode == "apply"
    if apply:  # the reference's loss at its own parameters; it steps with the trainer's gradients
        with torch.no_grad():
            ref_loss = reference(x, y)
    bounded = apply and args.param_dtype != "float32"
    record = RoundingRecord(DTYPES[args.param_dtype]) if bounded else contextlib.nullcontext()
    opt.zero_grad()
    with record:
        loss = model(x, y)
    if args.qk_clip is not None:  # this rank's maxima; muond takes the maximum over the ranks
        opt.set_max_logits({b.q.weight: b.max_logits for b in model.blocks})
    loss.backward()
    activations = record.norm(world) if bounded else 0.0
    if step == args.inject_nonfinite_at:
        # A poisoned gradient on one rank: muond refuses the step for the whole job and nothing
        # changes; the gradients are computed again and the step retried.
        if rank == 1:
            opt.param_groups[0]["params"][0].grad[0, 0] = float("nan")
        try:
            opt.step()
            raise RuntimeError("muond accepted a non-finite gradient")
        except MuondError as e:
            refusals.append({"step": step, "code": e.code, "code_name": e.code_name,
                             "message": e.message})
            if rank == 0:
                print(f"  step {step}: refused as expected: {e}", flush=True)
        opt.zero_grad()
        model(x, y).backward()
    max_logits = None
    if model.blocks[0].split_qk:  # the step's per-head maxima over the ranks, per block
        max_logits = torch.stack([b.max_logits for b in model.blocks])
        dist.all_reduce(max_logits, op=dist.ReduceOp.MAX)
        MAX_LOGITS.append(max_logits.max().item())
    t = time.perf_counter()
    params = opt_ref.step(lr_factor(step, args.steps), world) if apply else 0.0
    if args.qk_clip is not None:
        opt_ref.qk_clip([(b.q.weight, b.k.weight, b.heads) for b in reference.blocks],
                        args.qk_clip, QK_ALPHA, max_logits)
    ref_seconds = time.perf_counter() - t
    t = time.perf_counter()
    opt.step()
    STEP_SECONDS["muond"].append(time.perf_counter() - t)
    if model.blocks[0].split_qk:
        # The same batch's largest logit at the parameters muond returned (after its clip).
        with torch.no_grad():
            model(x, y)
        after = torch.stack([b.max_logits for b in model.blocks])
        dist.all_reduce(after, op=dist.ReduceOp.MAX)
        MAX_LOGITS_AFTER.append(after.max().item())
    if scheduler is not None:
        scheduler.step()
    if not apply:
        opt_ref.zero_grad()
        ref_loss = reference(x, y)
        ref_loss.backward()
        t = time.perf_counter()
        opt_ref.step()
        ref_seconds = time.perf_counter() - t
    STEP_SECONDS["in-process"].append(ref_seconds)
    return global_mean(loss.float().item(), world), global_mean(ref_loss.float().item(), world), \
        activations + params if bounded else None


def print_header(opt, model, args, world, start, eps):
    """Rank 0: what the job is, and the header of the per-step table."""
    tensors = opt.spec.get("matrices") or opt.spec["tensors"]
    what = (f"{len(tensors)} Muon matrices" if args.mode == "update" else
            f"mode apply: all {len(tensors)} parameters "
            f"({sum(t['optimizer'] == 'muon' for t in tensors)} Muon) in {args.param_dtype}, "
            "masters and optimizer state in muond")
    print(f"muond job '{opt.job_id}': {world} ranks, ZeRO stage {opt.zero_stage}, {what}, "
          f"{'shared memory' if opt.session.is_shm else 'gRPC'}, "
          f"rank 0 owns {opt.partition.buffer_elements} elements; starts at step {start}",
          flush=True)
    ref_name = "in-process" if args.mode == "update" else "reference"
    print(f"{'step':>5} {'loss (muond)':>14} {'loss (' + ref_name + ')':>18} {'|diff|':>10}"
          + (f" {'bound':>10}" if eps is not None else "")
          + (f" {'max logit':>10}" if model.blocks[0].split_qk else ""), flush=True)


def save_state(model, reference, opt, opt_ref, losses, ref_losses, step, args, rank):
    """--save-at: this rank's training state after `step`, with a durable muond generation
    (which opt.state_dict() refers to)."""
    opt.save_checkpoint()
    state = {"model": model.state_dict(), "reference": reference.state_dict(),
             "optimizer": opt.state_dict(), "reference_optimizer": opt_ref.state_dict(),
             "losses": losses, "ref_losses": ref_losses, "step": step + 1,
             "job_id": opt.job_id, "token": opt.token}
    os.makedirs(args.checkpoint, exist_ok=True)
    torch.save(state, checkpoint_path(args.checkpoint, rank))
    if rank == 0:
        m = state["optimizer"]["muond"]
        print(f"  checkpoint after step {step}: {args.checkpoint} (muond generation "
              f"{m['generation']}, next step {m['next_step']})", flush=True)


def print_timing(exposed, losses, ref_losses, args):
    """Rank 0: the optimizer time each step exposed, and with --delay the loss at the end."""
    print(f"optimizer time per step after backward: muond step() {exposed['muond'] * 1e3:.1f} "
          f"ms exposed (gradients streamed during backward"
          f"{', update delayed one step' if args.delay else ''}), in-process optimizer "
          f"{exposed['in-process'] * 1e3:.1f} ms", flush=True)
    if args.delay:
        final, sync = end_loss(losses), end_loss(ref_losses)
        what = ("synchronous in-process run" if args.mode == "update" else
                "reference (apply mode: stepped with the trainer's delayed gradients, so "
                "this compares the masters, not a synchronous run)")
        print(f"loss at the end (mean of the last {min(END_STEPS, len(losses))} steps) with "
              f"--delay 1{'' if args.no_predict else ' and prediction'}: {final:.6f}, "
              f"{what}: {sync:.6f} ({abs(final - sync) / abs(sync) * 100:.2f}% apart; "
              f"target 3%); last step alone: {losses[-1]:.6f} vs {ref_losses[-1]:.6f}",
              flush=True)


def run_rank(rank, world, args, store_path, result_path):
    torch.set_num_threads(1)  # two ranks and the daemon share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world)
    data, vocab = load_text()
    torch.manual_seed(args.seed)
    model = TinyGPT(vocab, d=args.d, layers=args.layers, block_size=args.block_size,
                    split_qk=args.qk_clip is not None or args.qk_lr_mult != 1.0)
    model.to(DTYPES[args.param_dtype])
    reference = copy.deepcopy(model)
    resume = torch.load(checkpoint_path(args.resume, rank)) if args.resume else None
    if resume:
        model.load_state_dict(resume["model"])
        reference.load_state_dict(resume["reference"])
    opt, opt_ref, scheduler = make_optimizers(model, reference, args,
                                              *((resume["job_id"], resume["token"]) if resume
                                                else ()))
    losses, ref_losses, bounds, start = [], [], [], 0
    # The per-step bound of apply mode (rounding_bound.py): 2 lambda u (|c|_2 + |g w|_2).
    eps = (bound_factor(DTYPES[args.param_dtype], args.bound_scale)
           if args.mode == "apply" and args.param_dtype != "float32" else None)
    if resume:
        opt.load_state_dict(resume["optimizer"])
        opt_ref.load_state_dict(resume["reference_optimizer"])
        losses, ref_losses, start = resume["losses"], resume["ref_losses"], resume["step"]
        if scheduler is not None:
            scheduler.last_epoch = start - 1
            scheduler.step()
    if rank == 0:
        print_header(opt, model, args, world, start, eps)
    refusals = []
    t0 = time.time()
    for step in range(start, args.steps):
        x, y = batch(data, step, rank, args.batch_size, args.block_size, args.seed)
        loss, ref_loss, sensitivity = train_step(step, model, reference, opt, opt_ref, scheduler,
                                                 x, y, rank, world, args, refusals)
        losses.append(loss)
        ref_losses.append(ref_loss)
        bounds.append(eps * sensitivity if eps is not None else None)
        if rank == 0:
            print(f"{step:>5} {loss:>14.6f} {ref_loss:>18.6f} {abs(loss - ref_loss):>10.2e}"
                  + (f" {bounds[-1]:>10.2e}" if eps is not None else "")
                  + (f" {MAX_LOGITS[-1]:>10.3f}" if MAX_LOGITS else ""), flush=True)
        if args.save_at is not None and step + 1 == args.save_at:
            save_state(model, reference, opt, opt_ref, losses, ref_losses, step, args, rank)
        if args.stop_after is not None and step + 1 == args.stop_after:
            break
    seconds = time.time() - t0
    opt.drain()  # --delay 1: the last step's parameters in place before the report
    timed = {k: v[1:] or v for k, v in STEP_SECONDS.items()}  # the first step sets things up
    exposed = {k: sum(v) / len(v) if v else 0.0 for k, v in timed.items()}
    if rank == 0 and losses:
        print_timing(exposed, losses, ref_losses, args)
    report = state_bytes_report(opt, opt_ref, args, rank)
    if rank == 0:
        print_state_bytes(report)
    finished = args.stop_after is None or args.stop_after >= args.steps
    opt.close(delete_job=finished and not args.keep_job)
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump({"losses": losses, "ref_losses": ref_losses, "bounds": bounds,
                       "start": start, "job_id": opt.job_id, "refusals": refusals,
                       "seconds": seconds, "steps_run": len(losses) - start,
                       "exposed_seconds": exposed, "max_logits": MAX_LOGITS,
                       "max_logits_after": MAX_LOGITS_AFTER,
                       "state_bytes": report}, f)
    dist.destroy_process_group()


def plot(losses, ref_losses, path, mode="update"):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    ref_label = "in-process Muon" if mode == "update" else "in-process reference (fp32 masters)"
    ax.plot(range(len(ref_losses)), ref_losses, label=ref_label, linewidth=3, alpha=0.5)
    ax.plot(range(len(losses)), losses, label="Muon through muond", linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross-entropy, mean of 2 ranks)")
    ax.set_title(f"Tiny GPT on GPL-3: muond (mode {mode}) vs in-process")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--delay", type=int, default=0, choices=(0, 1),
                    help="1: one-step delayed update (the in-process reference stays synchronous)")
    ap.add_argument("--delay-warmup", type=int, default=10)
    ap.add_argument("--no-predict", action="store_true",
                    help="--delay 1: forward on the installed parameters, without the prediction")
    ap.add_argument("--address", default="", help="muond address (default: its default socket)")
    ap.add_argument("--plot", default="tiny_gpt_loss.png", help="PNG of the two loss curves")
    ap.add_argument("--json", default=None, help="write the losses as JSON here")
    ap.add_argument("--job-id", default=None)
    ap.add_argument("--transport", default="auto", choices=("auto", "shm", "grpc"))
    ap.add_argument("--zero-stage", type=int, default=2, choices=(1, 2, 3),
                    help="the muond job's partition: 1/2 of the concatenated matrices, 3 per matrix")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    ap.add_argument("--muon-lr", type=float, default=0.02)
    ap.add_argument("--adam-lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--save-at", type=int, default=None)
    ap.add_argument("--checkpoint", default=None, help="directory of the trainer checkpoint")
    ap.add_argument("--stop-after", type=int, default=None)
    ap.add_argument("--resume", default=None, help="trainer checkpoint directory to resume from")
    ap.add_argument("--inject-nonfinite-at", type=int, default=None)
    ap.add_argument("--keep-job", action="store_true", help="do not delete the muond job at the end")
    ap.add_argument("--mode", default="update", choices=("update", "apply"),
                    help="update: muond returns Muon updates, AdamW runs here; apply: muond holds "
                    "masters and all optimizer state and returns new parameters")
    ap.add_argument("--param-dtype", default="float32", choices=sorted(DTYPES),
                    help="the model's parameter dtype (apply mode)")
    ap.add_argument("--max-grad-norm", type=float, default=None,
                    help="global gradient clipping in muond (apply mode)")
    ap.add_argument("--qk-clip", type=float, default=None, metavar="TAU",
                    help="apply mode: QK-Clip (MuonClip) of every block's query and key "
                    "projections on muond's masters at threshold TAU (the reference clips its "
                    "own masters the same way); prints each step's largest attention logit")
    ap.add_argument("--qk-lr-mult", type=float, default=1.0,
                    help="the query and key projections' Muon lr as a multiple of --muon-lr "
                    "(> 1 makes the attention logits grow: a run to show QK-Clip on)")
    ap.add_argument("--node-addresses", default=None,
                    help="A0,A1: one muond per node (rank r on node r), the job's tensors split "
                    "between them by the ownership plan (DESIGN.md 4c); --address is then unused")
    ap.add_argument("--muonctl", default=None,
                    help="muonctl for the daemon's JobStatus (default: the build tree's, else PATH)")
    # Scales apply mode's loss bound; tests set 0 to see the check fail.
    ap.add_argument("--momentum-dtype", default="float32", choices=STATE_DTYPES,
                    help="how muond holds Muon's momentum (the reference keeps float32)")
    ap.add_argument("--adamw-state-dtype", default="float32", choices=STATE_DTYPES,
                    help="how muond holds AdamW's moments (apply mode)")
    ap.add_argument("--bound-scale", type=float, default=1.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.save_at is not None and not args.checkpoint:
        ap.error("--save-at needs --checkpoint")
    if args.mode == "update" and (args.param_dtype != "float32" or args.max_grad_norm):
        ap.error("--param-dtype other than float32 and --max-grad-norm need --mode apply")
    if args.qk_clip is not None and (args.mode != "apply" or args.node_addresses or
                                     not args.qk_clip > 0):
        ap.error("--qk-clip TAU needs --mode apply, one node and TAU > 0")
    if args.qk_lr_mult != 1.0 and args.mode != "apply":
        ap.error("--qk-lr-mult needs --mode apply")
    if args.adamw_state_dtype != "float32" and args.mode != "apply":
        ap.error("--adamw-state-dtype needs --mode apply")
    return args


def main(argv=None):
    args = parse_args(argv)
    world = 2
    with tempfile.TemporaryDirectory(prefix="tiny-gpt-") as tmp:
        store, result = os.path.join(tmp, "store"), os.path.join(tmp, "result.json")
        mp.spawn(run_rank, args=(world, args, store, result), nprocs=world, join=True)
        with open(result) as f:
            out = json.load(f)
    losses, ref = out["losses"], out["ref_losses"]
    start = out["start"]
    diffs = [abs(a - b) for a, b in zip(losses, ref)]
    run = diffs[start:]
    worst = max(range(start, len(diffs)), key=lambda i: diffs[i]) if run else None
    out["max_abs_diff"] = max(run) if run else 0.0
    other = "in-process" if args.mode == "update" else "reference"
    line = (f"{out['steps_run']} steps in {out['seconds']:.1f} s; largest |loss(muond) - "
            f"loss({other})| = {out['max_abs_diff']:.3e}"
            + (f" (step {worst})" if worst is not None else ""))
    compressed = args.momentum_dtype != "float32" or args.adamw_state_dtype != "float32"
    if (args.delay or compressed) and losses:
        # A delayed update or compressed state follows another trajectory: the end must match.
        gap = abs(end_loss(losses) - end_loss(ref)) / abs(end_loss(ref))
        target = 0.03 if args.delay else 0.02
        within = gap <= target
        other = ("synchronous in-process run's" if args.delay else "fp32-state run's") \
            if args.mode == "update" else "reference's"
        how = "--delay 1" if args.delay else (
            f"momentum {args.momentum_dtype}, AdamW moments {args.adamw_state_dtype}")
        reason = (f"; {how}: the loss at the end (mean of the last {END_STEPS} steps) is "
                  f"{gap * 100:.2f}% from the {other} (at most {target * 100:g}%)")
        out["final_loss_gap"] = gap
    else:
        within, reason = bound_verdict(args, diffs, out["bounds"], start, worst)
    print(line + reason)
    if out.get("max_logits"):
        top, after = max(out["max_logits"]), max(out["max_logits_after"])
        tau = args.qk_clip
        print(f"largest attention logit over the run: {top:.3f} in a step's forward (step "
              f"{out['max_logits'].index(top) + start}), {after:.3f} on a step's batch at the "
              "parameters the step returned; " +
              (f"QK-Clip at tau {tau:g}: after each step {after / tau:.3f} x tau at most (the "
               "clip is computed from the forward's logits, so the step's own update can add "
               "to them; the next step's clip takes that back)" if tau is not None
               else "no QK-Clip"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    if args.plot:
        plot(losses, ref, args.plot, args.mode)
        print(f"plot of the two loss curves: {os.path.abspath(args.plot)}")
    went_down = len(losses) >= 2 and losses[-1] < losses[0]
    if not went_down:
        print(f"the loss did not go down: {losses[0] if losses else None} -> "
              f"{losses[-1] if losses else None}", file=sys.stderr)
    return 0 if went_down and within else 1


if __name__ == "__main__":
    sys.exit(main())
