"""The universal checkpoint language: declarative rules for plain local tensors.

A trainer that holds plain local tensors (Megatron-LM, Megatron-DeepSpeed, DeepSpeed
AutoTP, in-house 3-D parallel code) describes its conventions once, as :class:`Rules`; then
:func:`ucp_zarr.place` turns each rank's state dict into fragment descriptions of the
*consolidated* tensors, the ones a TP=1, PP=1, EP=1, unpadded model holds. Rules are data
(JSON or TOML, or DeepSpeed's ``universal_checkpoint_info``), stored with the checkpoint.

Matching (as DeepSpeed does it): each pattern is a regular expression applied with
``re.match`` to the parameter's FQN as the model's ``state_dict()`` names it on its rank.
A parameter takes the rule of the first matching kind in :data:`PRECEDENCE`; two matching
patterns of one kind are an error naming both, and so are patterns of two kinds that would
store it silently wrong (an ``average`` over a ``split`` tensor's parts, sub-parameters along
another dim than a ``split``); taken are ``pieces`` and ``replicated`` over anything (a save
checks replicas equal) and a ``split`` with ``fused`` or ``grouped`` along the same dim. A
parameter nothing matches takes the ``default`` rule (DeepSpeed's: split along dim 0). With
``strict`` (default), a pattern that matches no parameter of any rank is an error.

The vocabulary (``Rules.from_dict``)::

    {"params": [{"kind": "split", "patterns": [...], "dim": 1},           # row-parallel
                {"kind": "split", "patterns": [...], "widths": {"3": [5, 5, 4]}},  # uneven
                {"kind": "fused", "patterns": [...], "dim": 0, "sizes": [4096, 1024, 1024],
                 "widths": {"3": [[...], [...], [...]]}},                # uneven shards
                {"kind": "grouped", "patterns": [...], "groups": 8,      # per group [q; k; v]
                 "sizes": [512, 128, 128], "names": ["q", "k", "v"]},    # (Megatron-core's QKV)
                {"kind": "replicated", "patterns": [...]},                # equal on all TP ranks
                {"kind": "average", "patterns": [...]},                   # the mean is stored
                {"kind": "pieces", "patterns": [...], "shape": [...],     # the escape hatch
                 "pieces": {"2": [[piece, ...], [piece, ...]]}}],
     "vocab": {"patterns": [...], "size": 50257},        # padding rows stripped (dim 0)
     "rename": [{"pattern": "output_layer\\.weight", "to": "embedding.word_embeddings.weight"}],
     "pipeline": {"pattern": "decoder\\.layers\\.(\\d+)\\.", "num_layers": 24},   # or "offsets", or "global"
     "pipeline_replicated": [...],                        # tied parameters, stored once
     "experts": {"pattern": "...experts\\.(\\d+)\\.", "num_experts": 8},
     "model": {"framework": "megatron-core", "rotary_interleaved": false, ...},
     "default": "split", "strict": true}

``model`` records what the weights compute that their names and shapes do not tell (for
Megatron-core: the rotary embedding, the normalisation, the activation; see
:func:`ucp_zarr.adapters.megatron.model_facts`), for an export to check against the model it
writes for, and for a load to check against the rules it loads with (members both record
must be equal, unless ``allow_other_rules``); placing ignores it.

Every member's type and range is checked (:mod:`ucp_zarr.rules.schema`), for rules read
from a dict or file and for rules built in Python or from DeepSpeed's dicts alike.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from .params import PRECEDENCE, RULES_FORMAT, ParamRule, Renumber, RuleError, _compile, _first, _patterns
from .schema import check_rules


_OVER_ANYTHING = ("pieces", "replicated")
"""Kinds taken over any other that also matches (the later kinds are not looked at)."""


def _agree(chosen: ParamRule, other: ParamRule) -> bool:
    """Whether a parameter matched by rules of two kinds may take ``chosen`` (the first in
    :data:`PRECEDENCE`): explicit pieces (DeepSpeed prefers its affine maps to every
    category), replicated (a save checks the copies equal, so a split tensor taken for
    replicated is refused), a split with sub-parameters along the same dim (DeepSpeed
    AutoTP lists a row-parallel fused weight in both). Any other overlap stores it
    silently wrong: the mean of a split tensor's parts, sub-parameters along another dim."""
    if chosen.kind in _OVER_ANYTHING:
        return True
    kinds = {chosen.kind, other.kind}
    return "split" in kinds and kinds <= {"split", "fused", "grouped"} and (chosen.dim, chosen.axis) == (other.dim, other.axis)


@dataclass(frozen=True)
class Rules:
    """A trainer's conventions (see the module docstring for the vocabulary)."""

    params: tuple[ParamRule, ...] = ()
    vocab_patterns: tuple[str, ...] = ()
    vocab_size: int | None = None
    """The unpadded vocabulary size: rows beyond it (dim 0) are padding."""
    rename: tuple[tuple[str, str], ...] = ()
    """``(pattern, replacement)``: the consolidated name of a parameter (``re.fullmatch``,
    groups allowed in the replacement), such as an output layer tied to the embedding."""
    pipeline: Renumber | str | None = None
    """Local layer index -> global, per pipeline stage; ``"global"``: the names are global
    already (DeepSpeed's pipeline modules); ``None``: no pipeline parallelism (``pp_size`` 1)."""
    pipeline_replicated: tuple[str, ...] = ()
    experts: Renumber | str | None = None
    """Local expert index -> global, per expert-parallel rank (or ``"global"``, or ``None``)."""
    model: Mapping[str, Any] | None = None
    """What the trained model computes that the weights do not tell (JSON values by name)."""
    default: str = "split"
    """The rule of a parameter no pattern matches: ``split`` (dim 0, DeepSpeed's default),
    ``replicated``, or ``error``."""
    strict: bool = True

    def __post_init__(self) -> None:
        if self.default not in ("split", "replicated", "error"):
            raise RuleError(f"default must be 'split', 'replicated' or 'error', not {self.default!r}")
        if self.vocab_patterns and self.vocab_size is None:
            raise RuleError("vocabulary patterns need the original (unpadded) vocabulary size")
        for p in self.vocab_patterns + self.pipeline_replicated + tuple(p for p, _ in self.rename):
            _compile(p)
        check_rules(self.to_dict())  # (rules built in Python, or from DeepSpeed's dicts, are checked as data)

    # --- building ------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Rules":
        """Rules from our vocabulary, or from DeepSpeed's ``universal_checkpoint_info``
        (recognised by its keys)."""
        if not isinstance(d, Mapping):
            raise RuleError(f"rules must be a mapping, not {type(d).__name__}")
        if any(k in d for k in _DEEPSPEED_KEYS):
            return cls.from_deepspeed(d)
        if d.get("format", RULES_FORMAT) != RULES_FORMAT:
            raise RuleError(f"rules of format {d['format']!r}; this library reads {RULES_FORMAT!r}")
        check_rules(d)  # every field's type and range, before anything is converted
        vocab = d.get("vocab") or {}
        try:
            return cls(
                params=tuple(ParamRule.from_dict(r) for r in d.get("params", ())),
                vocab_patterns=_patterns(vocab.get("patterns", ())),
                vocab_size=None if vocab.get("size") is None else int(vocab["size"]),
                rename=tuple((str(r["pattern"]), str(r["to"])) for r in d.get("rename", ())),
                pipeline=Renumber.read(d.get("pipeline"), "pipeline"),
                pipeline_replicated=_patterns(d.get("pipeline_replicated", ())),
                experts=Renumber.read(d.get("experts"), "experts"),
                model=None if d.get("model") is None else dict(d["model"]),
                default=d.get("default", "split"),
                strict=d.get("strict", True),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, RuleError):
                raise
            raise RuleError(f"malformed rules: {e!r}") from None

    @classmethod
    def load(cls, path: str | Path) -> "Rules":
        """Rules from a JSON or TOML file (by suffix; JSON otherwise)."""
        path = Path(path)
        raw = path.read_bytes()
        try:
            d = tomllib.loads(raw.decode()) if path.suffix.lower() == ".toml" else json.loads(raw)
        except (ValueError, tomllib.TOMLDecodeError) as e:
            raise RuleError(f"{path}: not valid {'TOML' if path.suffix.lower() == '.toml' else 'JSON'}: {e}") from None
        return cls.from_dict(d)

    @classmethod
    def from_deepspeed(cls, info: Mapping[str, Any]) -> "Rules":
        """Rules from DeepSpeed's ``universal_checkpoint_info`` dict, as DeepSpeed and
        Megatron-DeepSpeed write it (versions 0.2 to 0.4)."""
        from ..adapters.deepspeed_rules import rules_from_deepspeed

        return rules_from_deepspeed(cls, info)

    @classmethod
    def from_megatron(cls, model: Any, *, vocab_size: int) -> "Rules":
        """Rules from a megatron-core ``GPTModel`` on its rank (its config, tied output layer
        and pipeline stage); ``vocab_size`` is the tokenizer's size before Megatron pads it.
        See :mod:`ucp_zarr.adapters.megatron`."""
        from ..adapters.megatron import rules_from_megatron

        return rules_from_megatron(cls, model, vocab_size=vocab_size)

    def to_dict(self) -> dict[str, Any]:
        """Our vocabulary, as JSON-able data (``Rules.from_dict`` gives back equal rules)."""
        d: dict[str, Any] = {"format": RULES_FORMAT, "params": [r.to_dict() for r in self.params]}
        if self.vocab_patterns:
            d["vocab"] = {"patterns": list(self.vocab_patterns), "size": self.vocab_size}
        if self.rename:
            d["rename"] = [{"pattern": p, "to": t} for p, t in self.rename]
        if self.pipeline is not None:
            d["pipeline"] = self.pipeline.to_dict() if isinstance(self.pipeline, Renumber) else self.pipeline
        if self.pipeline_replicated:
            d["pipeline_replicated"] = list(self.pipeline_replicated)
        if self.experts is not None:
            d["experts"] = self.experts.to_dict() if isinstance(self.experts, Renumber) else self.experts
        if self.model is not None:
            d["model"] = dict(self.model)
        return d | {"default": self.default, "strict": self.strict}

    # --- matching ------------------------------------------------------------------------

    def match(self, fqn: str) -> tuple[ParamRule, str | None]:
        """The rule of parameter ``fqn`` and the pattern that chose it (None: the default)."""
        chosen: tuple[ParamRule, str] | None = None
        for kind in PRECEDENCE:
            hits = [(r, p) for r in self.params if r.kind == kind for p in r.patterns if _compile(p).match(fqn)]
            if chosen is None and len(hits) > 1:
                raise RuleError(
                    f"parameter {fqn!r} is matched by two {kind} patterns: {hits[0][1]!r} and {hits[1][1]!r}"
                )
            if chosen is None and hits:
                chosen = hits[0]
                if chosen[0].kind in _OVER_ANYTHING:
                    break
            elif hits and chosen is not None and not _agree(chosen[0], hits[0][0]):
                raise RuleError(
                    f"parameter {fqn!r} is matched by {chosen[0].kind} pattern {chosen[1]!r} and {kind} pattern "
                    f"{hits[0][1]!r}, which store it differently: make the patterns exclusive (anchor them with '$')"
                )
        if chosen is not None:
            return chosen
        if self.default == "error":
            raise RuleError(f"no rule matches parameter {fqn!r} (and the rules' default is 'error')")
        return ParamRule(self.default, (".*",)), None

    def vocab_match(self, fqn: str) -> str | None:
        return _first(self.vocab_patterns, fqn, "vocabulary")

    def is_pipeline_replicated(self, fqn: str) -> bool:
        return _first(self.pipeline_replicated, fqn, "pipeline-replicated") is not None

    def consolidated_name(
        self, fqn: str, *, pp_rank: int, pp_size: int, ep_rank: int, ep_size: int, rename: bool = True
    ) -> str:
        """The parameter's name in the consolidated model: renamed (unless not ``rename``),
        its layer renumbered for its pipeline stage and its expert for its expert-parallel rank."""
        for pattern, to in self.rename if rename else ():
            m = _compile(pattern).fullmatch(fqn)
            if m is not None:
                fqn = m.expand(to)
                break
        if isinstance(self.pipeline, Renumber):
            fqn = self.pipeline.apply(fqn, pp_rank, pp_size, "pipeline")
        if isinstance(self.experts, Renumber):
            fqn = self.experts.apply(fqn, ep_rank, ep_size, "experts")
        return fqn

    def all_patterns(self) -> list[str]:
        """Every pattern that should match some parameter (checked in strict mode; as in
        DeepSpeed, pipeline-replicated patterns are not)."""
        return [p for r in self.params for p in r.patterns] + list(self.vocab_patterns) + [p for p, _ in self.rename]

    def pattern_used(self, pattern: str, fqns: Iterable[str]) -> bool:
        rx = _compile(pattern)
        is_rename = any(pattern == p for p, _ in self.rename)
        return any((rx.fullmatch(f) if is_rename else rx.match(f)) for f in fqns)



_DEEPSPEED_KEYS = (
    "universal_checkpoint_version", "vocabulary_parameter_patterns", "tp_replicated_parameter_patterns",
    "parameter_to_average_patterns", "parameter_with_row_parallelism_patterns",
    "parameter_with_2_sub_params_cat_dim_0", "parameter_with_sub_params", "pipeline_replicated_parameter_patterns",
    "original_vocab_size", "padded_vocab_size",
)
