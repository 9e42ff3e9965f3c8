"""Python objects over the C ABI: a daemon connection (Client), one rank's session of a job
(Session) and the layout of a job.json (layout_spans).

Thread-safety: as the C ABI. A Client may be shared between threads; a Session runs one step at a
time. Tensors returned by Session.gradient_view()/update_view() alias the session's shared memory
and are valid while the session is open.
"""
import ctypes
import os
import json

import torch

from . import _native
from ._native import MuondError, ShardSpan, Span

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def dtype_name(dtype):
    """The job.json name of a torch dtype; ValueError for dtypes muond does not take."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"muond takes float32, bfloat16 or float16 gradients, not {dtype}")
    return DTYPE_NAMES[dtype]


def _spec_text(spec):
    return (spec if isinstance(spec, str) else json.dumps(spec)).encode()


def _spans_tuple(array, n):
    return tuple((array[i].matrix, array[i].offset, array[i].length, array[i].rank_offset)
                 for i in range(n))


def layout_spans(spec, rank):
    """The spans `rank` owns under the layout of a job spec (a dict or job.json text), computed by
    the client library as the daemon computes them. Returns (spans, buffer_elements): spans are
    (matrix, offset, length, rank_offset) tuples, buffer_elements the size of the rank's flat
    buffer (stage 1/2: the padded partition; stage 3: the padded chunks back to back)."""
    text = _spec_text(spec)
    total, elements = ctypes.c_size_t(), ctypes.c_uint64()
    fn = _native.function("muond_layout_spans")
    _native.check(fn(text, rank, None, 0, ctypes.byref(total), ctypes.byref(elements)),
                  "muond_layout_spans")
    array = (ShardSpan * max(total.value, 1))()
    _native.check(fn(text, rank, array, total.value, None, None), "muond_layout_spans")
    return _spans_tuple(array, total.value), elements.value


class Client:
    """A connection to a muond daemon. address: "unix:///path", "HOST:PORT" or "tls://HOST:PORT";
    None or "" for the daemon's default address. Connecting is lazy: an unreachable daemon shows at
    the first call (MuondError UNAVAILABLE). tls:// addresses verify the daemon's certificate
    against tls_ca (a PEM file; None: gRPC's default roots) and present tls_cert + tls_key for
    mutual TLS. With none of the three given, $MUOND_TLS_CA, $MUOND_TLS_CERT and $MUOND_TLS_KEY
    are used."""

    def __init__(self, address=None, tls_ca=None, tls_cert=None, tls_key=None):
        self.address = address or ""
        handle = ctypes.c_void_p()
        if tls_ca or tls_cert or tls_key:
            enc = lambda s: s.encode() if s else None
            _native.call("muond_connect_tls", self.address.encode(), enc(tls_ca), enc(tls_cert),
                         enc(tls_key), ctypes.byref(handle))
        else:
            _native.call("muond_connect", self.address.encode(), ctypes.byref(handle))
        self._handle = handle

    @property
    def handle(self):
        if self._handle is None:
            raise MuondError(_native.CODES["FAILED_PRECONDITION"], "the client is closed", "client")
        return self._handle

    def close(self):
        if self._handle is not None:
            _native.lib().muond_client_free(self._handle)
            self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass

    def health(self, timeout_seconds=5.0):
        """Returns when the daemon is SERVING; MuondError UNAVAILABLE otherwise."""
        _native.call("muond_health", self.handle, float(timeout_seconds))

    def create_job(self, spec, import_dir=None):
        """Creates a job from its spec (dict or job.json text); returns the job's token (str).
        import_dir: a directory of full-state exports (export_state of every node's job, one
        step); the job takes each of its tensors' state and the next step from there."""
        token = ctypes.create_string_buffer(65)
        if import_dir is not None:
            _native.call("muond_job_create_from_export", self.handle, _spec_text(spec),
                         os.path.abspath(str(import_dir)).encode(), token, len(token))
        else:
            _native.call("muond_job_create", self.handle, _spec_text(spec), token, len(token))
        return token.value.decode()

    def export_state(self, job_id, token, out_dir, generation=0, step=-1, dtype="held"):
        """Writes the job's whole optimizer state by tensor name (live; or checkpoint generation
        `generation` > 0, or the newest one at `step` >= 0) into `out_dir` as
        <job>.safetensors and <job>.manifest.json, as `muonctl checkpoint export`; each array as
        the job holds it (dtype "held": compressed momentum and moments stay compressed) or
        decoded ("float32"). Returns the step of the state (the next step)."""
        exported = ctypes.c_int64(-1)
        _native.call("muond_checkpoint_export_as", self.handle, job_id.encode(), token.encode(),
                     int(generation), int(step), str(out_dir).encode(), str(dtype).encode(),
                     ctypes.byref(exported))
        return exported.value

    def delete_job(self, job_id, token):
        _native.call("muond_job_delete", self.handle, job_id.encode(), token.encode())

    def reset_job(self, job_id, token, next_step=0):
        _native.call("muond_job_reset", self.handle, job_id.encode(), token.encode(), next_step)

    def export(self, job_id, token, out_path, dtype="float32"):
        """Apply mode: writes the job's master weights, every tensor in full shape under its name,
        to `out_path` as a safetensors model file in `dtype` ("float32", "bfloat16" or
        "float16")."""
        _native.call("muond_export", self.handle, job_id.encode(), token.encode(),
                     dtype.encode(), str(out_path).encode())

    def attach(self, job_id, rank, token, takeover=False, transport="auto"):
        """Attaches `rank` of the job and returns its Session. transport: "auto" (shared memory when
        the daemon is on this host), "shm" or "grpc"."""
        handle = ctypes.c_void_p()
        _native.call("muond_attach", self.handle, job_id.encode(), int(rank), token.encode(),
                     1 if takeover else 0, transport.encode(), ctypes.byref(handle))
        return Session(self, handle, job_id, rank)

    def checkpoint_save(self, job_id, token):
        """Saves a checkpoint generation of the job; returns (generation, step) once it is
        durable."""
        generation, step = ctypes.c_int64(-1), ctypes.c_int64(-1)
        _native.call("muond_checkpoint_save", self.handle, job_id.encode(), token.encode(),
                     ctypes.byref(generation), ctypes.byref(step))
        return generation.value, step.value

    def checkpoint_load(self, job_id, token, generation=-1, step=-1):
        """Loads generation `generation` (>= 1), or the one saved at `step` (>= 0), or the newest
        good one (both -1). Returns (loaded_generation, next_step)."""
        loaded, next_step = ctypes.c_int64(-1), ctypes.c_int64(-1)
        _native.call("muond_checkpoint_load", self.handle, job_id.encode(), token.encode(),
                     int(generation), int(step), ctypes.byref(loaded), ctypes.byref(next_step))
        return loaded.value, next_step.value


class Session:
    """One attached rank of a job. Steps go up by one from `next_step`; step t's shared-memory
    buffers are those of t % B, B the job's "step_buffers" (1 or 2)."""

    def __init__(self, client, handle, job_id, rank):
        self.client = client  # keeps the connection alive as long as the session
        self.job_id = job_id
        self.rank = rank
        self._handle = handle
        lib = _native.lib()
        self.is_shm = bool(lib.muond_session_is_shm(handle))
        self.next_step = int(lib.muond_session_next_step(handle))
        n = lib.muond_session_spans(handle, None, 0)
        array = (ShardSpan * max(n, 1))()
        lib.muond_session_spans(handle, array, n)
        self.spans = _spans_tuple(array, n)
        self.buffer_elements = int(lib.muond_session_buffer_elements(handle))
        self._views = {}
        self._param_offsets = None

    @property
    def handle(self):
        if self._handle is None:
            raise MuondError(_native.CODES["FAILED_PRECONDITION"],
                             f"the session of rank {self.rank} of job '{self.job_id}' is closed",
                             "session")
        return self._handle

    def close(self):
        """Detaches the rank (best effort) and frees the session; its views become invalid."""
        if self._handle is not None:
            self._views.clear()
            _native.lib().muond_session_free(self._handle)
            self._handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _view(self, kind, step, dtype):
        key = (kind, step % 2, dtype)
        view = self._views.get(key)
        if view is None:
            data, size = ctypes.c_void_p(), ctypes.c_size_t()
            name = f"muond_session_{kind}_view"
            _native.call(name, self.handle, step, ctypes.byref(data), ctypes.byref(size))
            raw = (ctypes.c_char * size.value).from_address(data.value)
            elements = self.buffer_elements
            view = torch.frombuffer(raw, dtype=dtype, count=elements) if elements else \
                torch.empty(0, dtype=dtype)
            self._views[key] = view
        return view

    def raw_view(self, kind, step):
        """Step `step`'s "gradient" or "update" buffer as bytes (uint8), its whole size: for
        buffers that hold several dtypes (apply mode's parameters at param_offsets())."""
        key = (kind, step % 2, "raw")
        view = self._views.get(key)
        if view is None:
            view = _bytes_tensor(*_native_view(f"muond_session_{kind}_view", self.handle, step))
            self._views[key] = view
        return view

    def gradient_view(self, step, dtype=torch.float32):
        """Step `step`'s gradient buffer in shared memory as a 1-D tensor of buffer_elements
        elements (the rank's flat-buffer layout): write the gradients here, then step_in_place().
        MuondError FAILED_PRECONDITION for a gRPC session."""
        return self._view("gradient", step, dtype)

    def update_view(self, step, dtype=torch.float32):
        """Step `step`'s update buffer, valid after step_in_place(step) until step + 2 begins.
        The memory is mapped read-only: never write to this tensor."""
        return self._view("update", step, dtype)

    @property
    def last_step_skipped(self):
        """True when the last step that ended on this session (step_in_place, wait_parts,
        step_buffer, step_spans) was skipped: the job has "nonfinite": "skip" and some rank's
        gradients held a NaN or Inf. muond changed nothing and wrote no update (apply mode: no
        new parameters); the next step is the one after it."""
        return bool(_native.lib().muond_session_last_step_skipped(self.handle))

    def last_step_sum_sq(self):
        """Apply mode: the raw sum of squares of the gradients (before the divisor) of the last
        step that ended on this session, on its daemon: a node's share of a multi-node job's
        gradient norm. Update mode with max_grad_norm: the step's whole raw sum of squares (the
        job's matrices and every rank's set_outside_sum_sq)."""
        return float(_native.lib().muond_session_last_step_sum_sq(self.handle))

    def set_global_clip(self, mode, sum_sq=0.0):
        """Apply mode, a node of a multi-node job with max_grad_norm: the global clip of the next
        steps. mode 1: compute with clip 1 and report the node's sum of squares
        (last_step_sum_sq); 2: clip by `sum_sq`, the raw sum of squares over every node; 0: none
        (what such a job refuses)."""
        _native.call("muond_session_set_global_clip", self.handle, int(mode), float(sum_sq))

    def set_outside_sum_sq(self, sum_sq):
        """Update mode, a job with max_grad_norm: the sum of squares of this rank's gradients
        outside the job (the tensors the trainer updates itself; count those several ranks hold
        once), which the next steps carry with their last part. After the step,
        last_step_sum_sq() is the whole norm's raw sum of squares, by which the trainer clips
        its own tensors (reference.clip_coefficient)."""
        _native.call("muond_session_set_outside_sum_sq", self.handle, float(sum_sq))

    def step_in_place(self, step):
        """Submits the gradient view of `step` and waits for the update view."""
        _native.call("muond_step_in_place", self.handle, int(step))

    def post_part(self, step, byte_offset, nbytes, last=False):
        """Sends bytes [byte_offset, byte_offset + nbytes) of the gradient view of `step` (whole
        spans) as a part of the step, without waiting; `last`: the rank's last part (it may be
        empty). Shared memory only."""
        _native.call("muond_step_post", self.handle, int(step), int(byte_offset), int(nbytes),
                     1 if last else 0)

    def progress(self, step, timeout_seconds=-1.0):
        """Waits at most timeout_seconds (< 0: until news) for news of the step in parts; returns
        (ready, ended): ready[i] is True when span i's result of `step` is in the update view
        (final if the step commits), ended when the step ended. A refused part raises."""
        n = len(self.spans)
        ready = (ctypes.c_uint8 * max(n, 1))()
        ended = ctypes.c_int(0)
        _native.call("muond_step_progress", self.handle, int(step), float(timeout_seconds), ready,
                     n, ctypes.byref(ended))
        return [bool(ready[i]) for i in range(n)], bool(ended.value)

    def wait_parts(self, step):
        """Waits for the end of the step sent in parts; raises its refusal. Returns whether the
        daemon answered with the committed result of an earlier try (a replay)."""
        replayed = ctypes.c_int(0)
        _native.call("muond_step_wait", self.handle, int(step), ctypes.byref(replayed))
        return bool(replayed.value)

    def step_buffer(self, step, grads, updates):
        """Flat-buffer step: `grads` and `updates` are contiguous CPU tensors of buffer_elements
        elements in the job's dtype; `updates` receives the update (padding zeroed)."""
        for name, t in (("grads", grads), ("updates", updates)):
            if t.device.type != "cpu" or not t.is_contiguous() or t.numel() != self.buffer_elements:
                raise ValueError(f"{name} must be a contiguous CPU tensor of {self.buffer_elements} "
                                 f"elements, got {tuple(t.shape)} on {t.device}")
        _native.call("muond_step_buffer", self.handle, int(step), grads.data_ptr(),
                     updates.data_ptr())

    def step_spans(self, step, grads, updates):
        """Span step: grads/updates are lists of (matrix, offset, tensor) with contiguous CPU
        tensors; together they must cover the rank's spans."""
        ins = (Span * max(len(grads), 1))()
        outs = (Span * max(len(updates), 1))()
        for array, items in ((ins, grads), (outs, updates)):
            for i, (matrix, offset, t) in enumerate(items):
                if t.device.type != "cpu" or not t.is_contiguous():
                    raise ValueError("span tensors must be contiguous CPU tensors")
                array[i] = Span(matrix, offset, t.data_ptr(), t.numel())
        _native.call("muond_step", self.handle, int(step), ins, len(grads), outs, len(updates))

    # ----- apply mode (DESIGN.md section 4b) -----

    def param_offsets(self):
        """Apply mode, shared memory: for each span (in spans order), the byte offset of its
        parameters (in the tensor's param_dtype) in the update buffer and in the init view.
        Stage 1/2 jobs of one param dtype: the partition from byte 0. MuondError
        FAILED_PRECONDITION over gRPC, whose flat buffers are laid out as the gradients'."""
        if self._param_offsets is None:
            fn = _native.function("muond_session_param_byte_offset")
            out = []
            for i in range(len(self.spans)):
                offset = ctypes.c_uint64()
                _native.check(fn(self.handle, i, ctypes.byref(offset)),
                              "muond_session_param_byte_offset")
                out.append(offset.value)
            self._param_offsets = tuple(out)
        return self._param_offsets

    def set_hyper(self, groups, lr, weight_decay=None, grad_divisor=1.0, absent=None):
        """Apply mode: the hyperparameters of the next step, per job group: `groups` (names),
        `lr` (one per group), `weight_decay` (one per group; None: the groups' job values) and
        the gradient divisor (the gradients are divided by it before anything else); `absent`
        (not None): the presence mask, see set_absent."""
        if absent is not None:
            self.set_absent(absent)
        n = len(groups)
        if len(lr) != n or (weight_decay is not None and len(weight_decay) != n):
            raise ValueError(f"{n} groups, {len(lr)} lr and "
                             f"{'no' if weight_decay is None else len(weight_decay)} weight_decay")
        names = (ctypes.c_char_p * max(n, 1))(*[g.encode() for g in groups])
        lrs = (ctypes.c_double * max(n, 1))(*[float(x) for x in lr])
        wds = None if weight_decay is None else \
            (ctypes.c_double * max(n, 1))(*[float(x) for x in weight_decay])
        _native.call("muond_session_set_hyper", self.handle, names, lrs, wds, n,
                     float(grad_divisor))

    def set_absent(self, tensors):
        """Apply mode: the job tensors (indices) with no gradient on any rank in the next steps:
        each is skipped (master, optimizer state and step count unchanged, its parameters
        returned as they were); empty: every tensor has one. Their gradient bytes are still sent
        (send zeros). Every rank of a step must send the same set."""
        tensors = [int(t) for t in tensors]
        arr = (ctypes.c_uint32 * max(len(tensors), 1))(*tensors)
        _native.call("muond_session_set_absent", self.handle, arr, len(tensors))

    def set_max_logits(self, values):
        """QK-Clip (DESIGN.md 4e), a job with qk_clip pairs: the largest pre-softmax attention
        logit of each query head this rank saw in the next step's forward, pair after pair in
        the job's order (q_heads values each); a sequence of floats or a tensor. The daemon takes
        the maximum over the ranks. Set it before each step."""
        if isinstance(values, torch.Tensor):
            values = values.detach().to("cpu", torch.float32).reshape(-1).tolist()
        values = [float(v) for v in values]
        arr = (ctypes.c_float * max(len(values), 1))(*values)
        _native.call("muond_session_set_max_logits", self.handle, arr, len(values))

    def init_view(self, dtype=torch.uint8):
        """Apply mode, shared memory: where this rank's initial parameters go (gradient buffer 0),
        each span's in its param_dtype at param_offsets(); then init_params_in_place(). A 1-D
        tensor of `dtype` over the whole buffer."""
        key = ("init", dtype)
        view = self._views.get(key)
        if view is None:
            raw = _bytes_tensor(*_native_view("muond_session_init_view", self.handle))
            view = raw if dtype == torch.uint8 else \
                raw[:raw.numel() // _itemsize(dtype) * _itemsize(dtype)].view(dtype)
            self._views[key] = view
        return view

    def init_params_in_place(self):
        """Apply mode, shared memory: submits the initial parameters written to init_view()."""
        _native.call("muond_init_params_in_place", self.handle)

    def init_params_buffer(self, params, float32=False):
        """Apply mode: this rank's initial parameters as one contiguous CPU buffer laid out as the
        step buffers (float32 when `float32`, else the job's one param dtype)."""
        if params.device.type != "cpu" or not params.is_contiguous():
            raise ValueError("params must be a contiguous CPU tensor")
        _native.call("muond_init_params_buffer", self.handle, params.data_ptr(),
                     1 if float32 else 0)

    def init_params_spans(self, params, float32=False):
        """Apply mode: initial parameters as (matrix, offset, tensor) runs (contiguous CPU
        tensors, float32 when `float32`, else each tensor's param dtype) covering the rank's
        spans."""
        array = (Span * max(len(params), 1))()
        for i, (matrix, offset, t) in enumerate(params):
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("span tensors must be contiguous CPU tensors")
            array[i] = Span(matrix, offset, t.data_ptr(), t.numel())
        _native.call("muond_init_params", self.handle, array, len(params), 1 if float32 else 0)


def _itemsize(dtype):
    return torch.empty(0, dtype=dtype).element_size()


def _native_view(name, *args):
    data, size = ctypes.c_void_p(), ctypes.c_size_t()
    _native.call(name, *args, ctypes.byref(data), ctypes.byref(size))
    return data.value, size.value


def _bytes_tensor(address, size):
    if not size:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_char * size).from_address(address), dtype=torch.uint8)
