"""DeepSpeed's ``universal_checkpoint_info`` as :class:`~ucp_zarr.Rules` (pure).

DeepSpeed (``deepspeed/checkpoint/ds_to_universal.py``) and Megatron-DeepSpeed write this
dict into their checkpoints (versions 0.2 to 0.4). Each key becomes a rule of ours:

==========================================  =================================================
``tp_replicated_parameter_patterns``        ``replicated`` (checked equal across TP)
``parameter_to_average_patterns``           ``average``
``parameter_with_2_sub_params_cat_dim_0``   ``fused`` along dim 0, two equal halves
``parameter_with_sub_params``               ``fused`` along ``partition_dim``: a tuple there
                                            gives the sizes, an int (before 0.4) a count of
                                            equal sub-parameters; from 0.4 on, the widths of
                                            ``sub_param_shard_widths[pattern]``
``parameter_with_row_parallelism_patterns``  ``split`` along dim 1
(nothing matched)                           ``split`` along dim 0 (DeepSpeed's default)
``vocabulary_parameter_patterns``           rows beyond ``original_vocab_size`` are padding
``pipeline_replicated_parameter_patterns``  ``pipeline_replicated`` (stored once)
``affine_map`` (0.19.8: AutoTP)             ``pieces``: each rank's blocks, placed as DeepSpeed's
                                            ``ParamAffineMap.rebuild`` places them
                                            (:mod:`ucp_zarr.layout.affine`)
==========================================  =================================================

Precedence is DeepSpeed's (affine maps, then replicated, averaged, sub-parameters,
row/column), except that a parameter matched by both a two-halves pattern and a
sub-parameter pattern is an error here (DeepSpeed takes the first). Patterns are matched
with ``re.match``, as DeepSpeed does. No map is ignored: one this library cannot place
exactly (a newer format, a scaled piece, strides that are not a box) is refused, naming its
pattern; so are AutoEP's expert layers, the parameters DeepSpeed marks unconvertible, and keys
of the info this library does not know.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, TypeVar

from ..layout.affine import AFFINE_MAP_VERSION, AffineMapError, affine_layout
from ..rules.params import ParamRule, RuleError, as_int

_KNOWN = {
    "universal_checkpoint_version", "original_vocab_size", "padded_vocab_size", "vocabulary_parameter_patterns",
    "pipeline_replicated_parameter_patterns", "parameter_to_average_patterns", "tp_replicated_parameter_patterns",
    "parameter_with_row_parallelism_patterns", "parameter_with_2_sub_params_cat_dim_0", "parameter_with_sub_params",
    "sub_param_shard_widths", "autotp_unsupported_parameter_patterns", "affine_map",
}
_AUTOEP = ("ds_autoep_layers", "autoep_layers", "expert_parameter_patterns")
"""AutoEP's keys (expert placements, with affine maps of their own): refused when set."""


def autoep_refusal(d: Mapping[str, Any]) -> str | None:
    """Why ``d`` (a ``universal_checkpoint_info``, or a model-states file) cannot be placed or
    converted: AutoEP's keys set in it; None without."""
    autoep = [k for k in _AUTOEP if d.get(k)]
    if not autoep:
        return None
    return (f"DeepSpeed AutoEP expert layers ({', '.join(autoep)}) are not supported: convert a checkpoint of "
            "deepspeed.moe.layer.MoE experts, or one without AutoEP")


R = TypeVar("R")


def rules_from_deepspeed(rules_type: Callable[..., R], info: Mapping[str, Any], *, strict: bool = True) -> R:
    """Rules equivalent to DeepSpeed's ``universal_checkpoint_info`` ``info``, built by ``rules_type``
    (:class:`~ucp_zarr.Rules`, whose ``from_deepspeed`` calls this: the rule language does not
    know DeepSpeed, and this adapter does not import it)."""
    if not isinstance(info, Mapping):
        raise RuleError(f"universal_checkpoint_info must be a dict, not {type(info).__name__}")
    autoep = autoep_refusal(info)
    if autoep:
        raise RuleError(autoep)
    unknown = sorted(set(info) - _KNOWN - set(_AUTOEP))
    if unknown:  # a newer DeepSpeed's placement key, unread, would place its parameters by the default rule
        raise RuleError(
            f"universal_checkpoint_info holds keys this version of ucp_zarr does not know: {unknown}; they may say "
            "how parameters are split, and placing them by the other keys alone could be wrong. Upgrade ucp_zarr, or "
            "pass rules (a ucp_zarr.Rules saying how every tensor is split) to place them without this info"
        )
    unsupported = info.get("autotp_unsupported_parameter_patterns") or {}
    if unsupported:
        raise RuleError(f"DeepSpeed marks these parameters as not convertible: {dict(unsupported)}")
    try:
        version = float(info.get("universal_checkpoint_version", 0.0))
    except (TypeError, ValueError):
        raise RuleError(f"universal_checkpoint_version {info['universal_checkpoint_version']!r} is not a number") from None

    def patterns(key: str) -> tuple[str, ...]:
        value = info.get(key) or ()
        if isinstance(value, str) or not all(isinstance(p, str) for p in value):
            raise RuleError(f"{key} must be a list of pattern strings, got {value!r}")
        return tuple(value)

    params: list[ParamRule] = _affine_rules(info.get("affine_map"))
    for kind, key in (("replicated", "tp_replicated_parameter_patterns"), ("average", "parameter_to_average_patterns")):
        if patterns(key):
            params.append(ParamRule(kind, patterns(key)))
    if patterns("parameter_with_2_sub_params_cat_dim_0"):
        params.append(ParamRule("fused", patterns("parameter_with_2_sub_params_cat_dim_0"), dim=0, sizes=(-1, -1)))
    widths = info.get("sub_param_shard_widths") or {}
    for entry in info.get("parameter_with_sub_params") or ():
        try:
            params += _sub_params(entry, widths, version)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, RuleError):
                raise
            raise RuleError(f"malformed parameter_with_sub_params entry {entry!r}: {e!r}") from None
    if patterns("parameter_with_row_parallelism_patterns"):
        params.append(ParamRule("split", patterns("parameter_with_row_parallelism_patterns"), dim=1))
    vocab = patterns("vocabulary_parameter_patterns")
    size = info.get("original_vocab_size")
    if vocab and not isinstance(size, int):
        raise RuleError(f"vocabulary_parameter_patterns {list(vocab)} need an integer original_vocab_size, got {size!r}")
    return rules_type(
        params=tuple(params),
        vocab_patterns=vocab,
        vocab_size=size if vocab else None,
        pipeline="global",  # (DeepSpeed's pipeline modules name their layers by the global index)
        pipeline_replicated=patterns("pipeline_replicated_parameter_patterns"),
        # AutoTP's affine map names every parameter it splits or keeps whole; what it does not
        # name (a buffer, the alias of a tied weight) AutoTP leaves whole on every rank: stored
        # once, its copies compared at save. Megatron-DeepSpeed's keys: split on dim 0 by default
        default="replicated" if info.get("affine_map") else "split",
        strict=strict,
    )


def _affine_rules(section: Any) -> list[ParamRule]:
    """``pieces`` rules of ``universal_checkpoint_info["affine_map"]`` (``{"version", "params"}``)."""
    if section is None:
        return []
    if not isinstance(section, Mapping) or set(section) - {"version", "params"}:
        raise RuleError(f"affine_map must be a mapping of 'version' and 'params', got "
                        f"{sorted(section) if isinstance(section, Mapping) else type(section).__name__}")
    version = section.get("version", AFFINE_MAP_VERSION)
    if isinstance(version, bool) or not isinstance(version, int) or version > AFFINE_MAP_VERSION:
        raise RuleError(f"affine_map format version {version!r}: this library reads versions up to {AFFINE_MAP_VERSION}")
    maps = section.get("params") or {}
    if not isinstance(maps, Mapping):
        raise RuleError(f"affine_map params must map patterns to maps, not {type(maps).__name__}")
    out = []
    for pattern, entry in maps.items():
        try:
            layout = affine_layout(entry)
        except AffineMapError as e:
            raise RuleError(f"affine map of {pattern!r}: {e}") from None
        out.append(ParamRule("pieces", (str(pattern),), shape=layout.shape,
                             pieces={len(layout.pieces): layout.pieces}))
    return out


def _sub_params(entry: Any, widths: Mapping[str, Any], version: float) -> list[ParamRule]:
    """One ``parameter_with_sub_params`` entry: ``{patterns, shape, partition_dim}``."""
    if not isinstance(entry, Mapping) or set(entry) != {"patterns", "shape", "partition_dim"}:
        raise RuleError(f"parameter_with_sub_params entry {entry!r} must have exactly patterns, shape, partition_dim")
    pats, shape, pd = entry["patterns"], list(entry["shape"]), entry["partition_dim"]
    if isinstance(pats, str) or not isinstance(pd, int) or not 0 <= pd < len(shape):
        raise RuleError(f"parameter_with_sub_params entry {dict(entry)!r}: bad patterns or partition_dim")
    at = shape[pd]
    if isinstance(at, (list, tuple)):
        sizes = tuple(as_int(n) for n in at)
    elif isinstance(at, int) and at > 0:
        sizes = (-1,) * at  # a count of equal sub-parameters (DeepSpeed's reading before 0.4)
    else:
        raise RuleError(f"parameter_with_sub_params entry {dict(entry)!r}: shape[{pd}] must be sizes or a count")
    view = tuple(-1 if i == pd else as_int(n) for i, n in enumerate(shape))
    out = []
    for pattern in pats:
        by_tp = {}
        if version >= 0.4:
            w = widths.get(pattern)
            if w is None:
                raise RuleError(f"sub-parameter pattern {pattern!r}: version {version} needs sub_param_shard_widths for it")
            if len(w) != len(sizes) or len({len(x) for x in w}) != 1:
                raise RuleError(f"sub_param_shard_widths[{pattern!r}] = {w!r} does not give one list per sub-parameter")
            by_tp = {len(w[0]): tuple(tuple(as_int(x) for x in ws) for ws in w)}
        out.append(ParamRule("fused", (str(pattern),), dim=pd, sizes=sizes, widths=by_tp, view=view))
    return out
