""":func:`place`: a rank's state dict of plain local tensors, placed on the consolidated
tensors by :class:`~ucp_zarr.Rules`."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable, Mapping

import torch

from ..errors import LayoutError
from ..protocol.fragments import FlatShard, PerRank, Placed
from ..protocol.hooks import LayoutHooks
from ..layout import groups as G
from ..layout import pieces as P
from ..format.optimizer_names import number_names
from .language import Rules
from .params import ParamRule, RuleError, same_meaning
from ..format.statedict import Path, iter_leaves, set_leaf, with_metadata

_STAGE = "\0pipeline stage "
"""Marks an entry of :attr:`Placed.used <ucp_zarr.Placed.used>` that is no pattern but this
rank's claim on a key: ``_STAGE + "<pp_rank>:<key>"`` (checked across ranks by :func:`check_used`)."""


class PlacementError(RuleError, LayoutError):
    """The rules do not fit the parallel layout: a pipeline (expert) degree without a rule
    that renumbers its layers (experts), or one tensor placed by two pipeline stages."""


def place(
    state_dict: Mapping[str, Any],
    rules: Rules,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    ep_rank: int = 0,
    ep_size: int = 1,
    model: torch.nn.Module | None = None,
) -> dict[str, Any]:
    """A state dict of the same structure whose tensors are :class:`~ucp_zarr.Placed`
    descriptions of their consolidated tensors; :func:`ucp_zarr.save` and
    :func:`ucp_zarr.load` accept it (``load`` fills the original local tensors in place).

    Parameter FQNs are read from the structure: a top-level key is an FQN
    (``model.state_dict()`` itself); below a top-level mapping, the rest of the path is
    (``{"model": model.state_dict()}``); optimizer state keyed by FQN
    (``{"optim": {"state": {fqn: {"exp_avg": t}}}}``, as ``get_state_dict`` gives it) follows
    its parameter's rule when it has the parameter's local shape, and stays whole (checked
    equal across ranks) when it is a scalar such as ``step``. A :class:`~ucp_zarr.FlatShard`
    whose ``global_shape`` is the parameter's local shape is a flat range of the local
    parameter (a distributed optimizer's partition): it is composed with the rule.

    Optimizer state keyed by parameter number (a plain ``optimizer.state_dict()``, at the top
    or under a key) is named by its param groups' ``param_names`` (an optimizer built from
    ``model.named_parameters()``), else by the order of ``model.named_parameters()`` when
    ``model`` is given (checked: the groups number exactly the model's parameters, with their
    shapes); it is stored under the parameter's name (``optim.state.<name>.exp_avg``), so it
    loads at any layout. A number whose parameter is not knowable is refused. With ``model``,
    the parameters Megatron marks as split (Megatron-LM, Megatron-core, Megatron-DeepSpeed)
    must have rules that split them so (:func:`check_split_marks`): hand-written rules are
    checked as :meth:`Rules.from_megatron <ucp_zarr.Rules.from_megatron>`'s are.

    Raises :class:`~ucp_zarr.rules.params.RuleError` naming the parameter and the rule when the
    rules do not fit (ambiguous or, in strict mode with every parameter on this rank,
    unused patterns; sizes that do not add up; a degree a head count cannot be split by;
    ``pp_size`` > 1 without a ``pipeline`` entry, ``ep_size`` > 1 without an ``experts``
    entry or an ``ep`` split rule: :class:`PlacementError`, also a
    :class:`~ucp_zarr.LayoutError`). Whether two pipeline stages place one tensor, and (with
    several stages or expert ranks) whether every pattern matched, is checked by the save,
    across every rank (:func:`check_used`).
    """
    for name, rank, size in (("tp", tp_rank, tp_size), ("pp", pp_rank, pp_size), ("ep", ep_rank, ep_size)):
        if not (isinstance(size, int) and isinstance(rank, int) and 0 <= rank < size):
            raise RuleError(f"{name}_rank {rank!r} is not a rank of {name}_size {size!r}")
    _check_degrees(rules, pp_size, ep_size)
    placer = _Placer(rules, tp_rank, tp_size, pp_rank, pp_size, ep_rank, ep_size)
    owners = _Owners(state_dict, model)
    located = [(leaf, *owners.locate(leaf.path)) for leaf in iter_leaves(state_dict)]
    params = {fqn: leaf.value for leaf, fqn, _, opt in located if not opt and isinstance(leaf.value, (torch.Tensor, FlatShard))}
    owners.check_names(params)
    if model is not None:
        check_split_marks(rules, model, params, tp_size)
    out = _copy_structure(state_dict)
    placed: list[Placed] = []
    others: list[tuple[Path, str, tuple[int, int]]] = []
    for leaf, fqn, at, optimizer_state in located:
        value = leaf.value
        if isinstance(value, PerRank) or not isinstance(value, (torch.Tensor, FlatShard)):
            if not (optimizer_state and isinstance(leaf.path[at[0]], int)):  # (numbered state keeps its number)
                others.append((leaf.path, fqn, at))
            continue
        param = params.get(fqn)
        param_shape = tuple(param.shape) if isinstance(param, torch.Tensor) else None
        placed.append(placer.place(value, fqn, leaf.path, at, param_shape, optimizer_state))
        set_leaf(out, leaf.path, placed[-1])
    claims = {f"{_STAGE}{pp_rank}:{p.key}" for p in placed if p.stored} if pp_size > 1 else set()
    used = frozenset(placer.used | claims)
    rules_dict = rules.to_dict()
    for p in placed:  # (known only once every leaf is placed)
        p.used = used
        p.rules = rules_dict
        p.hooks = RULES_HOOKS
    _rename_values(out, others, placer)
    if rules.strict and pp_size == 1 and ep_size == 1:
        check_used(rules, [used])
    return out



def check_split_marks(rules: Rules, model: torch.nn.Module, fqns: Iterable[str], tp_size: int) -> None:
    """Raise :class:`RuleError` where a parameter of ``model`` among ``fqns`` (its name, or
    without wrappers' ``module.``) is marked as split the way Megatron marks them
    (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``, set by Megatron-LM,
    Megatron-core and Megatron-DeepSpeed as they build their layers) and its rule does not
    split it so, over its layer's ``tp_group`` where the layer has one (an expert layer's is
    the expert tensor-parallel group): a group of one rank (experts not split) in a job of
    ``tp_size`` > 1 holds it whole, which a rule splitting it over TP gets wrong; a group of
    another size is not checked; a group of ``tp_size`` ranks (or none known) needs a
    ``split``, ``grouped`` or ``fused`` rule along ``partition_dim``, and for a stride above 1
    a ``fused`` rule of that many sub-parameters (each rank's block of each one, in turn). (A stride of 1 tells nothing more: Megatron-core's SwiGLU under Kitchen
    records 1 for its fused ``[gate; up]``; and unmarked parameters tell nothing: Megatron
    leaves the mark off parameters it does not initialise.)"""
    wanted = set(fqns)
    for layer_name, layer in model.named_modules():
        group = getattr(layer, "tp_group", None)
        size = group.size() if group is not None and hasattr(group, "size") else tp_size
        if size not in (1, tp_size):
            continue
        for name, param in layer.named_parameters(prefix=layer_name, recurse=False):
            fqn = name
            while fqn not in wanted and fqn.startswith("module."):
                fqn = fqn.removeprefix("module.")
            if fqn in wanted and getattr(param, "tensor_model_parallel", False):
                _check_mark(rules, fqn, param, whole=size == 1 < tp_size)


def _check_mark(rules: Rules, fqn: str, param: torch.nn.Parameter, whole: bool) -> None:
    rule, pattern = rules.match(fqn)
    if whole:
        if rule.kind in ("split", "grouped", "fused") and rule.axis == "tp":
            raise RuleError(f"Megatron holds parameter {fqn!r} whole on every tensor-parallel rank (its layer's "
                            f"tensor-parallel group is one rank), but its rule ({pattern or 'the default'!r}) splits it "
                            f"over them: {rule.to_dict()}; give it a replicated rule")
        return
    dim, stride = getattr(param, "partition_dim", 0), getattr(param, "partition_stride", 1)
    subs = len(rule.sizes or ()) if rule.kind == "fused" else 1
    if rule.kind not in ("split", "grouped", "fused") or rule.dim != dim or stride > 1 and subs != stride:
        raise RuleError(f"Megatron splits parameter {fqn!r} along dim {dim} (stride {stride}), but its rule "
                        f"({pattern or 'the default'!r}) is {rule.to_dict()}")


class RulesHooks(LayoutHooks):
    """The rule language's checks, plugged into saves and loads by every tensor
    :func:`place` places: all ranks' placements together (:func:`check_used`), whether the
    saved rules' ``model`` is the loading rules' (:meth:`other_layout`), and whether a stored
    tensor has the consolidated form the loading rules expect (:func:`same_meaning`)."""

    def check_placements(self, layout: Mapping[str, Any], used_by_rank: list[frozenset[str]]) -> None:
        check_used(Rules.from_dict(layout), used_by_rank)

    def other_layout(self, saved: Mapping[str, Any], loading: Mapping[str, Any]) -> str | None:
        """The members of ``model`` (what the weights compute: rotary frequencies, norm,
        activation) that both rules record and that differ: the same weights, another model."""
        a, b = saved.get("model") or {}, loading.get("model") or {}
        differ = sorted(k for k in a.keys() & b.keys() if not _same_fact(a[k], b[k]))
        if not differ:
            return None
        return "its model computes something else than the loading rules' model (" + "; ".join(
            f"{k}: {_short(a[k])} saved, {_short(b[k])} loading" for k in differ) + ")"

    def same_form(self, saved: Mapping[str, Any] | None, loading: Mapping[str, Any] | None) -> bool:
        return same_meaning(saved, loading)

    def stored_padding(self, saved: Mapping[str, Any] | None, loading: Mapping[str, Any] | None) -> int | None:
        """The loading rules' vocabulary size, where it is smaller than the saved one (the
        rows stored beyond it are padding to the loading rules: a checkpoint saved with
        the padded size, as a bit-exact resume saves it, loads into a layout that pads less)
        and the forms are otherwise the same."""
        if not saved or not loading or "vocab" not in saved or "vocab" not in loading:
            return None
        rows = loading["vocab"]
        if not rows < saved["vocab"] or not same_meaning(dict(saved) | {"vocab": rows}, loading):
            return None
        return int(rows)


def _same_fact(a: Any, b: Any) -> bool:
    """Equal, numbers within a relative 1e-6 (rotary frequencies computed on another device
    may differ in the last bit), lists element by element."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_fact(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-6)
    return bool(a == b)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


RULES_HOOKS = RulesHooks()
"""(Stateless: one instance serves every placement.)"""

def _rename_values(out: dict[str, Any], paths: list[tuple[Path, str, tuple[int, int]]], placer: "_Placer") -> None:
    """Values that are no tensors under a parameter's FQN (a module's ``_extra_state``, an int
    ``step``) take its consolidated name too (a pipeline stage's layer 0 is not the model's)."""
    moves: dict[tuple[Path, Any], str] = {}
    for path, fqn, (start, stop) in paths:
        name = placer.consolidated_name(fqn)
        if name == fqn:
            continue
        if stop - start != 1:
            raise RuleError(f"{'.'.join(map(str, path))!r} is not a tensor and sits below parameter {fqn!r}, renamed "
                            f"{name!r}: give its FQN as one key (as model.state_dict() does)")
        moves[path[:start], path[start]] = name
    by_parent: dict[Path, dict[Any, str]] = defaultdict(dict)
    for (parent_path, key), name in moves.items():
        by_parent[parent_path][key] = name
    for parent_path, renames in by_parent.items():  # (all of a parent's keys move at once: a stage of
        parent = out                                 # uneven pipeline stages renames layer 0 to 1 and 1 to 2)
        for part in parent_path:
            parent = parent[part]
        moved = {key: parent.pop(key) for key in renames}
        for key, name in renames.items():
            if name in parent:
                raise RuleError(f"{key!r} is renamed {name!r}, which the state dict holds too")
            parent[name] = moved[key]


def check_used(rules: Rules, used_by_rank: list[frozenset[str]]) -> None:
    """What only every rank's placement together shows (``Placed.used`` of each rank; the
    save checks it): no tensor is placed by two pipeline stages (a :class:`PlacementError`
    naming the key and the stages), and in strict mode every pattern matches some parameter
    on some rank."""
    stages: dict[str, set[int]] = defaultdict(set)
    patterns: set[str] = set()
    for used in used_by_rank:
        for entry in used:
            if entry.startswith(_STAGE):
                stage, key = entry[len(_STAGE):].split(":", 1)
                stages[key].add(int(stage))
            else:
                patterns.add(entry)
    clash = sorted((key, sorted(s)) for key, s in stages.items() if len(s) > 1)
    if clash:
        key, s = clash[0]
        raise PlacementError(
            f"tensor {key!r} is placed by pipeline stages {s}{f' (and {len(clash) - 1} other tensors)' * (len(clash) > 1)}:"
            " each stage would overwrite the others' copy. Renumber its layer per stage (the rules' 'pipeline' entry), "
            "or list a parameter tied across stages in 'pipeline_replicated' (stored once, its copies compared)"
        )
    if not rules.strict:
        return
    unused = [p for p in rules.all_patterns() if p not in patterns]
    if unused:
        raise RuleError(f"rule patterns that match no parameter: {unused} (pass strict=False in the rules to allow it)")


def _check_degrees(rules: Rules, pp_size: int, ep_size: int) -> None:
    """Pipeline and expert parallelism need rules that say how local names become global."""
    if pp_size > 1 and rules.pipeline is None:
        raise PlacementError(
            f"pp_size is {pp_size}, but the rules have no 'pipeline' entry: every stage would place its layers under "
            "their local names, so stage 1's layer 0 would be stored as stage 0's. Give the rules a pipeline entry "
            "({'pattern': 'decoder\\.layers\\.(\\d+)\\.', 'num_layers': N}, or 'offsets'), or "
            "\"pipeline\": \"global\" when the names are global across stages already (DeepSpeed's pipeline modules)"
        )
    if ep_size > 1 and rules.experts is None and not any(r.axis == "ep" for r in rules.params):
        raise PlacementError(
            f"ep_size is {ep_size}, but the rules have no 'experts' entry and no split rule with axis 'ep': every "
            "expert-parallel rank would place its experts under their local names. Give the rules an experts entry "
            "({'pattern': '...local_experts\\.(\\d+)\\.', 'num_experts': N}), an 'ep' split rule for experts "
            "stacked in one tensor, or \"experts\": \"global\" when the names are global already"
        )


class _Placer:
    def __init__(self, rules: Rules, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int, ep_rank: int, ep_size: int):
        self.rules = rules
        self.tp = (tp_rank, tp_size)
        self.pp = (pp_rank, pp_size)
        self.ep = (ep_rank, ep_size)
        self.used: set[str] = set()
        self._names = set(rules.all_patterns())

    def consolidated_name(self, fqn: str, rename: bool = True) -> str:
        return self.rules.consolidated_name(fqn, pp_rank=self.pp[0], pp_size=self.pp[1], ep_rank=self.ep[0],
                                            ep_size=self.ep[1], rename=rename)

    def place(
        self, value: torch.Tensor | FlatShard, fqn: str, path: Path, at: tuple[int, int], param_shape: tuple[int, ...] | None,
        optimizer_state: bool,
    ) -> Placed:
        rules = self.rules
        cfqn = self.consolidated_name(fqn)
        key = ".".join(str(p) for p in path[: at[0]] + (cfqn,) + path[at[1] :])
        own = self.consolidated_name(fqn, rename=False)  # (renamed onto another tensor: a tie)
        alias = None if own == cfqn else ".".join(str(p) for p in path[: at[0]] + (own,) + path[at[1] :])
        for pattern in self._names:
            if rules.pattern_used(pattern, [fqn]):
                self.used.add(pattern)
        local = value.local if isinstance(value, FlatShard) else value
        shape = tuple(value.global_shape) if isinstance(value, FlatShard) else tuple(local.shape)
        if optimizer_state and (param_shape is not None and shape != param_shape or param_shape is None and not shape):
            if local.numel() <= 1 and not isinstance(value, FlatShard):  # a scalar such as Adam's step
                return Placed(local, key, tuple(local.shape), tuple(P.whole(local.shape)), replicated=True,
                              meaning={"kind": "replicated"}, rule="(scalar optimizer state)",
                              stored=self.pp[0] == 0 or not rules.is_pipeline_replicated(fqn), alias=alias)
            raise RuleError(
                f"optimizer state {'.'.join(map(str, path))!r} has shape {list(shape)}, not its parameter "
                f"{fqn!r}'s {list(param_shape)}, and is not a scalar: give it a rule of its own"
            )
        rule, pattern = rules.match(fqn)
        where = f"parameter {fqn!r} (rule {pattern!r})" if pattern else f"parameter {fqn!r} (default rule)"
        try:
            glob, pieces = self._compile(rule, shape)
            pad: list[P.Piece] = []
            vocab = rules.vocab_match(fqn)
            if vocab is not None:
                assert rules.vocab_size is not None
                if glob[0] < rules.vocab_size:
                    raise RuleError(
                        f"{where}: {glob[0]} rows in the padded vocabulary, fewer than its {rules.vocab_size} entries"
                    )
                pieces, pad = P.clip(pieces, 0, rules.vocab_size)
                glob = (rules.vocab_size,) + glob[1:]
            if isinstance(value, FlatShard):
                if value.slab_shape is not None:
                    raise RuleError(f"{where}: a FlatShard given to place() is a flat range of the local tensor, no slab")
                start, stop = value.flat_offset, value.flat_offset + local.numel()
                if local.dim() != 1 or not 0 <= start <= stop <= math.prod(shape):
                    raise RuleError(f"{where}: flat range [{start}, {stop}) of a local tensor of shape {list(shape)}")
                pieces = P.flat_range(shape, pieces, start, stop)
                pad = P.flat_range(shape, pad, start, stop)
            P.check_pieces(pieces, tuple(local.shape), glob, pad)
        except P.PieceError as e:
            raise RuleError(f"{where}: {e}") from None
        meaning = rule.meaning(rules.vocab_size if vocab is not None else None)
        if rule.kind == "fused":  # the sizes as resolved for this tensor (placeholders filled in)
            meaning["sizes"] = self._sizes(rule, shape)
        return Placed(
            local, key, glob, tuple(pieces), tuple(pad), replicated=rule.kind == "replicated",
            average=rule.kind == "average", meaning=meaning, rule=pattern or "(default)",
            stored=self.pp[0] == 0 or not rules.is_pipeline_replicated(fqn), alias=alias,
        )

    def _sizes(self, rule: ParamRule, shape: tuple[int, ...]) -> list[int]:
        """A fused rule's sub-parameter sizes for a local tensor of ``shape``: from the
        widths given for this TP size, else the placeholders resolved for an even split."""
        assert rule.sizes is not None
        tp_size = self.tp[1]
        if tp_size in rule.widths:  # (the rules checked that the widths' sums are the sizes given)
            return [sum(w) for w in rule.widths[tp_size]]
        return _resolve_sizes(list(rule.sizes), shape[rule.dim] * tp_size)

    def _compile(self, rule: ParamRule, shape: tuple[int, ...]) -> tuple[tuple[int, ...], list[P.Piece]]:
        tp_rank, tp_size = self.tp
        if rule.kind in ("replicated", "average"):
            return shape, P.whole(shape)
        if rule.kind == "split":
            if not shape:
                raise P.PieceError("a 0-d tensor cannot be split; make it replicated")
            rank, size = self.ep if rule.axis == "ep" else self.tp
            if size in rule.widths:  # uneven shards: the rule gives every rank's width
                widths = list(rule.widths[size][0])
                return P.sub_params(shape, rule.dim, [sum(widths)], [widths], rank)
            return P.split(shape, rule.dim, rank, size)
        if rule.kind == "fused":
            assert rule.sizes is not None
            if rule.dim >= len(shape):
                raise P.PieceError(f"cannot split dim {rule.dim} of a tensor of shape {list(shape)}")
            sizes = self._sizes(rule, shape)
            if tp_size in rule.widths:
                widths = [list(w) for w in rule.widths[tp_size]]
            else:
                widths = P.even_widths(sizes, tp_size)
            glob, pieces = P.sub_params(shape, rule.dim, sizes, widths, tp_rank)
            if rule.view is not None and (
                len(rule.view) != len(glob) or any(v not in (-1, g) for v, g in zip(rule.view, glob))
            ):
                raise P.PieceError(f"the rule views the tensor as {list(rule.view)}, but it is {list(glob)} "
                                   "(views that reshape a tensor are not supported)")
            return glob, pieces
        if rule.kind == "grouped":
            assert rule.groups is not None and rule.sizes is not None
            return G.grouped(shape, rule.dim, rule.groups, rule.sizes, tp_rank, tp_size)
        per_rank = rule.pieces.get(tp_size)
        if per_rank is None:
            raise P.PieceError(f"the pieces rule has no pieces for TP size {tp_size} (it has: {sorted(rule.pieces)})")
        assert rule.shape is not None
        return rule.shape, list(per_rank[tp_rank])


def _resolve_sizes(sizes: list[int], total: int) -> list[int]:
    """Sub-parameter sizes with ``-1`` placeholders resolved: the placeholders share what
    the given sizes leave of ``total`` equally."""
    known = sum(n for n in sizes if n != -1)
    free = sizes.count(-1)
    if any(n < -1 for n in sizes) or (free == 0 and known != total) or known > total:
        raise P.PieceError(f"sub-parameter sizes {sizes} do not add up to the consolidated size {total}")
    if free:
        rest = total - known
        if rest % free:
            raise P.PieceError(f"sub-parameter sizes {sizes}: {rest} cannot be shared by {free} placeholders")
        sizes = [rest // free if n == -1 else n for n in sizes]
    return sizes


class _Owners:
    """Which parameter each leaf of a state dict belongs to.

    Optimizer state dicts are found by their form: ``{"state": {...}, "param_groups": [...]}``
    anywhere, or ``{"state": {...}}`` under a top-level key (FQN-keyed, as ``get_state_dict``
    gives it). Their state is keyed by FQN, or by number (named by :func:`number_names`)."""

    def __init__(self, state_dict: Mapping[str, Any], model: torch.nn.Module | None):
        self.model = model
        self.optimizers: dict[Path, Mapping[str, Any]] = {}
        self._names: dict[Path, dict[int, str]] = {}
        self._walk(state_dict, ())

    def _walk(self, value: Any, path: Path) -> None:
        if not isinstance(value, Mapping):
            return
        if isinstance(value.get("state"), Mapping) and (isinstance(value.get("param_groups"), list) or len(path) == 1):
            self.optimizers[path] = value
            return
        for k, v in value.items():
            self._walk(v, path + (k,))

    def locate(self, path: Path) -> tuple[str, tuple[int, int], bool]:
        """The parameter FQN a leaf belongs to, where it sits in the path (start, stop), and
        whether the leaf is optimizer state."""
        for k in range(len(path) - 2):
            if path[k] == "state" and path[:k] in self.optimizers:
                key = path[k + 1]
                return (self._name(path[:k], key) if isinstance(key, int) else str(key)), (k + 1, k + 2), True
        if len(path) == 1:
            return str(path[0]), (0, 1), False
        return ".".join(str(p) for p in path[1:]), (1, len(path)), False

    def _name(self, prefix: Path, number: int) -> str:
        where = ".".join(map(str, prefix + ("state", number)))
        if prefix not in self._names:
            try:
                self._names[prefix] = number_names(self.optimizers[prefix], self.model)
            except ValueError as e:
                raise RuleError(
                    f"optimizer state {where!r} is keyed by parameter number {number}, and which parameter that is "
                    f"cannot be known: {e}. Build the optimizer from model.named_parameters() (its param groups then "
                    "carry param_names), pass place(..., model=model) when it was built from model.parameters(), or "
                    "key the state by name (torch.distributed.checkpoint.state_dict.get_optimizer_state_dict)"
                ) from None
        name = self._names[prefix].get(number)
        if name is None:
            raise RuleError(f"optimizer state {where!r}: parameter number {number} is in none of its param groups")
        return name

    def check_names(self, params: Mapping[str, Any]) -> None:
        """Names given to numbered state must be parameters of the state dict, when it holds
        any: else their state would take the rule of another name than its parameter's."""
        if not params:
            return
        for prefix, names in self._names.items():
            stray = [n for n in names.values() if n not in params]
            if stray:
                raise RuleError(
                    f"optimizer state {'.'.join(map(str, prefix + ('state',)))!r} names its parameters "
                    f"{stray[:3]}{' ...' * (len(stray) > 3)}, which are not parameters of the state dict (it holds "
                    f"{sorted(params)[:3]}{' ...' * (len(params) > 3)}): place the optimizer with the model whose "
                    "named_parameters() it was built from, under the same names (a wrapper's optimizer names them "
                    "'module.<name>'), or alone"
                )


def _copy_structure(value: Any) -> Any:
    """The nesting of ``value`` in new dicts and lists (a module state dict's ``_metadata`` kept)."""
    if isinstance(value, Mapping):
        out = {k: _copy_structure(v) for k, v in value.items()}
        meta = getattr(value, "_metadata", None)
        return out if meta is None else with_metadata(out, meta)
    if isinstance(value, list):
        return [_copy_structure(v) for v in value]
    return value
