"""The rule language: :class:`Rules` (our vocabulary and DeepSpeed's ``universal_checkpoint_info``)
and :func:`place`, checked against an independent reference sharding (single process)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import ucp_zarr
from ucp_zarr import FlatShard, Placed, RuleError, Rules, place
from ucp_zarr.layout import Box
from ucp_zarr.layout.pieces import Piece
from ucp_zarr.rules.params import ParamRule, Renumber, same_meaning

# --- an independent reference ------------------------------------------------------------


def view(local: torch.Tensor, p: Piece) -> torch.Tensor:
    """The region of ``local`` that ``p`` names (as ``Piece``'s docstring says): its base view
    (``local``, or flat elements ``[base[0], base[0] + prod(base[1]))`` viewed as ``base[1]``),
    then ``src`` taken with ``step``."""
    base = local
    if p.base is not None:
        start, shape = p.base
        base = local.reshape(-1)[start : start + math.prod(shape)].reshape(shape)
    step = p.step or (1,) * len(p.src.shape)
    return base[tuple(slice(o, o + (n - 1) * s + 1 if n else o, s) for o, n, s in zip(p.src.offset, p.src.shape, step))]


def dst(p: Piece) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(p.dst.offset, p.dst.shape))


def shard(g: torch.Tensor, how: tuple[Any, ...], r: int, tp: int) -> torch.Tensor:
    """Rank ``r``'s local tensor of the (padded) global ``g`` as the trainer holds it."""
    kind = how[0]
    if kind == "rep":
        return g.clone()
    if kind == "split":  # even split along how[1]
        return torch.chunk(g, tp, how[1])[r].clone()
    if kind == "halves":  # Megatron SwiGLU [gate; up]: each half split over the ranks
        return torch.cat([h.chunk(tp, 0)[r] for h in g.chunk(2, 0)]).clone()
    if kind == "sub":  # sub-parameters of ``sizes`` along dim 0, rank r holds widths[j][r] rows of each
        _, sizes, widths = how
        parts, at = [], 0
        for n, w in zip(sizes, widths):
            lo = at + sum(w[:r])
            parts.append(g[lo : lo + w[r]])
            at += n
        return torch.cat(parts).clone()
    raise AssertionError(kind)


def assemble(placed: list[Placed]) -> torch.Tensor:
    """The consolidated tensor from every rank's pieces: each element held by exactly one rank,
    or (replicated, averaged) the whole tensor held equally by every rank."""
    first = placed[0]
    assert {(p.key, p.global_shape) for p in placed} == {(first.key, first.global_shape)}
    if len(placed) > 1 and all(p.replicated or p.average for p in placed):
        wholes = [assemble([p]) for p in placed]
        assert all(torch.equal(w, wholes[0]) for w in wholes)
        return wholes[0]
    out = torch.zeros(first.global_shape, dtype=first.local.dtype)
    seen = torch.zeros(first.global_shape, dtype=torch.int64)
    for pl in placed:
        for p in pl.pieces:
            out[dst(p)] = view(pl.local, p)
            seen[dst(p)] += 1
    assert bool((seen == 1).all()), "the ranks' pieces do not tile the consolidated tensor"
    return out


def check_local(pl: Placed, padded: torch.Tensor) -> None:
    """Each piece (and padding piece) holds what the padded global tensor holds at its
    destination, and every local element is in exactly one of them."""
    for p in pl.pieces + pl.pad:
        assert torch.equal(view(pl.local, p), padded[dst(p)]), p
    for p in pl.pad:
        assert p.dst.offset[0] >= pl.global_shape[0], f"padding piece {p} inside the consolidated rows"
    idx = torch.arange(pl.local.numel()).reshape(pl.local.shape)
    used = [view(idx, p).reshape(-1) for p in pl.pieces + pl.pad]
    used_all = torch.cat(used) if used else torch.zeros(0, dtype=torch.int64)
    assert torch.equal(used_all.sort().values, torch.arange(pl.local.numel())), "local elements used != once"


def run_tp(params: dict[str, tuple[torch.Tensor, tuple[Any, ...]]], rules: Rules, tp: int, **kw: int) -> dict[str, list[Placed]]:
    """Place every TP rank's reference state dict (top-level FQNs); Placed per name, by rank."""
    out: dict[str, list[Placed]] = {n: [] for n in params}
    for r in range(tp):
        placed = place({n: shard(g, how, r, tp) for n, (g, how) in params.items()}, rules, tp_rank=r, tp_size=tp, **kw)
        for n in params:
            out[n].append(placed[n])
    return out


def check_all(placed: dict[str, list[Placed]], params: dict[str, tuple[torch.Tensor, tuple[Any, ...]]],
              vocab: dict[str, int]) -> None:
    """Each consolidated tensor assembled from all ranks is the global one (vocab rows stripped)."""
    for n, (g, _) in params.items():
        want = g[: vocab[n]] if n in vocab else g
        assert torch.equal(assemble(placed[n]), want), n
        for pl in placed[n]:
            assert pl.key == n
            check_local(pl, g)
            if n not in vocab:
                assert pl.pad == ()


def rnd(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


# --- 1. the vocabulary -------------------------------------------------------------------

L = r"decoder\.layers\.\d+\."


def strided_pieces(r: int) -> list[dict[str, Any]]:
    """Rank r of 2 holds columns 3r:3r+3 of a (4, 6) tensor, global rows 0:2 in its even rows
    and rows 2:4 in its odd rows."""
    return [
        {"dst": {"offset": [0, 3 * r], "shape": [2, 3]}, "src": {"offset": [0, 0], "shape": [2, 3], "step": [2, 1]}},
        {"dst": {"offset": [2, 3 * r], "shape": [2, 3]}, "src": {"offset": [1, 0], "shape": [2, 3], "step": [2, 1]}},
    ]


FULL: dict[str, Any] = {
    "format": "ucp_zarr.rules/1",
    "params": [
        {"kind": "split", "patterns": [L + r"self_attention\.linear_proj\.weight", L + r"mlp\.linear_fc2\.weight"], "dim": 1},
        {"kind": "split", "patterns": [L + r"mlp\.experts\.weight\d"], "dim": 0, "axis": "ep"},
        {"kind": "fused", "patterns": [L + r"self_attention\.linear_qkv\.weight"], "dim": 0, "sizes": [8, -1, -1]},
        {"kind": "fused", "patterns": [L + r"mlp\.linear_fc1\.weight"], "dim": 0, "sizes": [6, 6],
         "widths": {"3": [[3, 2, 1], [2, 2, 2]]}},
        {"kind": "replicated", "patterns": [L + r"input_layernorm\.weight", r"decoder\.final_layernorm\.weight"]},
        {"kind": "average", "patterns": [L + r"mlp\.router\.expert_bias"]},
        {"kind": "pieces", "patterns": [r"interleaved\.weight"], "shape": [4, 6],
         "pieces": {"2": [strided_pieces(0), strided_pieces(1)]}},
    ],
    "vocab": {"patterns": [r"embedding\.word_embeddings\.weight", r"output_layer\.weight"], "size": 50},
    "rename": [{"pattern": r"output_layer\.weight", "to": "embedding.word_embeddings.weight"}],
    "pipeline": {"pattern": r"decoder\.layers\.(\d+)\.", "num_layers": 4},
    "pipeline_replicated": [r"output_layer\.weight"],
    "experts": {"pattern": r"decoder\.layers\.\d+\.mlp\.experts\.local_experts\.(\d+)\.", "num_experts": 8},
    "default": "error",
    "strict": False,
}
FULL_OFFSETS = FULL | {"pipeline": {"pattern": r"decoder\.layers\.(\d+)\.", "offsets": [0, 3]}, "default": "replicated",
                       "strict": True}

FULL_TOML = r"""
format = "ucp_zarr.rules/1"
pipeline_replicated = ['output_layer\.weight']
default = "error"
strict = false

[[params]]
kind = "split"
patterns = ['decoder\.layers\.\d+\.self_attention\.linear_proj\.weight', 'decoder\.layers\.\d+\.mlp\.linear_fc2\.weight']
dim = 1

[[params]]
kind = "split"
patterns = ['decoder\.layers\.\d+\.mlp\.experts\.weight\d']
dim = 0
axis = "ep"

[[params]]
kind = "fused"
patterns = ['decoder\.layers\.\d+\.self_attention\.linear_qkv\.weight']
dim = 0
sizes = [8, -1, -1]

[[params]]
kind = "fused"
patterns = ['decoder\.layers\.\d+\.mlp\.linear_fc1\.weight']
dim = 0
sizes = [6, 6]
widths = { "3" = [[3, 2, 1], [2, 2, 2]] }

[[params]]
kind = "replicated"
patterns = ['decoder\.layers\.\d+\.input_layernorm\.weight', 'decoder\.final_layernorm\.weight']

[[params]]
kind = "average"
patterns = ['decoder\.layers\.\d+\.mlp\.router\.expert_bias']

[[params]]
kind = "pieces"
patterns = ['interleaved\.weight']
shape = [4, 6]

[params.pieces]
"2" = [
  [{ dst = { offset = [0, 0], shape = [2, 3] }, src = { offset = [0, 0], shape = [2, 3], step = [2, 1] } },
   { dst = { offset = [2, 0], shape = [2, 3] }, src = { offset = [1, 0], shape = [2, 3], step = [2, 1] } }],
  [{ dst = { offset = [0, 3], shape = [2, 3] }, src = { offset = [0, 0], shape = [2, 3], step = [2, 1] } },
   { dst = { offset = [2, 3], shape = [2, 3] }, src = { offset = [1, 0], shape = [2, 3], step = [2, 1] } }],
]

[vocab]
patterns = ['embedding\.word_embeddings\.weight', 'output_layer\.weight']
size = 50

[[rename]]
pattern = 'output_layer\.weight'
to = "embedding.word_embeddings.weight"

[pipeline]
pattern = 'decoder\.layers\.(\d+)\.'
num_layers = 4

[experts]
pattern = 'decoder\.layers\.\d+\.mlp\.experts\.local_experts\.(\d+)\.'
num_experts = 8
"""


@pytest.mark.parametrize("d", [FULL, FULL_OFFSETS], ids=["num_layers", "offsets"])
def test_round_trip(d: dict[str, Any]) -> None:
    """from_dict(to_dict()) gives equal rules, through JSON too; every kind and member survives."""
    rules = Rules.from_dict(d)
    out = rules.to_dict()
    assert Rules.from_dict(out) == rules
    assert Rules.from_dict(json.loads(json.dumps(out))) == rules
    assert [r.kind for r in rules.params] == ["split", "split", "fused", "fused", "replicated", "average", "pieces"]
    assert rules.params[0].dim == 1 and rules.params[1].axis == "ep" and rules.params[2].sizes == (8, -1, -1)
    assert rules.params[3].widths == {3: ((3, 2, 1), (2, 2, 2))}
    assert rules.params[6].pieces[2][0][0] == Piece(Box((0, 0), (2, 3)), Box((0, 0), (2, 3)), (2, 1))
    assert (rules.vocab_size, rules.rename, rules.default, rules.strict) == (
        50, ((r"output_layer\.weight", "embedding.word_embeddings.weight"),), d["default"], d["strict"])
    assert rules.experts == Renumber(FULL["experts"]["pattern"], 8)
    if "offsets" in d["pipeline"]:
        assert rules.pipeline == Renumber(FULL["pipeline"]["pattern"], offsets=(0, 3))
    else:
        assert rules.pipeline == Renumber(FULL["pipeline"]["pattern"], 4)


def test_load_json_and_toml(tmp_path) -> None:
    """Rules.load reads JSON and (hand-written) TOML to the same rules."""
    (tmp_path / "r.json").write_text(json.dumps(FULL))
    (tmp_path / "r.toml").write_text(FULL_TOML)
    want = Rules.from_dict(FULL)
    assert Rules.load(tmp_path / "r.json") == want
    assert Rules.load(tmp_path / "r.toml") == want
    (tmp_path / "bad.toml").write_text("params = [")
    (tmp_path / "bad.json").write_text("{")
    for bad in ("bad.toml", "bad.json"):
        with pytest.raises(RuleError, match="not valid"):
            Rules.load(tmp_path / bad)


def _piece(o: list[int], n: list[int]) -> dict[str, Any]:
    return {"dst": {"offset": o, "shape": n}, "src": {"offset": [0] * len(o), "shape": n}}


@pytest.mark.parametrize("d, match", [
    ({"params": [], "bogus": 1}, "unknown member"),
    ({"params": [{"kind": "split", "patterns": ["a"], "bogus": 1}]}, "unknown member"),
    ({"vocab": {"patterns": ["a"], "size": 3, "padded": 4}}, "unknown member"),
    ({"pipeline": {"pattern": r"l\.(\d+)", "layers": 4}}, "unknown member"),
    ({"params": [{"kind": "column", "patterns": ["a"]}]}, "unknown rule kind"),
    ({"params": [{"kind": "split", "patterns": ["a("]}]}, "not a regular expression"),
    ({"vocab": {"patterns": ["[a"], "size": 3}}, "not a regular expression"),
    ({"rename": [{"pattern": "(", "to": "x"}]}, "not a regular expression"),
    ({"pipeline_replicated": ["a)"]}, "not a regular expression"),
    ({"params": [{"kind": "fused", "patterns": ["a"], "dim": 0}]}, "needs the sub-parameter sizes"),
    ({"pipeline": {"pattern": r"layers\.\d+\.", "num_layers": 4}}, "needs a group"),
    ({"experts": {"pattern": r"experts\.\d+\.", "num_experts": 4}}, "needs a group"),
    ({"pipeline": {"pattern": r"layers\.(\d+)\."}}, "exactly one of"),
    ({"pipeline": {"pattern": r"layers\.(\d+)\.", "num_layers": 4, "offsets": [0, 2]}}, "exactly one of"),
    ({"vocab": {"patterns": ["a"]}}, "unpadded"),
    ({"default": "column"}, "default must be"),
    ({"format": "ucp_zarr.rules/9"}, "format"),
    ({"params": [{"kind": "split"}]}, r"params\[0\] \(split rule None\): needs 'patterns'"),
    ({"params": [{"kind": "split", "patterns": []}]}, "list of pattern strings"),
    ({"params": [{"kind": "split", "patterns": ["a"], "dim": "x"}]}, r"'dim' must be an integer >= 0, not 'x'"),
    ({"params": [{"kind": "split", "patterns": ["a"], "axis": "dp"}]}, "axis"),
    ({"rename": [{"pattern": "a"}]}, r"rename\[0\]: needs 'to'"),
    ({"params": [{"kind": "pieces", "patterns": ["a"], "shape": [4]}]}, "needs 'shape' and 'pieces'"),
    ({"params": [{"kind": "pieces", "patterns": ["a"], "shape": [4], "pieces": {"2": [[_piece([0], [4])]]}}]},
     "ranks' pieces for TP size 2"),
    ({"params": [{"kind": "pieces", "patterns": ["a"], "shape": [4],
                  "pieces": {"2": [[_piece([0], [2])], [_piece([1], [2])]]}}]}, "overlap"),
    ({"params": [{"kind": "pieces", "patterns": ["a"], "shape": [4],
                  "pieces": {"2": [[_piece([0], [1])], [_piece([2], [2])]]}}]}, "cover 3 of the 4"),
])
def test_malformed(d: dict[str, Any], match: str) -> None:
    """Malformed rules raise RuleError (a CheckpointError and a ValueError) saying what is wrong."""
    with pytest.raises(ucp_zarr.CheckpointError, match=match) as e:
        Rules.from_dict(d)
    assert isinstance(e.value, RuleError) and isinstance(e.value, ValueError)


def test_not_a_mapping() -> None:
    with pytest.raises(RuleError, match="mapping"):
        Rules.from_dict([("params", [])])  # type: ignore[arg-type]


@pytest.mark.parametrize("d", [
    pytest.param({"params": [42]}, id="rule-not-a-mapping"),
    pytest.param({"params": "split"}, id="params-a-string"),
    pytest.param({"vocab": ["patterns"]}, id="vocab-a-list"),
    pytest.param({"params": [{"kind": "fused", "patterns": ["a"], "sizes": [2], "widths": [[1, 1]]}]}, id="widths-a-list"),
    pytest.param({"universal_checkpoint_version": 0.2,
                  "parameter_with_sub_params": [{"patterns": ["a"], "shape": 3, "partition_dim": 0}]}, id="ds-shape-int"),
    pytest.param({"universal_checkpoint_version": 0.2,
                  "parameter_with_sub_params": [{"patterns": ["a"], "shape": [3, None], "partition_dim": 0}]},
                 id="ds-shape-none"),
    pytest.param({"universal_checkpoint_version": 0.4,
                  "parameter_with_sub_params": [{"patterns": ["a"], "shape": [(1, 1), -1], "partition_dim": 0}],
                  "sub_param_shard_widths": {"a": 5}}, id="ds-widths-int"),
])
def test_malformed_types(d: dict[str, Any]) -> None:
    """Members of the wrong type are malformed rules too."""
    with pytest.raises(RuleError):
        Rules.from_dict(d)


def test_offsets_are_integers() -> None:
    """Pipeline offsets read from JSON as 2.0 renumber to layer 2, as num_layers=4.0 would."""
    rules = Rules.from_dict({"pipeline": {"pattern": r"layers\.(\d+)\.", "offsets": [0, 2.0]}})
    assert rules.consolidated_name("layers.0.w", pp_rank=1, pp_size=2, ep_rank=0, ep_size=1) == "layers.2.w"


# --- 2. DeepSpeed's universal_checkpoint_info ---------------------------------------------

H, FFN, VOCAB, PADDED = 8, 12, 45, 64


def megatron_llama_info(version: float) -> dict[str, Any]:
    """Megatron-DeepSpeed GPTModelPipe, Llama setup, TP > 1 (spec section 6.1), verbatim patterns."""
    return {
        "universal_checkpoint_version": version,
        "original_vocab_size": VOCAB,
        "padded_vocab_size": PADDED,
        "vocabulary_parameter_patterns": [r"\d+.word_embeddings.weight", r"\d+.lm_head.weight"],
        "pipeline_replicated_parameter_patterns": [],
        "tp_replicated_parameter_patterns": [r"\d+.input_layernorm.weight", r"\d+.post_attention_layernorm.weight",
                                             r"\d+.weight"],
        "parameter_with_row_parallelism_patterns": [r"\d+.mlp.dense_4h_to_h.weight", r"\d+.self_attention.dense.weight"],
        "parameter_with_2_sub_params_cat_dim_0": [r"\d+.mlp.dense_h_to_4h.weight"],
    }


def megatron_llama_params() -> tuple[dict[str, tuple[torch.Tensor, tuple[Any, ...]]], dict[str, tuple[str, str | None, int]]]:
    """Global tensors (vocab ones padded) with their reference sharding; the expected (kind, pattern, dim)."""
    params: dict[str, tuple[torch.Tensor, tuple[Any, ...]]] = {
        "0.word_embeddings.weight": (rnd(PADDED, H), ("split", 0)),
        "4.weight": (rnd(H), ("rep",)),
        "5.lm_head.weight": (rnd(PADDED, H), ("split", 0)),
    }
    expect = {
        "0.word_embeddings.weight": ("split", None, 0),
        "4.weight": ("replicated", r"\d+.weight", 0),
        "5.lm_head.weight": ("split", None, 0),
    }
    for i in (1, 2):
        params |= {
            f"{i}.input_layernorm.weight": (rnd(H), ("rep",)),
            f"{i}.self_attention.query_key_value.weight": (rnd(3 * H, H), ("split", 0)),
            f"{i}.self_attention.dense.weight": (rnd(H, H), ("split", 1)),
            f"{i}.post_attention_layernorm.weight": (rnd(H), ("rep",)),
            f"{i}.mlp.dense_h_to_4h.weight": (rnd(2 * FFN, H), ("halves",)),
            f"{i}.mlp.dense_4h_to_h.weight": (rnd(H, FFN), ("split", 1)),
        }
        expect |= {
            f"{i}.input_layernorm.weight": ("replicated", r"\d+.input_layernorm.weight", 0),
            f"{i}.self_attention.query_key_value.weight": ("split", None, 0),
            f"{i}.self_attention.dense.weight": ("split", r"\d+.self_attention.dense.weight", 1),
            f"{i}.post_attention_layernorm.weight": ("replicated", r"\d+.post_attention_layernorm.weight", 0),
            f"{i}.mlp.dense_h_to_4h.weight": ("fused", r"\d+.mlp.dense_h_to_4h.weight", 0),
            f"{i}.mlp.dense_4h_to_h.weight": ("split", r"\d+.mlp.dense_4h_to_h.weight", 1),
        }
    return params, expect


def check_matches(rules: Rules, expect: dict[str, tuple[str, str | None, int]], placed: dict[str, list[Placed]]) -> None:
    for name, (kind, pattern, dim) in expect.items():
        rule, got = rules.match(name)
        assert (rule.kind, got) == (kind, pattern), name
        if kind in ("split", "fused"):
            assert rule.dim == dim, name
        assert {pl.rule for pl in placed[name]} == {pattern or "(default)"}


@pytest.mark.parametrize("version", [0.2, 0.4])
@pytest.mark.parametrize("tp", [2, 4])
def test_megatron_llama(version: float, tp: int) -> None:
    """Megatron-DeepSpeed's dict: each name gets DeepSpeed's rule; the placed pieces of every
    TP rank rebuild each consolidated tensor exactly, the vocabulary without its padding."""
    info = megatron_llama_info(version)
    rules = Rules.from_deepspeed(info)
    assert Rules.from_dict(info) == rules == Rules.from_deepspeed(megatron_llama_info(0.2))
    assert rules.vocab_size == VOCAB and rules.strict
    fused = rules.match("1.mlp.dense_h_to_4h.weight")[0]
    assert (fused.sizes, fused.widths) == ((-1, -1), {})
    params, expect = megatron_llama_params()
    placed = run_tp(params, rules, tp)
    check_matches(rules, expect, placed)
    vocab = {"0.word_embeddings.weight": VOCAB, "5.lm_head.weight": VOCAB}
    check_all(placed, params, vocab)
    for n in vocab:
        pls = placed[n]
        assert all(pl.meaning == {"kind": "split", "vocab": VOCAB} for pl in pls)
        pad_rows = sorted(row for pl in pls for p in pl.pad for row in range(p.dst.offset[0], p.dst.offset[0] + p.dst.shape[0]))
        assert pad_rows == list(range(VOCAB, PADDED))
        if tp == 4:  # rank 3 holds rows 48:64: all padding
            assert pls[3].pieces == () and pls[3].pad
    assert placed["1.mlp.dense_h_to_4h.weight"][0].meaning == {"kind": "fused", "dim": 0, "sizes": [FFN, FFN]}


TIED = "tied_modules.embed.word_embeddings.weight"
POS = "tied_modules.embed.position_embeddings.weight"


def megatron_gpt2_tied_info() -> dict[str, Any]:
    """GPTModelPipe with tied embeddings, LayerNorm, biases and position embeddings (spec 6.1)."""
    return {
        "universal_checkpoint_version": 0.2,
        "original_vocab_size": VOCAB,
        "padded_vocab_size": PADDED,
        "vocabulary_parameter_patterns": [r"tied_modules.embed.word_embeddings.weight"],
        "pipeline_replicated_parameter_patterns": [r"tied_modules.embed.word_embeddings.weight",
                                                   r"tied_modules.embed.position_embeddings.weight"],
        "tp_replicated_parameter_patterns": [
            r"\d+.input_layernorm.weight", r"\d+.post_attention_layernorm.weight", r"\d+.weight", r"\d+.bias",
            "tied_modules.embed.position_embeddings.weight", r"\d+.self_attention.dense.bias", r"\d+.mlp.dense_4h_to_h.bias",
            r"\d+.input_layernorm.bias", r"\d+.post_attention_layernorm.bias",
        ],
        "parameter_with_row_parallelism_patterns": [r"\d+.mlp.dense_4h_to_h.weight", r"\d+.self_attention.dense.weight"],
        "parameter_with_2_sub_params_cat_dim_0": [],
    }


def gpt2_params() -> tuple[dict[str, tuple[torch.Tensor, tuple[Any, ...]]], dict[str, tuple[str, str | None, int]]]:
    rep: tuple[Any, ...] = ("rep",)
    params = {
        TIED: (rnd(PADDED, H), ("split", 0)),
        POS: (rnd(16, H), rep),
        "2.input_layernorm.weight": (rnd(H), rep), "2.input_layernorm.bias": (rnd(H), rep),
        "2.self_attention.query_key_value.weight": (rnd(3 * H, H), ("split", 0)),
        "2.self_attention.query_key_value.bias": (rnd(3 * H), ("split", 0)),
        "2.self_attention.dense.weight": (rnd(H, H), ("split", 1)), "2.self_attention.dense.bias": (rnd(H), rep),
        "2.post_attention_layernorm.weight": (rnd(H), rep), "2.post_attention_layernorm.bias": (rnd(H), rep),
        "2.mlp.dense_h_to_4h.weight": (rnd(4 * H, H), ("split", 0)), "2.mlp.dense_h_to_4h.bias": (rnd(4 * H), ("split", 0)),
        "2.mlp.dense_4h_to_h.weight": (rnd(H, 4 * H), ("split", 1)), "2.mlp.dense_4h_to_h.bias": (rnd(H), rep),
        "4.weight": (rnd(H), rep), "4.bias": (rnd(H), rep),
    }
    expect = {
        TIED: ("split", None, 0),
        POS: ("replicated", "tied_modules.embed.position_embeddings.weight", 0),
        "2.input_layernorm.bias": ("replicated", r"\d+.input_layernorm.bias", 0),
        "2.self_attention.query_key_value.bias": ("split", None, 0),
        "2.self_attention.dense.weight": ("split", r"\d+.self_attention.dense.weight", 1),
        "2.self_attention.dense.bias": ("replicated", r"\d+.self_attention.dense.bias", 0),
        "2.mlp.dense_4h_to_h.bias": ("replicated", r"\d+.mlp.dense_4h_to_h.bias", 0),
        "4.weight": ("replicated", r"\d+.weight", 0),
        "4.bias": ("replicated", r"\d+.bias", 0),
    }
    return params, expect


def test_megatron_tied_embedding() -> None:
    """The tied-embedding dict: vocabulary stripped; on a later pipeline stage the tied weight
    lands on the same key and pieces and is not stored again (pipeline-replicated)."""
    info = megatron_gpt2_tied_info()
    rules = Rules.from_dict(info)
    assert rules == Rules.from_deepspeed(info)
    assert rules.pipeline_replicated == (TIED, POS) and rules.vocab_patterns == (TIED,)
    assert not any(r.kind == "fused" for r in rules.params)  # an empty 2-sub-params list adds no rule
    params, expect = gpt2_params()
    placed = run_tp(params, rules, 2)
    check_matches(rules, expect, placed)
    check_all(placed, params, {TIED: VOCAB})
    # pipeline stage 1 of 2 holds the final norm and the tied embedding, under the same name
    g = params[TIED][0]
    for r in range(2):
        last = place({TIED: shard(g, ("split", 0), r, 2), "4.weight": params["4.weight"][0].clone()}, rules,
                     tp_rank=r, tp_size=2, pp_rank=1, pp_size=2)
        first = placed[TIED][r]
        assert (last[TIED].key, last[TIED].pieces, last[TIED].pad) == (first.key, first.pieces, first.pad)
        assert first.stored and not last[TIED].stored and last["4.weight"].stored


def autotp_info(widths: list[list[int]]) -> dict[str, Any]:
    """AutoTP 0.4 (spec 6.2): exact-name patterns, sub-parameters with uneven widths."""
    def pat(fqn: str) -> str:
        return rf"^{re.escape(fqn)}$"

    return {
        "universal_checkpoint_version": 0.4,
        "parameter_with_row_parallelism_patterns": [pat("mlp.down_proj.weight")],
        "tp_replicated_parameter_patterns": sorted([pat("mlp.down_proj.bias"), pat("norm.weight")]),
        "vocabulary_parameter_patterns": [pat("embed_tokens.weight")],
        "parameter_with_sub_params": [
            {"patterns": [pat("qkv.weight")], "shape": [(4, 4, 4), -1], "partition_dim": 0},
            {"patterns": [pat("qkv.bias")], "shape": [(4, 4, 4)], "partition_dim": 0},
        ],
        "autotp_unsupported_parameter_patterns": {},
        "sub_param_shard_widths": {pat("qkv.weight"): widths, pat("qkv.bias"): widths},
        "original_vocab_size": 12,
    }


def autotp_params(widths: list[list[int]]) -> dict[str, tuple[torch.Tensor, tuple[Any, ...]]]:
    sub = ("sub", (4, 4, 4), widths)
    return {
        "embed_tokens.weight": (rnd(12, 6), ("split", 0)),
        "qkv.weight": (rnd(12, 6), sub),
        "qkv.bias": (rnd(12), sub),
        "mlp.up_proj.weight": (rnd(12, 6), ("split", 0)),
        "mlp.down_proj.weight": (rnd(6, 12), ("split", 1)),
        "mlp.down_proj.bias": (rnd(6), ("rep",)),
        "norm.weight": (rnd(6), ("rep",)),
    }


def test_autotp_uneven_widths() -> None:
    """AutoTP's 0.4 dict at TP=3: uneven sub-parameter widths [2,1,1] per sub-parameter; the
    sub-parameter shape is a list holding a tuple."""
    widths = [[2, 1, 1], [2, 1, 1], [2, 1, 1]]
    info = autotp_info(widths)
    rules = Rules.from_deepspeed(info)
    assert Rules.from_dict(info) == rules
    qkv, pattern = rules.match("qkv.weight")
    assert (qkv.kind, pattern, qkv.sizes, qkv.view, qkv.widths) == (
        "fused", r"^qkv\.weight$", (4, 4, 4), (-1, -1), {3: ((2, 1, 1),) * 3})
    assert rules.match("qkv.bias")[0].view == (-1,)
    assert rules.match("qkv.weightx")[1] is None and rules.match("xqkv.weight")[1] is None  # exact names
    assert Rules.from_dict(json.loads(json.dumps(rules.to_dict()))) == rules
    params = autotp_params(widths)
    placed = run_tp(params, rules, 3)
    expect = {"embed_tokens.weight": ("split", None, 0), "qkv.weight": ("fused", r"^qkv\.weight$", 0),
              "qkv.bias": ("fused", r"^qkv\.bias$", 0), "mlp.up_proj.weight": ("split", None, 0),
              "mlp.down_proj.weight": ("split", r"^mlp\.down_proj\.weight$", 1),
              "norm.weight": ("replicated", r"^norm\.weight$", 0)}
    check_matches(rules, expect, placed)
    check_all(placed, params, {"embed_tokens.weight": 12})
    assert [pl.local.shape[0] for pl in placed["qkv.weight"]] == [6, 3, 3]
    assert all(pl.pad == () for pl in placed["embed_tokens.weight"])  # AutoTP: no padding
    assert placed["qkv.weight"][0].meaning == {"kind": "fused", "dim": 0, "sizes": [4, 4, 4]}
    # the same rules at TP=2 (no widths for it): even shares of each sub-parameter
    params2 = autotp_params([[2, 2]] * 3)
    check_all(run_tp(params2, rules, 2), params2, {"embed_tokens.weight": 12})


def test_deepspeed_unknown_key_refused() -> None:
    """A key of ``universal_checkpoint_info`` this library does not know (a newer DeepSpeed's
    placement) is refused, naming it and the way out: placing by the other keys alone could
    split its parameters by the default rule."""
    info = autotp_info([[2, 1, 1]] * 3) | {"parameter_with_column_parallelism_v9_patterns": [r".*qkv\.weight$"]}
    with pytest.raises(RuleError, match=r"does not know: \['parameter_with_column_parallelism_v9_patterns'\].*pass rules"):
        Rules.from_deepspeed(info)
    with pytest.raises(RuleError, match="does not know"):
        Rules.from_dict(info)


def test_deepspeed_scalar_count() -> None:
    """A 0.2 dict's ``shape: [3, -1]`` is a count of equal sub-parameters (DeepSpeed HEAD)."""
    info = {"universal_checkpoint_version": 0.2,
            "parameter_with_sub_params": [{"patterns": [r"^qkv\.weight$"], "shape": [3, -1], "partition_dim": 0}],
            "tp_replicated_parameter_patterns": [r"^norm\.weight$"],
            "sub_param_shard_widths": {r"^qkv\.weight$": [[3, 1], [2, 2], [2, 2]]}}  # ignored before 0.4
    rules = Rules.from_dict(info)
    rule, _ = rules.match("qkv.weight")
    assert (rule.kind, rule.sizes, rule.widths, rule.view) == ("fused", (-1, -1, -1), {}, (-1, -1))
    params = {"qkv.weight": (rnd(12, 5), ("sub", (4, 4, 4), [[2, 2]] * 3)), "norm.weight": (rnd(5), ("rep",))}
    check_all(run_tp(params, rules, 2), params, {})


@pytest.mark.parametrize("info, match", [
    ({"universal_checkpoint_version": 0.4,
      "parameter_with_sub_params": [{"patterns": ["a"], "shape": [(2, 2), -1], "partition_dim": 0}]},
     "needs sub_param_shard_widths"),
    ({"universal_checkpoint_version": 0.4,
      "parameter_with_sub_params": [{"patterns": ["a"], "shape": [(2, 2), -1], "partition_dim": 0}],
      "sub_param_shard_widths": {"a": [[1, 1]]}}, "one list per sub-parameter"),
    ({"universal_checkpoint_version": 0.4, "autotp_unsupported_parameter_patterns": {"^x$": "why"}}, "not convertible"),
    ({"vocabulary_parameter_patterns": ["a"]}, "original_vocab_size"),
    ({"universal_checkpoint_version": "new"}, "not a number"),
    ({"tp_replicated_parameter_patterns": "abc"}, "list of pattern strings"),
    ({"universal_checkpoint_version": 0.2,
      "parameter_with_sub_params": [{"patterns": ["a"], "shape": [3, -1], "partition_dim": 0, "x": 1}]}, "exactly"),
    ({"universal_checkpoint_version": 0.2,
      "parameter_with_sub_params": [{"patterns": ["a"], "shape": [3, -1], "partition_dim": 2}]}, "partition_dim"),
])
def test_deepspeed_malformed(info: dict[str, Any], match: str) -> None:
    with pytest.raises(RuleError, match=match):
        Rules.from_deepspeed(info)


# --- 3. precedence -----------------------------------------------------------------------


def test_precedence() -> None:
    """Replicated beats row-parallel (DeepSpeed's order) and fused a split along its dim; an
    average over a split or fused tensor, or a fused dim other than the split's, is an error
    (stored silently wrong otherwise); two patterns of one kind are an error naming both;
    unmatched names take the default."""
    ds = Rules.from_deepspeed({"universal_checkpoint_version": 0.2,
                               "tp_replicated_parameter_patterns": [r"\d+.input_layernorm.weight"],
                               "parameter_with_row_parallelism_patterns": [r"\d+.input_layernorm"]})
    rule, pattern = ds.match("3.input_layernorm.weight")
    assert (rule.kind, pattern) == ("replicated", r"\d+.input_layernorm.weight")
    assert ds.match("3.input_layernorm.bias")[0].dim == 1
    rules = Rules((ParamRule("fused", ("w",), sizes=(-1, -1)), ParamRule("replicated", ("w",)), ParamRule("split", ("w",), dim=1)))
    assert rules.match("w")[0].kind == "replicated"  # (a save checks the copies equal)
    either = Rules((ParamRule("replicated", (r"\d+\.norm\.weight",)), ParamRule("average", (r"\d+\.norm", r".*weight$"))))
    assert either.match("3.norm.weight")[0].kind == "replicated"  # (kinds after it are not looked at)
    row_fused = Rules((ParamRule("fused", ("w",), dim=1, sizes=(-1, -1)), ParamRule("split", ("w",), dim=1)))
    assert row_fused.match("w")[0].kind == "fused"  # (DeepSpeed AutoTP lists such a weight in both)
    for other in (ParamRule("split", ("qkv",)), ParamRule("fused", ("qkv",), sizes=(-1, -1))):
        with pytest.raises(RuleError, match=r"'qkv\.bias' is matched by average pattern '\.\*bias\$' and (split|fused) pattern 'qkv'"):
            Rules((ParamRule("average", (r".*bias$",)), other)).match("qkv.bias")  # (the mean of its parts)
    with pytest.raises(RuleError, match="store it differently"):  # sub-parameters along another dim than the split
        Rules((ParamRule("fused", ("w",), dim=0, sizes=(-1, -1)), ParamRule("split", ("w",), dim=1))).match("w")
    aw, any_a = r"a\.w", r"a\..*"
    rules = Rules((ParamRule("split", (aw, any_a)),))
    with pytest.raises(RuleError, match=re.escape(f"{aw!r} and {any_a!r}")):
        rules.match("a.w")
    rules = Rules((ParamRule("split", ("x",)), ParamRule("split", ("x.y",), dim=1)))  # two rules of one kind
    with pytest.raises(RuleError, match="two split patterns"):
        rules.match("x.y")
    with pytest.raises(RuleError, match="two vocabulary patterns"):
        Rules(vocab_patterns=("e", "e.w"), vocab_size=3).vocab_match("e.w")
    both = Rules.from_deepspeed({"universal_checkpoint_version": 0.2, "parameter_with_2_sub_params_cat_dim_0": [r"\d+.mlp.fc1"],
                                 "parameter_with_sub_params": [{"patterns": [r"\d+.mlp"], "shape": [2, -1], "partition_dim": 0}]})
    with pytest.raises(RuleError, match="two fused patterns"):  # DeepSpeed takes the first; here an error
        both.match("1.mlp.fc1.weight")
    rule, pattern = Rules().match("anything")
    assert (rule.kind, rule.dim, pattern) == ("split", 0, None)
    assert Rules(default="replicated").match("x")[0].kind == "replicated"
    out = place({"x": torch.ones(2, 3)}, Rules(), tp_rank=1, tp_size=2)["x"]
    assert (out.global_shape, out.pieces[0].dst.offset, out.rule) == ((4, 3), (2, 0), "(default)")
    with pytest.raises(RuleError, match="'some.param'"):
        Rules(default="error").match("some.param")
    with pytest.raises(RuleError, match="'some.param'"):
        place({"some.param": torch.ones(2)}, Rules(default="error"))


# --- 4. strict ---------------------------------------------------------------------------


def test_strict() -> None:
    """An unused pattern is an error with pp_size == 1 (not with strict=False, not for
    pipeline-replicated patterns, and deferred to the save with several stages)."""
    sd = {"a.w": torch.ones(2, 2)}
    unused = [ParamRule("replicated", ("a.w",)), ParamRule("split", ("never_matches",), dim=1)]
    with pytest.raises(RuleError, match="'never_matches'"):
        place(sd, Rules(tuple(unused)))
    place(sd, Rules(tuple(unused), strict=False))
    place(sd, Rules(tuple(unused), pipeline=Renumber(r"layers\.(\d+)\.", 2)), pp_rank=0, pp_size=2)
    place(sd, Rules(tuple(unused[:1]), pipeline_replicated=("tied_never",)))
    with pytest.raises(RuleError, match="'vocab_never'"):
        place(sd, Rules(tuple(unused[:1]), vocab_patterns=("vocab_never",), vocab_size=2))
    with pytest.raises(RuleError, match="'rename_never'"):
        place(sd, Rules(tuple(unused[:1]), rename=(("rename_never", "x"),)))
    with pytest.raises(RuleError, match="match no parameter"):
        place(sd, Rules.from_deepspeed(megatron_llama_info(0.4)))


# --- 5. place() --------------------------------------------------------------------------

MCORE: dict[str, Any] = {
    "params": [
        {"kind": "split", "patterns": [L + r"self_attention\.linear_proj\.weight", L + r"mlp\.linear_fc2\.weight"], "dim": 1},
        {"kind": "fused", "patterns": [L + r"self_attention\.linear_qkv\.weight"], "dim": 0, "sizes": [8, 4, 4]},
        {"kind": "fused", "patterns": [L + r"mlp\.linear_fc1\.weight"], "dim": 0, "sizes": [-1, -1]},
        {"kind": "replicated", "patterns": [L + r"input_layernorm\.weight", r"decoder\.final_layernorm\.weight"]},
    ],
    "vocab": {"patterns": [r"embedding\.word_embeddings\.weight", r"output_layer\.weight"], "size": VOCAB},
    "pipeline": {"pattern": r"decoder\.layers\.(\d+)\.", "num_layers": 4},
}


def mcore_layer(i: int) -> dict[str, tuple[torch.Tensor, tuple[Any, ...]]]:
    p = f"decoder.layers.{i}."
    return {
        p + "input_layernorm.weight": (rnd(H), ("rep",)),
        p + "self_attention.linear_qkv.weight": (rnd(16, H), ("sub", (8, 4, 4), [[4, 4], [2, 2], [2, 2]])),
        p + "self_attention.linear_proj.weight": (rnd(H, H), ("split", 1)),
        p + "mlp.linear_fc1.weight": (rnd(2 * FFN, H), ("halves",)),
        p + "mlp.linear_fc2.weight": (rnd(H, FFN), ("split", 1)),
    }


def mcore_params(layers: range) -> dict[str, tuple[torch.Tensor, tuple[Any, ...]]]:
    params = {"embedding.word_embeddings.weight": (rnd(PADDED, H), ("split", 0))}
    for i in layers:
        params |= mcore_layer(i)
    return params | {"decoder.final_layernorm.weight": (rnd(H), ("rep",)), "output_layer.weight": (rnd(PADDED, H), ("split", 0))}


def test_optimizer_state() -> None:
    """Moments keyed by FQN follow their parameter's rule under ``optim.state``; a 0-d step is
    a replicated whole; other values are left as they are."""
    rules = Rules.from_dict(MCORE)
    params = mcore_params(range(2))
    groups = [{"lr": 0.1, "params": sorted(params)}]
    placed: dict[str, list[Placed]] = {}
    for r in range(2):
        model = {n: shard(g, how, r, 2) for n, (g, how) in params.items()}
        state = {n: {"exp_avg": t * 2, "exp_avg_sq": t * t, "step": torch.tensor(7.0)} for n, t in model.items()}
        out = place({"model": model, "optim": {"state": state, "param_groups": groups}}, rules, tp_rank=r, tp_size=2)
        assert out["optim"]["param_groups"] == groups
        for n in params:
            pm, ps = out["model"][n], out["optim"]["state"][n]
            assert pm.key == f"model.{n}"
            for m in ("exp_avg", "exp_avg_sq"):
                assert ps[m].key == f"optim.state.{n}.{m}"
                assert (ps[m].pieces, ps[m].pad, ps[m].global_shape, ps[m].meaning, ps[m].rule) == (
                    pm.pieces, pm.pad, pm.global_shape, pm.meaning, pm.rule)
                placed.setdefault(f"{n}.{m}", []).append(ps[m])
            step = ps["step"]
            assert (step.key, step.global_shape, step.replicated) == (f"optim.state.{n}.step", (), True)
            assert step.pieces == (Piece(Box((), ()), Box((), ())),) and step.meaning == {"kind": "replicated"}
    for n, (g, _) in params.items():
        want = g[:VOCAB] if "embedding" in n or "output_layer" in n else g
        assert torch.equal(assemble(placed[f"{n}.exp_avg"]), want * 2), n
        assert torch.equal(assemble(placed[f"{n}.exp_avg_sq"]), want * want), n
    fqn = "decoder.layers.0.mlp.linear_fc2.weight"
    model = {n: shard(g, how, 0, 2) for n, (g, how) in params.items()}
    with pytest.raises(RuleError, match=re.escape(f"'optim.state.{fqn}.exp_avg'")):
        place({"model": model, "optim": {"state": {fqn: {"exp_avg": torch.zeros(3)}}}}, rules, tp_size=2)


def test_pipeline_and_experts_renumbering() -> None:
    """Local layer (and expert) indices become global: by an even count, or explicit offsets."""
    params = mcore_layer(0)
    local = {n: g.clone() for n, (g, _) in params.items()}  # TP=1
    out = place({"model": local}, Rules.from_dict(MCORE | {"strict": False}), pp_rank=1, pp_size=2)
    assert {pl.key for pl in out["model"].values()} == {"model." + n.replace("layers.0.", "layers.2.") for n in params}
    offsets = MCORE | {"pipeline": {"pattern": r"decoder\.layers\.(\d+)\.", "offsets": [0, 3]}}
    out = place({"model": local}, Rules.from_dict(offsets), pp_rank=1, pp_size=2)
    assert {pl.key for pl in out["model"].values()} == {"model." + n.replace("layers.0.", "layers.3.") for n in params}
    state = {n: {"exp_avg": t.clone()} for n, t in local.items()}
    out = place({"optim": {"state": state}}, Rules.from_dict(MCORE), pp_rank=1, pp_size=2)
    assert out["optim"]["state"][next(iter(local))]["exp_avg"].key.startswith("optim.state.decoder.layers.2.")
    with pytest.raises(RuleError, match="2 offsets for 4 ranks"):
        place({"model": local}, Rules.from_dict(offsets), pp_rank=1, pp_size=4)
    with pytest.raises(RuleError, match="cannot be split evenly over 3"):
        place({"model": local}, Rules.from_dict(MCORE), pp_rank=1, pp_size=3)
    # experts: local expert 1 of EP rank 1 (of 2, 8 experts) is expert 5; stacked experts split on EP
    moe = Rules.from_dict({
        "params": [{"kind": "split", "patterns": [L + r"mlp\.experts\.weight\d"], "dim": 0, "axis": "ep"}],
        "pipeline": {"pattern": r"decoder\.layers\.(\d+)\.", "num_layers": 4},
        "experts": {"pattern": L + r"mlp\.experts\.local_experts\.(\d+)\.", "num_experts": 8},
    })
    g = rnd(8, 6, 4)
    sd = {"decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight": rnd(6, 4),
          "decoder.layers.1.mlp.experts.weight1": shard(g, ("split", 0), 1, 2)}
    out = place(sd, moe, tp_rank=0, tp_size=1, pp_rank=1, pp_size=2, ep_rank=1, ep_size=2)
    assert out["decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"].key == \
        "decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight"
    stacked = out["decoder.layers.1.mlp.experts.weight1"]
    assert stacked.key == "decoder.layers.3.mlp.experts.weight1"
    assert (stacked.global_shape, stacked.pieces[0].dst.offset) == ((8, 6, 4), (4, 0, 0))
    assert torch.equal(assemble([place({"e.weight1": shard(g, ("split", 0), r, 2)},
                                       Rules((ParamRule("split", ("e",), axis="ep"),)), tp_size=1,
                                       ep_rank=r, ep_size=2)["e.weight1"] for r in range(2)]), g)


@pytest.mark.parametrize("kw, name", [
    pytest.param({"pp_rank": 0, "pp_size": 2}, "decoder.layers.2.w", id="layer-of-next-stage"),
    pytest.param({"pp_rank": 1, "pp_size": 2}, "decoder.layers.3.w", id="layer-beyond-count"),
    pytest.param({"ep_rank": 0, "ep_size": 2}, "experts.local_experts.4.w", id="expert-of-next-rank"),
])
def test_renumber_local_index_in_range(kw: dict[str, int], name: str) -> None:
    """With 4 layers (8 experts) over 2 ranks, local indices are 0..1 (0..3): others are not local."""
    rules = Rules(pipeline=Renumber(r"decoder\.layers\.(\d+)\.", 4), experts=Renumber(r"experts\.local_experts\.(\d+)\.", 8))
    with pytest.raises(RuleError):
        place({name: torch.zeros(2)}, rules, **kw)


def test_rename_tied_output_layer() -> None:
    """The last stage's output layer, tied to the embedding, is placed on the embedding's key
    and pieces, and (pipeline-replicated) not stored again."""
    rules = Rules.from_dict(MCORE | {
        "rename": [{"pattern": r"output_layer\.weight", "to": "embedding.word_embeddings.weight"}],
        "pipeline_replicated": [r"output_layer\.weight"]})
    g = rnd(PADDED, H)
    for r in range(2):
        t = shard(g, ("split", 0), r, 2)
        first = place({"model": {"embedding.word_embeddings.weight": t}}, rules, tp_rank=r, tp_size=2, pp_rank=0, pp_size=2)
        last = place({"model": {"output_layer.weight": t.clone()}}, rules, tp_rank=r, tp_size=2, pp_rank=1, pp_size=2)
        a, b = first["model"]["embedding.word_embeddings.weight"], last["model"]["output_layer.weight"]
        assert b.key == a.key == "model.embedding.word_embeddings.weight"
        assert (b.pieces, b.pad, b.global_shape, b.meaning) == (a.pieces, a.pad, a.global_shape, a.meaning)
        assert a.stored and not b.stored


@pytest.mark.parametrize("pattern, to, fqn, want", [
    pytest.param(r"(.*)", r"model.\1", "w", "model.w", id="prefix"),
    pytest.param(r"a|ab", "X", "ab", "X", id="alternation"),
])
def test_rename_is_a_fullmatch(pattern: str, to: str, fqn: str, want: str) -> None:
    """A rename replaces the whole name as its fullmatch expands ``to``."""
    rules = Rules(rename=((pattern, to),))
    assert rules.consolidated_name(fqn, pp_rank=0, pp_size=1, ep_rank=0, ep_size=1) == want


def test_full_model_tp_pp() -> None:
    """A Megatron-core model over TP=2 x PP=2, placed stage by stage, rebuilds every tensor."""
    rules = Rules.from_dict(MCORE)
    params = mcore_params(range(4))
    placed: dict[str, list[Placed]] = {}
    for pp in range(2):
        stage = {n: v for n, v in params.items()
                 if (m := re.match(r"decoder\.layers\.(\d+)\.", n)) is None or int(m.group(1)) // 2 == pp}
        local_name = {n: re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) % 2}.", n) for n in stage}
        for r in range(2):
            out = place({local_name[n]: shard(g, how, r, 2) for n, (g, how) in stage.items()}, rules,
                        tp_rank=r, tp_size=2, pp_rank=pp, pp_size=2)
            for n in stage:
                if pp == 0 or n.startswith("decoder.layers"):
                    placed.setdefault(n, []).append(out[local_name[n]])
    check_all(placed, params, {"embedding.word_embeddings.weight": VOCAB, "output_layer.weight": VOCAB})


def test_pieces_rule_strided() -> None:
    """Explicit pieces with steps place each rank's interleaved rows."""
    rules = Rules.from_dict({"params": [FULL["params"][6]]})
    g = rnd(4, 6)
    placed = []
    for r in range(2):
        local = torch.empty(4, 3)
        local[0::2], local[1::2] = g[0:2, 3 * r : 3 * r + 3], g[2:4, 3 * r : 3 * r + 3]
        placed.append(place({"interleaved.weight": local}, rules, tp_rank=r, tp_size=2)["interleaved.weight"])
        check_local(placed[-1], g)
    assert torch.equal(assemble(placed), g)
    with pytest.raises(RuleError, match="no pieces for TP size 4"):
        place({"interleaved.weight": torch.empty(4, 3)}, rules, tp_rank=0, tp_size=4)
    with pytest.raises(RuleError, match="interleaved.weight"):
        place({"interleaved.weight": torch.empty(2, 3)}, rules, tp_rank=0, tp_size=2)


@pytest.mark.parametrize("name, ranges", [
    ("decoder.layers.0.mlp.linear_fc1.weight", [(0, 37), (37, 37), (37, 96)]),
    ("decoder.layers.0.self_attention.linear_proj.weight", [(0, 5), (5, 30), (30, 32)]),
    ("embedding.word_embeddings.weight", [(0, 100), (100, 201), (201, 256)]),
])
def test_flat_shard(name: str, ranges: list[tuple[int, int]]) -> None:
    """Flat ranges of the local parameter (a distributed optimizer's partition) compose with
    the rule: the pieces of all ranges of all TP ranks tile the consolidated tensor, and the
    padding pieces cover exactly the local elements in padding rows."""
    rules = Rules.from_dict(MCORE | {"strict": False})
    g, how = mcore_params(range(1))[name]
    placed = []
    for r in range(2):
        flat = shard(g, how, r, 2).reshape(-1)
        assert flat.numel() == ranges[-1][1]
        for start, stop in ranges:
            pl = place({"optim": {"state": {name: {"exp_avg": FlatShard(flat[start:stop].clone(), shard(g, how, r, 2).shape,
                                                                         start)}}}},
                       rules, tp_rank=r, tp_size=2)["optim"]["state"][name]["exp_avg"]
            assert pl.key == f"optim.state.{name}.exp_avg"
            check_local(pl, g)
            assert all(p.base is not None and p.base[0] + math.prod(p.base[1]) <= stop - start for p in pl.pieces + pl.pad)
            placed.append(pl)
    want = g[:VOCAB] if "embedding" in name else g
    assert torch.equal(assemble(placed), want)
    if "embedding" in name:
        pad = sum(math.prod(p.dst.shape) for pl in placed for p in pl.pad)
        assert pad == (PADDED - VOCAB) * H


def test_place_errors() -> None:
    """Sizes a TP degree cannot divide, widths that do not add up, and bad ranks are
    RuleErrors naming the parameter and the rule's pattern."""
    qkv = r"attn\.qkv\.weight"
    gqa = Rules((ParamRule("fused", (qkv,), sizes=(12, 6, 6)),))  # 4 query heads, 2 kv heads, head dim 3
    with pytest.raises(RuleError, match=re.escape(f"parameter 'attn.qkv.weight' (rule {qkv!r})")) as e:
        place({"attn.qkv.weight": torch.zeros(6, 4)}, gqa, tp_rank=0, tp_size=4)
    assert "cannot be split evenly over 4" in str(e.value)
    place({"attn.qkv.weight": torch.zeros(12, 4)}, gqa, tp_rank=0, tp_size=2)
    with pytest.raises(RuleError, match="do not add up"):
        place({"attn.qkv.weight": torch.zeros(10, 4)}, gqa, tp_rank=0, tp_size=2)
    with pytest.raises(RuleError, match=re.escape("'widths[3][1]' [2, 2, 1] sums to 5, not sub-parameter 1's size 6")):
        Rules((ParamRule("fused", (qkv,), sizes=(6, 6), widths={3: ((3, 2, 1), (2, 2, 1))}),))
    widths = Rules((ParamRule("fused", (qkv,), sizes=(6, 6), widths={3: ((3, 2, 1), (2, 2, 2))}),))
    place({"attn.qkv.weight": torch.zeros(4, 4)}, widths, tp_rank=1, tp_size=3)
    with pytest.raises(RuleError, match="rank 1 holds 5 along dim 0"):
        place({"attn.qkv.weight": torch.zeros(5, 4)}, widths, tp_rank=1, tp_size=3)
    with pytest.raises(RuleError, match="0-d"):
        place({"s": torch.tensor(1.0)}, Rules(), tp_size=2)
    with pytest.raises(RuleError, match="fewer than its 50 entries"):
        place({"e": torch.zeros(20, 2)}, Rules(vocab_patterns=("e",), vocab_size=50), tp_rank=0, tp_size=2)
    with pytest.raises(RuleError, match="tp_rank 2"):
        place({"e": torch.zeros(2)}, Rules(), tp_rank=2, tp_size=2)


# --- 6. same_meaning ---------------------------------------------------------------------


def test_same_meaning() -> None:
    fused = ParamRule("fused", ("w",), sizes=(8, 4, 4))
    assert not same_meaning(fused.meaning(None), ParamRule("fused", ("w",), sizes=(8, 2, 6)).meaning(None))
    assert not same_meaning(fused.meaning(None), ParamRule("fused", ("w",), dim=1, sizes=(8, 4, 4)).meaning(None))
    assert same_meaning(fused.meaning(None), ParamRule("fused", ("x",), sizes=(8, 4, 4)).meaning(None))
    assert same_meaning(ParamRule("split", ("w",)).meaning(None), ParamRule("split", ("w",), dim=1).meaning(None))
    assert same_meaning(ParamRule("split", ("w",)).meaning(None), ParamRule("replicated", ("w",)).meaning(None))
    assert not same_meaning(ParamRule("split", ("w",)).meaning(50), ParamRule("split", ("w",)).meaning(52))
    assert not same_meaning(ParamRule("split", ("w",)).meaning(50), ParamRule("split", ("w",)).meaning(None))
    assert not same_meaning(fused.meaning(None), ParamRule("split", ("w",)).meaning(None))
    assert same_meaning(None, fused.meaning(None)) and same_meaning(fused.meaning(50), None)


def test_same_meaning_resolves_placeholders() -> None:
    """A tensor placed by sizes [-1, -1] and by [12, 12] has the same consolidated form (the
    placed meaning holds the resolved sizes)."""
    t = {"fc1.weight": torch.zeros(12, 4)}
    a = place(t, Rules((ParamRule("fused", ("fc1",), sizes=(-1, -1)),)), tp_rank=0, tp_size=2)["fc1.weight"]
    b = place(t, Rules((ParamRule("fused", ("fc1",), sizes=(12, 12)),)), tp_rank=0, tp_size=2)["fc1.weight"]
    assert a.pieces == b.pieces
    assert a.meaning == b.meaning == {"kind": "fused", "dim": 0, "sizes": [12, 12]}
    assert same_meaning(a.meaning, b.meaning)


# --- 7. end to end -----------------------------------------------------------------------


def test_save_open_load(tmp_path) -> None:
    """Both TP ranks' placed tensors saved from one process: the rules and each tensor's
    meaning are stored; a TP=4 load rebuilds every rank's shard and zeroes padding; rules
    with other fused sizes (same total) are refused unless allowed."""
    sizes = [8, 4, 4]

    def rules_of(sz: list[int]) -> Rules:
        return Rules.from_dict({"params": [{"kind": "fused", "patterns": [r"attn\.qkv\.weight"], "sizes": sz},
                                           {"kind": "replicated", "patterns": [r"norm\.weight"]}],
                                "vocab": {"patterns": [r"embed\.weight"], "size": 13}})

    rules = rules_of(sizes)
    g = {"attn.qkv.weight": rnd(16, 4), "norm.weight": rnd(4), "embed.weight": rnd(16, 4)}

    def hows(tp: int, sz: list[int]) -> dict[str, tuple[Any, ...]]:
        return {"attn.qkv.weight": ("sub", sz, [[n // tp] * tp for n in sz]), "norm.weight": ("rep",),
                "embed.weight": ("split", 0)}

    def placed_ranks(tp: int, r: Rules, sz: list[int], fill: bool = True) -> dict[str, Any]:
        return {f"rank{k}": place({"model": {n: shard(t, hows(tp, sz)[n], k, tp) if fill else torch.full_like(
                    shard(t, hows(tp, sz)[n], k, tp), 7.0) for n, t in g.items()}}, r, tp_rank=k, tp_size=tp)["model"]
                for k in range(tp)}

    ucp_zarr.save(placed_ranks(2, rules, sizes), tmp_path / "ck")
    ck = ucp_zarr.open(tmp_path / "ck")
    assert ck.meta.layout["rules"] == rules.to_dict()
    assert ck.meta.tensors["model.attn.qkv.weight"].rule == {"kind": "fused", "dim": 0, "sizes": sizes}
    assert ck.meta.tensors["model.embed.weight"].rule == {"kind": "split", "vocab": 13}
    assert ck.meta.tensors["model.embed.weight"].shape == (13, 4)
    assert torch.equal(ck.read("model.attn.qkv.weight"), g["attn.qkv.weight"])
    assert torch.equal(ck.read("model.embed.weight"), g["embed.weight"][:13])

    target = placed_ranks(4, rules, sizes, fill=False)
    ucp_zarr.load(target, tmp_path / "ck")
    for k in range(4):
        for n, t in g.items():
            want = shard(t, hows(4, sizes)[n], k, 4)
            if n == "embed.weight" and k == 3:
                want[1:] = 0  # rows 13:16 are padding, zeroed at load
            assert torch.equal(target[f"rank{k}"][n].local, want), (k, n)

    other = [8, 2, 6]  # same total, other sub-parameters
    with pytest.raises(ucp_zarr.LayoutError, match="allow_other_rules"):
        ucp_zarr.load(placed_ranks(2, rules_of(other), other, fill=False), tmp_path / "ck")
    target = placed_ranks(2, rules_of(other), other, fill=False)
    ucp_zarr.load(target, tmp_path / "ck", allow_other_rules=True)
    for k in range(2):
        assert torch.equal(target[f"rank{k}"]["attn.qkv.weight"].local, shard(g["attn.qkv.weight"], hows(2, other)["attn.qkv.weight"], k, 2))


def test_placed_save_does_not_import_dtensor(tmp_path) -> None:
    """A trainer that never uses DTensor does not pay for importing it (~1 s) on save or
    load: that import made placed saves 0.7x as fast as DTensor ones in bench_rules."""
    import subprocess
    import sys

    code = (
        "import sys, torch, ucp_zarr\n"
        "rules = ucp_zarr.Rules.from_dict({'params': [{'kind': 'split', 'patterns': ['w']}]})\n"
        "sd = {'w': torch.arange(8.0).reshape(4, 2)}\n"
        f"ucp_zarr.save(ucp_zarr.place(sd, rules), {str(tmp_path / 'ck')!r})\n"
        f"ucp_zarr.load(ucp_zarr.place(sd, rules), {str(tmp_path / 'ck')!r})\n"
        "assert 'torch.distributed.tensor' not in sys.modules, 'DTensor was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_uneven_split(tmp_path) -> None:
    """A split rule with every rank's width (AutoTP's uneven shards: 14 rows over TP3 as 5, 5, 4;
    a row-parallel 10 columns as 4, 3, 3) saves at TP3 and loads at TP2 (even) and TP4 (uneven)."""
    rules = Rules.from_dict({"params": [
        {"kind": "split", "patterns": [r"up\.weight"], "widths": {"3": [5, 5, 4], "4": [4, 4, 4, 2]}},
        {"kind": "split", "dim": 1, "patterns": [r"down\.weight"], "widths": {"3": [4, 3, 3], "4": [3, 3, 2, 2]}},
    ]})
    assert Rules.from_dict(rules.to_dict()) == rules
    assert rules.to_dict()["params"][0]["widths"] == {"3": [5, 5, 4], "4": [4, 4, 4, 2]}
    g = {"up.weight": rnd(14, 6), "down.weight": rnd(6, 10)}

    def local(tp: int, r: int) -> dict[str, torch.Tensor]:
        rows, cols = {3: ([5, 5, 4], [4, 3, 3]), 4: ([4, 4, 4, 2], [3, 3, 2, 2]), 2: ([7, 7], [5, 5])}[tp]
        return {"up.weight": g["up.weight"].split(rows)[r].clone(),
                "down.weight": g["down.weight"].split(cols, dim=1)[r].clone()}

    saved = [place(local(3, r), rules, tp_rank=r, tp_size=3) for r in range(3)]
    for n in g:
        assert torch.equal(assemble([s[n] for s in saved]), g[n]), n
    ucp_zarr.save({f"rank{r}": s for r, s in enumerate(saved)}, tmp_path / "ck")
    ck = ucp_zarr.open(tmp_path / "ck")
    assert all(torch.equal(ck.read(n), t) for n, t in g.items())
    for tp in (2, 4):
        targets = [{n: torch.full_like(t, 7.0) for n, t in local(tp, r).items()} for r in range(tp)]
        ucp_zarr.load({f"rank{r}": place(t, rules, tp_rank=r, tp_size=tp) for r, t in enumerate(targets)},
                      tmp_path / "ck")
        for r, t in enumerate(targets):
            assert all(torch.equal(t[n], want) for n, want in local(tp, r).items()), (tp, r)
    with pytest.raises(RuleError, match=r"rank 2 holds 5 along dim 0, but its sub-parameter widths \[4\]"):
        place({"up.weight": rnd(5, 6)}, rules, tp_rank=2, tp_size=3)
    with pytest.raises(RuleError, match=re.escape("'widths[3]' must give 3 widths, one per rank, not [7, 7]")):
        Rules.from_dict({"params": [{"kind": "split", "patterns": ["w"], "widths": {"3": [7, 7]}}]})
    with pytest.raises(RuleError, match=re.escape("unknown member(s) ['widths']: a replicated rule takes")):
        Rules.from_dict({"params": [{"kind": "replicated", "patterns": ["w"], "widths": {"2": [7, 7]}}]})


def test_a_save_warns_of_vocabulary_padding_it_does_not_store(tmp_path: Path) -> None:
    """Padding rows beyond vocab_size that are not zero (Megatron initialises and trains them;
    its cross entropy counts their logits) are not stored and load as zeros: the save warns,
    naming the tensor and the fix (vocab_size = the padded size stores them, and they load
    back bit-exactly). Zero padding: no warning."""
    import warnings

    rules = Rules(params=(ParamRule("split", (r"emb",)),), vocab_patterns=(r"emb",), vocab_size=5)
    padded = torch.arange(16.0).reshape(8, 2)
    with pytest.warns(UserWarning, match=r"padding rows of \['emb'\] are not zero, and are not stored"):
        ucp_zarr.save(place({"emb": padded}, rules), tmp_path / "a")
    back = torch.full((8, 2), -1.0)
    ucp_zarr.load(place({"emb": back}, rules), tmp_path / "a")
    assert torch.equal(back[:5], padded[:5]) and not back[5:].any()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ucp_zarr.save(place({"emb": torch.cat([padded[:5], torch.zeros(3, 2)])}, rules), tmp_path / "b")
        whole = Rules(params=rules.params, vocab_patterns=rules.vocab_patterns, vocab_size=8)
        ucp_zarr.save(place({"emb": padded}, whole), tmp_path / "c")
    ucp_zarr.load(place({"emb": back}, whole), tmp_path / "c")
    assert torch.equal(back, padded)


def test_a_save_of_the_padded_vocabulary_loads_into_a_layout_that_pads_less(tmp_path: Path) -> None:
    """A save with vocab_size its padded size (8 rows, as for a bit-exact resume) loads with rules
    of a smaller size (6: another degree's padded size; 5: the tokenizer's, the rest zero-filled):
    the first rows, with a warning naming the rows left out (before: refused as another form, and
    with allow_other_rules a shape mismatch). A larger size is still refused, as any other form."""
    def rules(size: int) -> Rules:
        return Rules(params=(ParamRule("split", (r"emb",)),), vocab_patterns=(r"emb",), vocab_size=size)

    padded = torch.arange(16.0).reshape(8, 2)
    ucp_zarr.save(place({"emb": padded, "step": 3}, rules(8)), tmp_path / "ck")
    for size, local in ((6, 6), (5, 6)):
        back = torch.full((local, 2), -1.0)
        with pytest.warns(UserWarning, match=rf"'emb': the checkpoint stores 8 rows, the rules loading it {size}: "
                                             rf"rows {size} to 7 are left out as padding"):
            ucp_zarr.load(place({"emb": back, "step": 0}, rules(size)), tmp_path / "ck")
        assert torch.equal(back[:size], padded[:size]) and not back[size:].any()
    with pytest.raises(ucp_zarr.LayoutError, match="another consolidated form"):
        ucp_zarr.load(place({"emb": torch.zeros(10, 2), "step": 0}, rules(10)), tmp_path / "ck")


def test_values_of_uneven_pipeline_stages_are_renamed_all_at_once(tmp_path: Path) -> None:
    """A stage of uneven pipeline stages whose offset is below its layer count (Megatron-core's
    num_layers_in_first_pipeline_stage=1: stage 1 holds global layers 1 and 2 as local 0 and 1)
    renames the values under its layers (a module's ``_extra_state``, None in Megatron's state
    dicts) 0 -> 1 and 1 -> 2: placed and saved (before: refused, 'layers.0._extra_state' is
    renamed 'layers.1._extra_state', which the state dict holds too)."""
    rules = Rules(params=(ParamRule("replicated", (r"layers\.",)),), pipeline=Renumber(r"layers\.(\d+)\.", offsets=(0, 1)))
    stage = {"model": {f"layers.{i}.{name}": value for i in range(2)
                       for name, value in (("w", torch.full((2,), float(i + 1))), ("_extra_state", i + 1))}}
    placed = place(stage, rules, pp_rank=1, pp_size=2)
    assert placed["model"]["layers.2._extra_state"] == 2 and placed["model"]["layers.1._extra_state"] == 1
    ucp_zarr.save(placed, tmp_path / "ck")
    back = ucp_zarr.read_state_dict(tmp_path / "ck")["model"]
    assert torch.equal(back["layers.2.w"], torch.full((2,), 2.0)) and back["layers.2._extra_state"] == 2


def test_a_load_refuses_rules_whose_model_computes_something_else(tmp_path) -> None:
    """The rules' ``model`` (what the weights compute that names and shapes do not tell:
    Megatron's rotary interleaving, activation) is checked at load: a member both rules record
    and that differs is refused, naming it, unless ``allow_other_rules`` (before, the weights
    loaded into a model with interleaved rotary or gelu in place of silu without a word).
    Members only one side records are not compared (another framework version's facts)."""
    facts = {"framework": "megatron-core", "rotary_interleaved": False, "activation_func": "silu"}
    weight = torch.arange(8.0).reshape(4, 2)

    def placed(model: dict[str, Any] | None, fill: torch.Tensor) -> dict[str, Any]:
        return place({"w": fill.clone()}, Rules((ParamRule("split", ("w",)),), model=model), tp_rank=0, tp_size=1)

    ucp_zarr.save(placed(facts, weight), tmp_path / "ck")
    for other in ({"rotary_interleaved": True}, {"activation_func": "gelu", "rotary_interleaved": True}):
        target = placed(facts | other, torch.zeros(4, 2))
        with pytest.raises(ucp_zarr.LayoutError, match="allow_other_rules") as e:
            ucp_zarr.load(target, tmp_path / "ck")
        assert all(f"{k}: {facts[k]!r} saved, {v!r} loading" in str(e.value) for k, v in other.items()), e.value
        assert not target["w"].local.any()  # (nothing read)
        ucp_zarr.load(target, tmp_path / "ck", allow_other_rules=True)
        assert torch.equal(target["w"].local, weight)
    inv_freq = [1.0, 0.1, 0.01]
    ucp_zarr.save(placed(facts | {"rotary_inv_freq": inv_freq}, weight), tmp_path / "ck_freq")
    target = placed(facts | {"rotary_inv_freq": [math.nextafter(f, 1.0) for f in inv_freq]}, torch.zeros(4, 2))
    ucp_zarr.load(target, tmp_path / "ck_freq")  # (computed on another device: the last bit may differ)
    with pytest.raises(ucp_zarr.LayoutError, match="rotary_inv_freq"):
        ucp_zarr.load(placed(facts | {"rotary_inv_freq": [1.0, 0.1, 0.0125]}, torch.zeros(4, 2)), tmp_path / "ck_freq")
    for model in (None, {"framework": "megatron-core"}, facts | {"window_size": None}):  # nothing both record differs
        target = placed(model, torch.zeros(4, 2))
        ucp_zarr.load(target, tmp_path / "ck")
        assert torch.equal(target["w"].local, weight)
