"""The two-phase step of a multi-node job, on the trainer's side (DESIGN.md 4c; the protocol is
described in multinode.py): the agreement after every node prepared its step (failures and the
hyperparameters, and the nodes' sums of squares for global clipping, with the recomputation it
may call for), the commits and their own agreement (the commit window), and the rollback, abort
and errors that follow a failure. A collaborator of MultiNodeMuonWithAuxAdam: it receives the
StepContext (optim_job.py) and the NodeJobLink (multinode_link.py) and max_grad_norm explicitly.
"""
import math

from . import _native
from ._native import CODES, MuondError


class TwoPhaseCommit:
    """The agreement, commit and abort of each step over the nodes. ctx: the StepContext (ranks,
    last_grad_norm); link: the NodeJobLink (client, node_token, routing, global_job_id,
    session); max_grad_norm: global clipping in apply mode (0: off). clipped_steps: steps that
    global clipping recomputed on every node."""

    def __init__(self, ctx, link, max_grad_norm):
        self.ctx, self.link, self.max_grad_norm = ctx, link, max_grad_norm
        self.clipped_steps = 0

    def agree(self, step, error, hyper=None, node_sum=None):
        """All ranks learn whether every node's step succeeded and (apply mode) whether every
        rank sent the same hyperparameters (`hyper`: group names, lrs, weight decays, divisor);
        on a failure or a disagreement anywhere each rank aborts its node's step and every rank
        raises the same error. `node_sum` (global clipping): this rank's node's raw sum of
        squares; returns their sum over the nodes (one slot per node, added in node order)."""
        failed = error is not None
        names, values = [], []
        if hyper is not None:
            group_names, lrs, wds, divisor = hyper
            names = ([(g, "lr") for g in group_names] + [(g, "weight_decay") for g in group_names]
                     + [(None, "gradient divisor")])
            values = [float(v) for v in list(lrs) + list(wds) + [divisor]]
        compared = len(values)
        if node_sum is not None:  # each node's slot: its ranks' sum (>= 0), 0 from the others
            values += [float(node_sum) if n == self.link.routing.node else 0.0
                       for n in range(self.link.routing.nodes)]
        try:
            any_failed, lows, highs = self.ctx.ranks.agree(failed, values)
            if any_failed and self.ctx.world_size > 1:
                errors = self._gather(None if error is None else (error.code, error.message))
                q, (code, message) = next((q, e) for q, e in enumerate(errors) if e is not None)
                error = MuondError(code, f"rank {q} (node {self.link.routing.node_of[q]}): "
                                   f"{message}", "step")
            elif not any_failed:
                error = self._disagreement(names, lows[:compared], highs[:compared])
        except RuntimeError as e:
            self.lost(step, e)
        if error is None:
            return sum(highs[compared:]) if node_sum is not None else None
        self._abort(step, error.message)
        raise MuondError(error.code, f"global job '{self.link.global_job_id}' step {step} was "
                         f"committed on no node: {error.message}", "step")

    def clip_globally(self, step, hyper, total, node_sum, result, rerun):
        """Global clipping over the nodes (apply mode, max_grad_norm): every node prepared the
        step with clip 1 and reported its raw sum of squares; `total` is their sum (the
        agreement's). When the norm it gives is within max_grad_norm the speculation was right;
        otherwise each node's local rank 0 drops its prepared step, and after a barrier every
        rank runs the step again with the global sum (the daemon then clips by it, with the
        coefficient of one node's clipping: max_grad_norm / (norm + 1e-6)). The gradients are
        still in place (rerun() runs this rank's part of the step again and returns where its
        results are); a node whose sum differs the second time fails the step everywhere."""
        divisor = float(hyper[3])
        self.ctx.last_grad_norm = math.sqrt(total) / divisor
        if self.max_grad_norm / (math.sqrt(total / (divisor * divisor)) + 1e-6) >= 1.0:
            return result
        s, r = self.link.session, self.link.routing
        if r.local_rank == 0:
            self._abort(step, "the global gradient norm calls for clipping: recomputed with it")
        try:
            self.ctx.ranks.barrier()
        except RuntimeError as e:
            self.lost(step, e)
        error = None
        try:
            s.set_global_clip(2, total)
            result = rerun()
            again = s.last_step_sum_sq()
            if again != node_sum:
                error = MuondError(CODES["INVALID_ARGUMENT"],
                                   f"node {r.node}'s gradients changed between the two passes "
                                   f"of global clipping (sum of squares {node_sum!r}, then "
                                   f"{again!r})", "step")
        except MuondError as e:
            error = e
        finally:
            s.set_global_clip(1)
        self.agree(step, error, hyper)
        self.clipped_steps += 1
        return result

    def commit_everywhere(self, step):
        """The commit window: each rank commits its node's step, then the ranks learn (one
        all-reduce) whether every commit succeeded. When one did not (its daemon died, or stopped
        and refused), each rank rolls its node back (RollbackStep: a node that committed gets the
        state before the step back from its double buffer, a node that did not drops the step)
        and every rank raises the same ABORTED error naming the node whose commit failed and the
        state each node is in now. Each call waits at most 20 s for a daemon being restarted."""
        error = None
        try:
            self.commit(step)
        except MuondError as e:
            error = e
        try:
            if not self.ctx.ranks.count(error is not None):
                return
            failures = self._gather(None if error is None else (error.code_name, error.message))
            q = next(q for q, f in enumerate(failures) if f is not None)
            failed_node = self.link.routing.node_of[q]
            cause = f"the commit failed on node {failed_node} (rank {q}: {failures[q][1]})"
            try:
                self._rollback(step, cause)
                mine = None
            except MuondError as e:
                mine = f"{e.code_name}: {e.message}"
            states = self._gather(mine)
        except RuntimeError as e:
            self.lost(step, e)
        nodes = {}
        for rank, state in enumerate(states):  # a node is back when any of its ranks got it back
            node = self.link.routing.node_of[rank]
            if node not in nodes or state is None:
                nodes[node] = state
        back = [n for n in sorted(nodes) if nodes[n] is None]
        lost = [n for n in sorted(nodes) if nodes[n] is not None]
        where = "; ".join([f"node {n}: back before step {step}" for n in back]
                          + [f"node {n}: not rolled back ({nodes[n]})" for n in lost])
        todo = (f"run step {step} again" if not lost else
                f"restart the daemon of node(s) {', '.join(map(str, lost))} if it stopped, then "
                "load_checkpoint() (every node takes the newest step all of them saved)")
        raise MuondError(CODES["ABORTED"],
                         f"global job '{self.link.global_job_id}' step {step} did not commit on "
                         f"every node: {cause}. Each node now: {where}. To continue: {todo}",
                         "step")

    def _gather(self, value):
        """`value` of every rank, in rank order (an all_gather_object; this rank's alone when
        the world is one rank)."""
        if self.ctx.world_size == 1:
            return [value]
        out = [None] * self.ctx.world_size
        self.ctx.ranks.dist.all_gather_object(out, value, group=self.ctx.ranks.group)
        return out

    def _node_job(self):
        """(client handle, node job id, node token) of this rank's node job, for the C ABI."""
        link = self.link
        return (link.client.handle, link.routing.node_job_id.encode(),
                link.node_token.encode())

    def _rollback(self, step, reason):
        _native.call("muond_step_rollback", *self._node_job(), int(step),
                     reason[:1000].encode())

    @staticmethod
    def _disagreement(names, lows, highs):
        """The error for the first hyperparameter the ranks disagree on (None when they agree)."""
        for (group, what), lo, hi in zip(names, lows, highs):
            if lo != hi:
                where = f"group '{group}' {what}" if group is not None else what
                return MuondError(CODES["INVALID_ARGUMENT"],
                                  f"the ranks disagree on the {where}: from {lo!r} to {hi!r} "
                                  "across the nodes (every rank must send the same values)",
                                  "step")
        return None

    def lost(self, step, cause):
        """A collective failed (a rank died, or the group broke): abort this node's step and
        raise the error every survivor raises."""
        self._abort(step, "a collective of the trainer's process group failed")
        raise MuondError(CODES["ABORTED"],
                         f"global job '{self.link.global_job_id}' step {step} was committed on no "
                         "node: a rank of the process group failed during the step (a collective "
                         "broke); restart the lost ranks or daemons and load_checkpoint()",
                         "step") from cause

    def _abort(self, step, reason):
        try:
            _native.call("muond_step_abort", *self._node_job(), int(step),
                         reason[:1000].encode())
        except MuondError:
            pass  # a dead daemon aborted the step by dying; a fenced job needs a load anyway

    def commit(self, step):
        _native.call("muond_step_commit", *self._node_job(), int(step))

