"""The model and the data of train_tiny_gpt.py: a small character-level GPT (TinyGPT, its blocks
with optional separate query and key projections for QK-Clip), its MuonWithAuxAdam parameter groups
and the batches of the GNU GPL v3 text, a function of (seed, step, rank) only."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

TEXT = "/usr/share/common-licenses/GPL-3"


class Block(nn.Module):
    def __init__(self, d, heads, block_size, split_qk=False):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        # QK-Clip (--qk-clip) names the query and key projections as tensors of their own; the
        # block then records each forward's largest attention logit per head (max_logits).
        self.split_qk = split_qk
        self.max_logits = None
        if split_qk:
            self.q = nn.Linear(d, d, bias=False)
            self.k = nn.Linear(d, d, bias=False)
            self.v = nn.Linear(d, d, bias=False)
        else:
            self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.fc_out = nn.Linear(4 * d, d, bias=False)
        mask = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (self.q(h), self.k(h), self.v(h)) if self.split_qk else self.qkv(h).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
        if self.split_qk:  # per head, the largest pre-softmax logit of this forward
            self.max_logits = att.detach().float().amax(dim=(0, 2, 3))
        att = att.softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab, d=128, layers=2, heads=4, block_size=64, split_qk=False):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block_size, d)
        self.blocks = nn.ModuleList(Block(d, heads, block_size, split_qk) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        # The loss in float32 whatever the parameters' dtype (a no-op for float32 models).
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def param_groups(model, muon_lr, adam_lr, weight_decay, qk_lr_mult=1.0):
    """MuonWithAuxAdam groups: the blocks' 2-D weights to Muon, everything else to AdamW;
    qk_lr_mult != 1 puts the query and key projections (split_qk) in a Muon group of their own
    with that multiple of the Muon lr (attention logits then grow fast: what QK-Clip is for)."""
    hidden = [(n, p) for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() >= 2]
    qk = [(n, p) for n, p in hidden if n.endswith((".q.weight", ".k.weight"))] \
        if qk_lr_mult != 1.0 else []
    qk_ids = {id(p) for _, p in qk}
    hidden_ids = {id(p) for _, p in hidden}
    other = [(n, p) for n, p in model.named_parameters() if id(p) not in hidden_ids]
    groups = [dict(params=[(n, p) for n, p in hidden if id(p) not in qk_ids], use_muon=True,
                   lr=muon_lr, weight_decay=weight_decay)]
    if qk:
        groups.append(dict(params=qk, use_muon=True, lr=muon_lr * qk_lr_mult,
                           weight_decay=weight_decay))
    return groups + [dict(params=other, use_muon=False, lr=adam_lr, betas=(0.9, 0.95),
                          weight_decay=weight_decay)]


def load_text():
    with open(TEXT, encoding="utf-8") as f:
        text = f.read()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), len(chars)


def batch(data, step, rank, batch_size, block_size, seed):
    """The batch of `rank` at `step`: a function of (seed, step, rank) only, so a resumed run sees
    the same batches."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    starts = torch.randint(0, data.numel() - block_size - 1, (batch_size,), generator=g)
    x = torch.stack([data[s:s + block_size] for s in starts])
    y = torch.stack([data[s + 1:s + block_size + 1] for s in starts])
    return x, y
