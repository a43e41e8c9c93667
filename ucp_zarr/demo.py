"""The demo job: train a small GPT-like model, checkpoint it, resume from the checkpoint.

The resumed run's losses must equal the uninterrupted run's bit for bit.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass

import torch
from torch import nn

from .api import load, save
from .checkpoint import open as open_checkpoint


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 96
    dim: int = 64
    heads: int = 4
    layers: int = 2
    seq: int = 32


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.norm1 = nn.LayerNorm(c.dim)
        self.qkv = nn.Linear(c.dim, 3 * c.dim)
        self.proj = nn.Linear(c.dim, c.dim)
        self.norm2 = nn.LayerNorm(c.dim)
        self.fc1 = nn.Linear(c.dim, 4 * c.dim)
        self.fc2 = nn.Linear(4 * c.dim, c.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class TinyGPT(nn.Module):
    def __init__(self, c: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab, c.dim)
        self.wpe = nn.Embedding(c.seq, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def batch(step: int, c: GPTConfig, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic synthetic data for ``step``: a noisy counting sequence to learn."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, c.vocab, (size, 1), generator=g)
    seq = (start + torch.arange(c.seq + 1)) % c.vocab
    noise = torch.randint(0, c.vocab, seq.shape, generator=g)
    seq = torch.where(torch.rand(seq.shape, generator=g) < 0.1, noise, seq)
    return seq[:, :-1], seq[:, 1:]


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, c: GPTConfig) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step, c)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def make(seed: int, c: GPTConfig) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyGPT(c)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def run(steps: int = 20, save_at: int = 10, directory: str | None = None) -> bool:
    """Train, save at ``save_at``, resume a fresh model from the checkpoint, compare losses."""
    c = GPTConfig()
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        path = f"{tmp}/step_{save_at}"
        model, opt = make(0, c)
        ref = train(model, opt, range(save_at), c)
        t0 = time.perf_counter()
        save({"model": model.state_dict(), "optim": opt.state_dict(), "step": save_at}, path)
        t_save = time.perf_counter() - t0
        ref += train(model, opt, range(save_at, steps), c)

        ck = open_checkpoint(path)
        print(ck)
        model2, opt2 = make(1, c)
        train(model2, opt2, range(1), c)  # creates the optimizer state to load into
        state = {"model": model2.state_dict(), "optim": opt2.state_dict(), "step": 0}
        t0 = time.perf_counter()
        load(state, path)
        t_load = time.perf_counter() - t0
        opt2.load_state_dict(state["optim"])
        resumed = train(model2, opt2, range(state["step"], steps), c)

    print(f"\nsaved at step {save_at} in {t_save * 1e3:.0f} ms, loaded in {t_load * 1e3:.0f} ms")
    print(f"{'step':>5} {'reference':>12} {'resumed':>12}")
    for i in range(save_at, steps):
        print(f"{i:>5} {ref[i]:>12.6f} {resumed[i - save_at]:>12.6f}")
    same = ref[save_at:] == resumed and all(math.isfinite(v) for v in resumed)
    print("resumed losses equal the reference bit for bit" if same else "MISMATCH between resumed and reference")
    return same
