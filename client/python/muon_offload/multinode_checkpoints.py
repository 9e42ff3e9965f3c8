"""Checkpoints of a multi-node optimizer (DESIGN.md 4c; described in multinode.py's module
comment): each node's local rank 0 saves, loads or exports its node's job; state_dict() names the
per-node generations or the export. The DaemonCheckpoints (checkpoints.py) of
MultiNodeMuonWithAuxAdam, over its NodeJobLink (multinode_link.py).
"""
from ._native import CODES, MuondError
from .checkpoints import DaemonCheckpoints


class NodeCheckpoints(DaemonCheckpoints):
    """DaemonCheckpoints over the node jobs (same fields; link is the NodeJobLink)."""

    def save_checkpoint(self):
        """Collective: every node's job saves a generation (its local rank 0); returns (and
        state_dict() then names) {"global_job_id", "next_step", "nodes": [...]}."""
        ctx, link = self.ctx, self.link
        ctx.ranks.barrier()
        r = link.routing
        saved = link.each_rank(lambda: link.client.checkpoint_save(r.node_job_id, link.node_token)
                               if r.local_rank == 0 else None)
        nodes = [{"node": r.node_of[q], "job_id": f"{link.global_job_id}.node{r.node_of[q]}",
                  "generation": g, "step": st} for q, x in enumerate(saved) if x is not None
                 for g, st in [x]]
        self.saved = {"job_id": link.global_job_id, "global_job_id": link.global_job_id,
                      "next_step": ctx.step_id, "nodes": nodes,
                      "generation": [n["generation"] for n in nodes], "step": ctx.step_id}
        return dict(self.saved)

    def load_checkpoint(self, generation=-1, step=-1):
        """Collective: every node loads the generation of the newest step that every node has
        (or of `step`); `generation` must be -1 (generations differ per node). Returns
        (generations by node, next_step)."""
        if generation != -1:
            raise ValueError("over several nodes a checkpoint is chosen by step (generations "
                             "differ per node); pass step= or nothing for the newest common one")
        ctx, link = self.ctx, self.link
        r = link.routing
        link.close_session()
        self.saved = None
        self.mode.upload_pending = False
        ctx.ranks.barrier()
        listed = link.each_rank(lambda: link.list_steps() if r.local_rank == 0 else None)
        common = set.intersection(*[set(x) for x in listed if x is not None])
        if step != -1:
            common &= {int(step)}
        if not common:
            raise MuondError(CODES["NOT_FOUND"],
                             f"global job '{link.global_job_id}': no checkpoint step "
                             f"{'' if step == -1 else str(step) + ' '}is on every node (steps "
                             f"by node: {[sorted(x) for x in listed if x is not None]})",
                             "load_checkpoint")
        chosen = max(common)
        loaded = link.each_rank(lambda: link.client.checkpoint_load(
            r.node_job_id, link.node_token, -1, chosen) if r.local_rank == 0 else None)
        ctx.ranks.barrier()
        link.each_rank(lambda: link.attach(False))
        gens = {r.node_of[q]: x[0] for q, x in enumerate(loaded) if x is not None}
        return gens, ctx.step_id

    def export_state(self, out_dir, step=-1, dtype="held"):
        """Collective: every node's job writes its whole optimizer state (live; or its checkpoint
        generation at `step`) into `out_dir` (<node job>.safetensors + .manifest.json, written
        by the node's local rank 0), each array as held or decoded (`dtype` "float32"). Returns (and state_dict() then names) {"global_job_id",
        "next_step", "export_dir", "nodes": [{"node", "job_id", "step"}]}."""
        link = self.link
        self.ctx.ranks.barrier()
        r = link.routing
        steps = link.each_rank(lambda: link.client.export_state(
            r.node_job_id, link.node_token, out_dir, 0, step, dtype) if r.local_rank == 0 else None)
        nodes = [{"node": r.node_of[q], "job_id": f"{link.global_job_id}.node{r.node_of[q]}",
                  "step": st} for q, st in enumerate(steps) if st is not None]
        if len({n["step"] for n in nodes}) != 1:
            raise MuondError(CODES["FAILED_PRECONDITION"],
                             f"global job '{link.global_job_id}': the nodes exported different "
                             f"steps {nodes}", "export_state")
        self.saved = {"job_id": link.global_job_id, "global_job_id": link.global_job_id,
                      "next_step": nodes[0]["step"], "export_dir": str(out_dir),
                      "nodes": nodes, "step": nodes[0]["step"]}
        return dict(self.saved)

    def load_state_dict(self, state_dict, offloaded):
        """The trainer's own state and the node jobs' part: an export (re-sharded: the node jobs
        took it at creation; the step is checked) or per-node generations (loaded). Returns the
        next step."""
        ctx, link = self.ctx, self.link
        state_dict = dict(state_dict)
        muond = state_dict.pop("muond", None)
        state_dict.pop("step_id", None)
        if muond is not None and "export_dir" in muond:
            if muond["next_step"] != ctx.step_id:
                raise ValueError(f"the state_dict is of the export at step {muond['next_step']}; "
                                 f"global job '{link.global_job_id}' expects step {ctx.step_id}")
            self.install_torch(*self.stage_torch(state_dict))
            self.saved = dict(muond)
            return ctx.step_id
        if muond is None or muond.get("global_job_id") != link.global_job_id:
            raise ValueError(f"this state_dict is not of multi-node job '{link.global_job_id}'")
        # torch's part is checked first and installed only once the node jobs loaded theirs: a
        # refused load leaves both as they were (checkpoints.py).
        staged = self.stage_torch(state_dict)
        _, next_step = self.load_checkpoint(step=muond["next_step"])
        self.install_torch(*staged)
        self.saved = dict(muond)
        return next_step
