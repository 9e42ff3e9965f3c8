"""The optimizer off the training step's critical path: gradients leave for muond while backward
still runs, and step() waits only for what is not back yet.

GradientStream hooks the AccumulateGrad node of every job tensor (torch 1.13 has no
register_post_accumulate_grad_hook; this is how DeepSpeed hooks them). When autograd has
accumulated a tensor's gradient, the tensor joins the open bucket, in the order backward produces
them; a bucket of at least `bucket_bytes` is sent:
  - one rank, or gradients already reduced (reduce=False): the rank's spans of the bucket's
    tensors are copied into the session's shared-memory gradient buffer;
  - several ranks: an asynchronous all-to-all hands every rank its spans of the bucket from every
    rank, summed in rank order when the next bucket (or step()) needs it: the sum of
    zero.reduce_scatter_partitions, element for element, so the bits do not depend on the buckets;
then every run of the bucket's spans that lies together in the buffer is posted as a part of the
step (common/shm_protocol.h). step() sends what backward did not (tensors whose gradient never
arrived through a hook) as the last part.

Results come back span by span (the daemon's progress words): with one rank, step() applies each
span's update (update mode) or copies its new parameters (apply mode) as soon as it is in, while
later matrices still compute; with several ranks, the all-gather needs every partition and runs
once the step ended. The step stays atomic for the trainer: the values a span had before its
early result was used are kept, and a step that fails restores them (nothing of it stays).

Over gRPC, and for a job that is not attached through shared memory, nothing is sent early: the
buckets are recorded and step() sends the step whole (the gRPC step stream carries it chunk by
chunk). The result is the same bits either way.

What left must still be the gradient at step(): each tensor sent while armed keeps a reference to
the p.grad it was read from and a fingerprint of its bytes (fingerprint(): CRC-32 on the CPU, two
int64 sums on a device), and edited() names the tensors for which either changed (clipping, an
unscale, DDP's reduction, p.grad replaced, a second backward). The optimizer then drops the
streamed parts on every rank and sends the step whole (optim.py). The DDP route (route(),
arrived_reduced()) streams DistributedDataParallel's reduced buckets from its communication hook
instead of the local gradients; it fingerprints the reduced bytes DDP leaves in p.grad.

REQUIRES with several ranks: backward produces the job tensors' gradients in the same order on
every rank (as DistributedDataParallel's buckets assume), so that every rank's buckets match.
Thread-safety: the hooks run on autograd's threads, one at a time per backward; step() runs after
backward returned.
"""
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from ._native import CODES, MuondError

DEFAULT_BUCKET_BYTES = 32 << 20


def _wire(t):
    # gloo (torch 1.13) does not move bfloat16: it travels as bytes (data movement only).
    return t.view(torch.uint8) if t.dtype == torch.bfloat16 else t


_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PERIOD = 65521  # the position weights repeat with this period (a prime)
_WEIGHTS = {}  # device: int64 weights 1.._PERIOD, made once per device


def _device_fingerprint(t):
    """Two int64 sums over the tensor's words (integers of its element's size), computed where
    it lives (no copy to the host) in one read: the plain sum, which any change of a single word
    moves, and a sum weighted by position (k mod 65521, plus 1), which a swap of two words or a
    change that keeps the plain sum moves. The words are summed per position class first (a
    [rows, 65521] view summed over rows), so the weights are 65521 numbers per device. Returns
    a 2-element int64 tensor on the tensor's device."""
    flat = t.detach().contiguous().view(-1)
    words = flat.view(_WORD[flat.element_size()])
    weights = _WEIGHTS.get(str(words.device))
    if weights is None:
        weights = torch.arange(1, _PERIOD + 1, device=words.device, dtype=torch.int64)
        _WEIGHTS[str(words.device)] = weights
    full = words.numel() // _PERIOD * _PERIOD
    classes = words[:full].view(-1, _PERIOD).sum(dim=0, dtype=torch.int64)
    tail = words[full:].to(torch.int64)
    plain = classes.sum() + tail.sum()
    weighted = (classes * weights).sum() + (tail * weights[:tail.numel()]).sum()
    return torch.stack([plain, weighted])


def fingerprint(t):
    """A fingerprint of the tensor's bytes as they are now: CRC-32 of its bytes for a CPU tensor
    (one pass, no copy), _device_fingerprint elsewhere (no host copy; compared where it was
    taken). Equal fingerprints of the same tensor mean unchanged bytes, up to a CRC collision."""
    if t.device.type == "cpu":
        flat = t.detach().contiguous().view(-1)
        if flat.numel() == 0:
            return 0
        return zlib.crc32(memoryview(flat.view(torch.uint8).numpy()))
    return _device_fingerprint(t)


def _same(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
            bool(torch.equal(a, b))
    return a == b


class GradientStream:
    """One rank's gradient stream (see the module comment).

    session: the attached client.Session; partitions: every rank's zero.Partition; rank: this
    rank; params: the job's tensors in job order; group/distributed: the torch.distributed group
    and module (None: one rank); reduce: sum the ranks' gradients here; mean: divide the sum by
    the world size (update mode; apply mode sends the sum and a divisor); bucket_bytes: the size
    at which a bucket leaves; dtype: the buffer's (default: the parameters'; gradients of other
    dtypes are converted on the copy); zero_missing: a tensor without a gradient (p.grad None)
    goes as zeros (apply mode's presence mask says whether muond uses it), else it is refused.
    """

    def __init__(self, session, partitions, rank, params, group=None, distributed=None,
                 reduce=False, mean=False, bucket_bytes=DEFAULT_BUCKET_BYTES, dtype=None,
                 zero_missing=False):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.session = session
        self.partitions = partitions
        self.rank = rank
        self.world = len(partitions)
        self.params = list(params)
        self.dtype = dtype or self.params[0].dtype  # the buffers' (converted on the copies)
        self.zero_missing = zero_missing
        self.itemsize = torch.empty(0, dtype=self.dtype).element_size()
        self.group = group
        self._dist = distributed if self.world > 1 else None
        self.reduce = reduce and self._dist is not None
        self.mean = mean
        self.bucket_bytes = int(bucket_bytes)
        self.spans = partitions[rank].spans
        # Per tensor, every rank's span indices (the all-to-all's pieces), and this rank's.
        self._spans_of = [[[] for _ in self.params] for _ in partitions]
        for part in partitions:
            for k, (m, _, _, _) in enumerate(part.spans):
                self._spans_of[part.rank][m].append(k)
        self._mine = self._spans_of[rank]
        order = sorted(range(len(self.spans)), key=lambda k: self.spans[k][3])
        self._position = {k: i for i, k in enumerate(order)}
        self._order = order
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._hooks = []
        self._active = False
        self._shm = False
        self.on_first_post = None  # called before the step's first part leaves (apply: hyper)
        self.buckets_sent = 0
        self._pool = None  # threads for the fingerprints at step() (zlib releases the GIL)
        # The DDP route (route()): tensors whose reduced gradient DistributedDataParallel's
        # communication hook hands over (on its own thread); their AccumulateGrad hooks stay
        # quiet. The lock orders the hook threads' sends.
        self._routed = frozenset()
        self._lock = threading.Lock()
        self._reset(None)

    # ----- hooks -----

    def install(self):
        """Hooks every tensor's AccumulateGrad node (kept alive here)."""
        for i, p in enumerate(self.params):
            if not p.requires_grad:
                continue
            node = p.expand_as(p).grad_fn.next_functions[0][0]
            node.register_hook(self._hook_for(i))
            self._hooks.append(node)

    def _hook_for(self, i):
        def hook(*_):
            if self._active and i not in self._routed:
                with self._lock:
                    self._arrived(i)
        return hook

    def route(self, indices):
        """The tensors `indices` stream through arrived_reduced (the DDP route) from now on."""
        self._routed = frozenset(indices)

    def arrived_reduced(self, params, flat):
        """The DDP route, on the communication hook's thread: `flat` holds the reduced gradients
        of `params` (a DDP bucket's parameters, in its order, one after the other), the bytes
        DDP then leaves in p.grad (a view of them, or a copy at the end of backward). Routed job
        tensors among them are sent as one bucket; what step() checks of each is the
        fingerprint of these bytes and the p.grad tensor they belong to."""
        with self._lock:
            if not self._active:
                return
            values, at = {}, 0
            for p in params:
                n = p.numel()
                i = self._index.get(id(p))
                if i is not None and i in self._routed:
                    if i in self._sent:
                        self._late.append(i)
                    else:
                        values[i] = flat[at:at + n]
                at += n
            if not values:
                return
            for i, v in values.items():
                self._left[i] = (self.params[i].grad, fingerprint(v))
            self._sent.update(values)
            self._copy_and_post(list(values), values)

    def remove(self):
        """Stops streaming for good (the hooks stay registered but do nothing)."""
        self._active = False
        self._hooks.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    # ----- a step -----

    def _reset(self, step):
        self.step = step
        self._bucket, self._bucket_size = [], 0
        self._sent = set()        # tensors whose spans are in the buffer (or on their way)
        self._posted = 0          # parts posted
        self._inflight = []       # (work, received, tensors) of all-to-alls not yet summed
        self._late = []           # tensors whose gradient changed after they were sent
        # Per tensor sent while armed: (the gradient tensor it was read from, or None for zeros,
        # its fingerprint then). step() checks both before the parts may stand (edited()).
        self._left = {}
        self._fault = None        # an error of the DDP route's sends (fault())

    def arm(self, step, shm):
        """The next backward streams step `step` (shm: parts go out at once; else recorded)."""
        self._reset(step)
        self._shm = shm
        self._active = True

    def disarm(self):
        self._active = False

    @property
    def armed(self):
        return self._active

    def _arrived(self, i):
        if i in self._sent:
            self._late.append(i)  # a second backward into a tensor already sent
            return
        if i in self._bucket:
            return
        self._bucket.append(i)
        self._bucket_size += self.params[i].numel() * self.itemsize
        if self._bucket_size >= self.bucket_bytes:
            self._send_bucket()

    def _send_bucket(self):
        tensors, self._bucket, self._bucket_size = self._bucket, [], 0
        if not tensors:
            return
        self._sent.update(tensors)
        if self._active:
            for i in tensors:  # what leaves now: step() checks it is still what p.grad holds
                g = self.params[i].grad
                self._left[i] = (g, None if g is None else fingerprint(g))
        if self.reduce:
            self._exchange(tensors)
            self._finish_exchanges(keep=1)  # sums the previous bucket while this one travels
        else:
            self._copy_and_post(tensors, {i: self._grad(i) for i in tensors})

    def _exchange(self, tensors):
        """Starts the all-to-all of the bucket: each rank's spans of its tensors, rank order."""
        grads = {i: self._grad(i) for i in tensors}
        pieces, sizes = [], []
        for r in range(self.world):
            n = 0
            for i in tensors:
                flat = grads[i].reshape(-1)
                for k in self._spans_of[r][i]:
                    _, off, length, _ = self.partitions[r].spans[k]
                    pieces.append(flat[off:off + length])
                    n += length
            sizes.append(n)
        mine = sizes[self.rank]
        device = self.params[tensors[0]].device
        send = torch.cat([p.to(self.dtype) for p in pieces]) if pieces else \
            torch.empty(0, dtype=self.dtype, device=device)
        received = torch.empty(self.world * mine, dtype=self.dtype, device=device)
        scale = 2 if self.dtype == torch.bfloat16 else 1
        work = self._dist.all_to_all_single(
            _wire(received), _wire(send), output_split_sizes=[mine * scale] * self.world,
            input_split_sizes=[n * scale for n in sizes], group=self.group, async_op=True)
        self._inflight.append((work, received, send, tensors, mine))

    def _finish_exchanges(self, keep=0):
        while len(self._inflight) > keep:
            work, received, _, tensors, mine = self._inflight.pop(0)
            work.wait()
            slots = received.view(self.world, mine)
            total = slots[0].clone()
            for r in range(1, self.world):
                total.add_(slots[r])
            if self.mean:
                total.mul_(1.0 / self.world)
            at, flat = 0, {}
            for i in tensors:
                for k in self._mine[i]:
                    length = self.spans[k][2]
                    flat[k] = total[at:at + length]
                    at += length
            self._place(tensors, flat)

    def _grad(self, i):
        g = self.params[i].grad
        if g is not None:
            return g
        if self.zero_missing:
            return torch.zeros_like(self.params[i])
        raise MuondError(CODES["INVALID_ARGUMENT"], f"tensor {i} has no gradient", "step")

    def _copy_and_post(self, tensors, grads):
        flat = {}
        for i in tensors:
            g = grads[i].reshape(-1)
            for k in self._mine[i]:
                _, off, length, _ = self.spans[k]
                flat[k] = g[off:off + length]
        self._place(tensors, flat)

    def _place(self, tensors, flat):
        """Writes this rank's spans of `tensors` (flat[k]: span k's values) into the step's
        gradient buffer and posts them, one part per run of spans that lie together."""
        buffer = self.buffer(self.step)
        for k, values in flat.items():
            _, _, length, ro = self.spans[k]
            buffer[ro:ro + length].copy_(values)
        if self._shm:
            runs = self._runs(sorted(flat, key=self._position.get))
            if runs and self._posted == 0 and self.on_first_post is not None:
                self.on_first_post()
            for begin, end in runs:
                self.session.post_part(self.step, begin, end - begin)
                self._posted += 1
        self.buckets_sent += 1

    def buffer(self, step):
        """Where the step's gradients go: the shared-memory view, or the caller's flat buffer."""
        return self._buffer_fn(step)

    def set_buffer(self, fn):
        self._buffer_fn = fn

    def _runs(self, spans):
        """(begin, end) byte ranges of runs of `spans` (sorted by place) that are neighbours in
        the buffer's order of spans."""
        runs = []
        for k in spans:
            _, _, length, ro = self.spans[k]
            begin, end = ro * self.itemsize, (ro + length) * self.itemsize
            if runs and self._position[k] == runs[-1][2] + 1:
                runs[-1] = (runs[-1][0], end, self._position[k])
            else:
                runs.append((begin, end, self._position[k]))
        return [(b, e) for b, e, _ in runs]

    def finish(self):
        """step(): sends what backward did not and posts the last part. Returns the tensors that
        were streamed during backward (for the caller's statistics)."""
        self._active = False
        streamed = len(self._sent)
        if self._bucket:
            self._send_bucket()
        rest = [i for i in range(len(self.params)) if i not in self._sent]
        if rest:
            self._bucket = rest
            self._send_bucket()
        self._finish_exchanges()
        return streamed

    def post_last(self, poison=False):
        """The last part: empty (every span went before). poison: a part that repeats the first
        span instead, so that the daemon refuses the step (nothing of it commits)."""
        if not self._shm:
            return
        if self._posted == 0 and self.on_first_post is not None:
            self.on_first_post()
        if poison and self._order:
            k = self._order[0]
            _, _, length, ro = self.spans[k]
            self.session.post_part(self.step, ro * self.itemsize, length * self.itemsize, last=True)
        else:
            self.session.post_part(self.step, 0, 0, last=True)

    def fault(self, error):
        """A send on the DDP hook's thread failed: the step falls back (every tensor counts as
        edited), and step()'s warning names the error (fault_error)."""
        self._fault = error

    @property
    def fault_error(self):
        return self._fault

    def edited(self):
        """The tensors (indices) whose gradient is not, at step(), what was streamed of it during
        backward: a second backward into it, p.grad replaced (p.grad = ..., set to None, or
        set where there was none), or its bytes changed in place (clip_grad_norm_, an unscale,
        DistributedDataParallel's reduction, p.grad.data.mul_(): none of which torch 1.13's
        version counter reliably shows, so the bytes are fingerprinted). Sorted; empty when
        every streamed byte is still the gradient's."""
        if self._fault is not None:
            return list(range(len(self.params)))
        edited = set(self._late)
        checks = []
        for i, (g, fp) in self._left.items():
            if i in edited:
                continue
            now = self.params[i].grad
            if now is not g:  # identity by reference: id() and data_ptr() get reused
                edited.add(i)
            elif g is not None:
                checks.append((i, g, fp))
        cpu = [c for c in checks if c[1].device.type == "cpu"]
        if len(cpu) > 1 and torch.get_num_threads() > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=torch.get_num_threads())
            now = list(self._pool.map(lambda c: fingerprint(c[1]), cpu))
        else:
            now = [fingerprint(g) for _, g, _ in cpu]
        for (i, _, fp), n in zip(cpu, now):
            if n != fp:
                edited.add(i)
        for i, g, fp in checks:
            if g.device.type != "cpu" and not _same(fingerprint(g), fp):
                edited.add(i)
        return sorted(edited)

    def abandon(self, everyone=False):
        """Drops a step whose parts went out (an error before its last part): the daemon refuses
        it, nothing commits. Collective work in flight is waited for (every rank does the same).
        everyone: every rank of the job drops the step together (a fallback they agreed on), so
        this rank sends its refusing last part even when none of its parts left yet: the
        refusal the daemon owes a rank that had not begun the step is taken here, not by the
        step's whole send that follows."""
        self._active = False
        for work, *_ in self._inflight:
            work.wait()
        self._inflight = []
        if self._shm and (self._posted or everyone):
            try:
                self.post_last(poison=True)
            except MuondError:
                pass  # its last part left already: the step ended, or ends, on its own
            try:
                self.session.wait_parts(self.step)
            except MuondError:
                pass
        self._posted = 0


class EarlyResults:
    """Uses a step's results span by span as the daemon announces them (one rank), keeping what
    each span held before so that a failed step can be undone (see the module comment)."""

    def __init__(self, session, step, spans, use_span):
        self.session = session
        self.step = step
        self.spans = spans
        # use_span(k, keep): applies span k; with keep, returns (view, old values) to restore.
        self.use_span = use_span
        self.done = [False] * len(spans)
        self.saved = []
        self.early = 0

    def run(self):
        """Until the step ended: applies each span as it is announced. Raises the step's error
        after restoring every span applied; a skipped step (session.last_step_skipped) is undone
        the same way, without an error."""
        try:
            while True:
                ready, ended = self.session.progress(self.step, -1.0)
                if ended:
                    break
                for k, r in enumerate(ready):
                    if r and not self.done[k]:
                        self._use(k, early=True)
            self.session.wait_parts(self.step)
        except BaseException:
            self.undo()
            raise
        if self.session.last_step_skipped:
            self.undo()
            return
        for k in range(len(self.spans)):
            if not self.done[k]:
                self._use(k, early=False)

    def _use(self, k, early):
        self.done[k] = True
        saved = self.use_span(k, early)
        if saved is not None:
            self.saved.append(saved)
        self.early += 1 if early else 0

    def undo(self):
        for view, old in reversed(self.saved):
            view.copy_(old)
        self.saved.clear()
