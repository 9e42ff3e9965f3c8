"""QK-Clip (MuonClip, DESIGN.md 4e) from the trainer's side.

In apply mode muond holds the fp32 master weights, so QK-Clip runs there: the job names its
attention pairs (the query and key projection of each attention), and every step carries, per
pair, the largest pre-softmax attention logit of each query head seen in that step's forward.
muond takes the maximum over the ranks and, after the step's update, rescales the heads whose
maximum exceeded the threshold; the parameters every rank receives are the clipped ones.

    opt = MuonWithAuxAdam(groups, mode="apply", qk_clip={
        "threshold": 100.0, "alpha": 0.5,
        "pairs": [{"q": attn.q_proj.weight, "k": attn.k_proj.weight,
                   "q_heads": 8, "kv_heads": 2, "head_dim": 64}, ...]})
    recorder = MaxLogitRecorder()
    ... in the attention's forward:
        recorder.record(attn.q_proj.weight, head_max_logits(q, k, scale, causal=True))
    ... after backward:
        opt.step(max_logits=recorder.take())

head_max_logits computes the per-head maxima of q kᵀ * scale (grouped-query attention: query head
h reads key head h // (H / G)); MaxLogitRecorder keeps the elementwise maximum of what one
forward recorded per attention (several micro-batches, several calls). For
torch.nn.MultiheadAttention with separate projections (kdim or vdim given, so q_proj_weight and
k_proj_weight are parameters of their own; a fused in_proj_weight cannot be a pair),
multihead_attention_pair gives the pair and watch_multihead_attention records each forward's
maxima by wrapping its forward.
"""

import math

import torch


def job_block(qk_clip, names):
    """The job.json "qk_clip" block of `qk_clip` ({"threshold", "alpha" (0.5), "pairs": [{"q",
    "k", "q_heads", "kv_heads", "head_dim"}]}, q and k parameters or their names), and the pairs'
    (q parameter or name, q_heads) in order. `names` maps each parameter to its job name.
    ValueError for anything muond would refuse that can be seen here (muond checks the rest:
    shapes, optimizers)."""
    if not isinstance(qk_clip, dict):
        raise ValueError(f"qk_clip must be a dict, not {type(qk_clip).__name__}")
    unknown = set(qk_clip) - {"threshold", "alpha", "pairs"}
    if unknown:
        raise ValueError(f"qk_clip: unknown keys {sorted(unknown)}")
    threshold = float(qk_clip.get("threshold", float("nan")))
    alpha = float(qk_clip.get("alpha", 0.5))
    if not math.isfinite(threshold) or threshold <= 0:
        raise ValueError(f"qk_clip: threshold must be finite and > 0, not {threshold!r}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"qk_clip: alpha must be in [0, 1], not {alpha!r}")
    pairs = qk_clip.get("pairs") or []
    if not pairs:
        raise ValueError("qk_clip: at least one pair is needed")

    def name_of(t, key, i):
        if isinstance(t, str):
            return t
        if t not in names:
            raise ValueError(f"qk_clip.pairs[{i}].{key}: not a parameter of the optimizer")
        return names[t]

    block, order = [], []
    for i, p in enumerate(pairs):
        missing = {"q", "k", "q_heads", "kv_heads", "head_dim"} - set(p)
        if missing:
            raise ValueError(f"qk_clip.pairs[{i}]: missing {sorted(missing)}")
        heads = int(p["q_heads"])
        block.append({"q": name_of(p["q"], "q", i), "k": name_of(p["k"], "k", i),
                      "q_heads": heads, "kv_heads": int(p["kv_heads"]),
                      "head_dim": int(p["head_dim"])})
        order.append((p["q"], heads))
    return {"threshold": threshold, "alpha": alpha, "pairs": block}, order


def flatten_max_logits(order, names, max_logits):
    """The per-head maxima of a step, pair after pair, from {q parameter (or its name): H
    values}. ValueError naming the pair for a missing or extra key, a wrong count or a value that
    is not finite."""
    if not isinstance(max_logits, dict):
        raise ValueError("max_logits must be a dict {q parameter: per-head maxima}")
    by_name = {}
    for key, values in max_logits.items():
        by_name[key if isinstance(key, str) else names.get(key, id(key))] = values
    out = []
    seen = set()
    for q, heads in order:
        name = q if isinstance(q, str) else names[q]
        if name not in by_name:
            raise ValueError(f"max_logits: no values for QK-Clip pair q='{name}' ({heads} heads)")
        values = by_name[name]
        if isinstance(values, torch.Tensor):
            values = values.detach().to("cpu", torch.float32).reshape(-1).tolist()
        values = [float(v) for v in values]
        if len(values) != heads:
            raise ValueError(f"max_logits: pair q='{name}' has {heads} query heads, got "
                             f"{len(values)} values")
        bad = [h for h, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            raise ValueError(f"max_logits: head {bad[0]} of pair q='{name}' is {values[bad[0]]}")
        out.extend(values)
        seen.add(name)
    extra = [k for k in by_name if k not in seen]
    if extra:
        raise ValueError(f"max_logits: {extra[0]!r} is not the q tensor of a QK-Clip pair")
    return out


def head_max_logits(q, k, scale=None, causal=False):
    """Per query head, the largest pre-softmax logit (q kᵀ) * scale over the batch and positions:
    q [B, H, T, d], k [B, G, T_k, d] with G dividing H (query head h reads key head h // (H/G));
    scale defaults to 1/sqrt(d); causal: only key positions j <= i count. A float32 tensor [H]
    (detached: it costs one extra q kᵀ, under no_grad)."""
    with torch.no_grad():
        b, h, t, d = q.shape
        g = k.shape[1]
        if h % g != 0:
            raise ValueError(f"{g} key heads do not divide {h} query heads")
        if scale is None:
            scale = 1.0 / math.sqrt(d)
        kk = k.repeat_interleave(h // g, dim=1) if g != h else k
        logits = torch.matmul(q.float(), kk.float().transpose(-1, -2)) * scale
        if causal:
            tk = kk.shape[2]
            mask = torch.ones(t, tk, dtype=torch.bool, device=q.device).tril(tk - t)
            logits = logits.masked_fill(~mask, float("-inf"))
        return logits.amax(dim=(0, 2, 3)).to("cpu", torch.float32)


def multihead_attention_pair(mha):
    """The QK-Clip pair of a torch.nn.MultiheadAttention whose query and key projections are
    parameters of their own (built with kdim/vdim): {"q", "k", "q_heads", "kv_heads",
    "head_dim"}. ValueError for the fused in_proj_weight (q and k rows of one tensor)."""
    if getattr(mha, "_qkv_same_embed_dim", True) or mha.q_proj_weight is None:
        raise ValueError("this MultiheadAttention projects q, k and v with one in_proj_weight; "
                         "QK-Clip needs q and k as tensors of their own (build it with kdim=/vdim=)")
    return {"q": mha.q_proj_weight, "k": mha.k_proj_weight, "q_heads": mha.num_heads,
            "kv_heads": mha.num_heads, "head_dim": mha.head_dim}


def watch_multihead_attention(mha, recorder, key=None):
    """Records, at every forward of `mha` (a torch.nn.MultiheadAttention with separate q and k
    projections), its per-head largest pre-softmax logit into `recorder` under `key` (default its
    q_proj_weight), honouring attn_mask (bool: True is masked; float: added), key_padding_mask
    and is_causal. Returns a handle whose remove() stops it."""
    pair = multihead_attention_pair(mha)
    key = pair["q"] if key is None else key

    def record(module, args, kwargs):
        query = args[0] if args else kwargs["query"]
        keys = args[1] if len(args) > 1 else kwargs["key"]
        with torch.no_grad():
            if not module.batch_first and query.dim() == 3:
                query, keys = query.transpose(0, 1), keys.transpose(0, 1)
            if query.dim() == 2:
                query, keys = query.unsqueeze(0), keys.unsqueeze(0)
            b, t, _ = query.shape
            h, d = module.num_heads, module.head_dim
            bias = module.in_proj_bias
            bq, bk = (None, None) if bias is None else (bias[:h * d], bias[h * d:2 * h * d])
            q = torch.nn.functional.linear(query, module.q_proj_weight, bq)
            k = torch.nn.functional.linear(keys, module.k_proj_weight, bk)
            q = q.view(b, t, h, d).transpose(1, 2)
            k = k.view(b, keys.shape[1], h, d).transpose(1, 2)
            logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(d)
            mask = kwargs.get("attn_mask", args[5] if len(args) > 5 else None)
            if mask is not None:
                mask = mask.view(-1, h, t, keys.shape[1]) if mask.dim() == 3 else mask
                logits = logits.masked_fill(mask, float("-inf")) if mask.dtype == torch.bool \
                    else logits + mask.float()
            padding = kwargs.get("key_padding_mask", args[3] if len(args) > 3 else None)
            if padding is not None:
                logits = logits.masked_fill(padding.bool()[:, None, None, :], float("-inf"))
            if kwargs.get("is_causal", False):
                causal = torch.ones(t, keys.shape[1], dtype=torch.bool,
                                    device=logits.device).tril()
                logits = logits.masked_fill(~causal, float("-inf"))
            recorder.record(key, logits.amax(dim=(0, 2, 3)))

    # torch 1.13's forward pre-hooks do not see keyword arguments (masks, is_causal): the forward
    # is wrapped on the instance instead.
    original = mha.forward

    def forward(*args, **kwargs):
        record(mha, args, kwargs)
        return original(*args, **kwargs)

    mha.forward = forward
    return _Unwatch(mha, original)


class _Unwatch:
    """What watch_multihead_attention returns: remove() restores the module's forward."""

    def __init__(self, module, original):
        self._module, self._original = module, original

    def remove(self):
        if self._module is not None:
            self._module.forward = self._original
            self._module = None


class MaxLogitRecorder:
    """The per-head maxima of one step's forward passes, by attention: record() keeps the
    elementwise maximum of what was recorded for a key (a q parameter) since the last take()."""

    def __init__(self):
        self._max = {}

    def record(self, key, values):
        values = values.detach().to("cpu", torch.float32).reshape(-1)
        old = self._max.get(key)
        self._max[key] = values.clone() if old is None else torch.maximum(old, values)

    def take(self):
        """{key: per-head maxima} of the step, and starts the next."""
        out, self._max = self._max, {}
        return out
