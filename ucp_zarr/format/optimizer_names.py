"""Which parameter each optimizer state belongs to, when the state is keyed by number.

``optimizer.state_dict()`` keys its state by parameter number (``state.0.exp_avg``). The
number's parameter name is knowable when the optimizer was built from
``model.named_parameters()`` (its param groups then carry ``param_names``), or when the
model is given and the optimizer was built from ``model.parameters()`` (numbers follow the
model's parameter order; checked against the state's shapes). Then the state's arrays are
stored beside their parameter (same Zarr group); its keys do not change.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Mapping

log = logging.getLogger(__name__)


def state_names(state_dict: Mapping[str, Any], model: Any = None) -> dict[str, str]:
    """``<prefix>.state.<number>`` -> ``<prefix>.state.<parameter name>`` for every
    optimizer state dict found in ``state_dict`` whose parameter names are knowable."""
    names: dict[str, str] = {}
    for prefix, opt in _optimizer_dicts(state_dict, ()):
        try:
            by_number = number_names(opt, model)
        except ValueError as e:
            if model is not None:
                log.warning("ucp_zarr: %s stays keyed by number: %s", prefix, e)
            continue
        for number, name in by_number.items():
            names[f"{prefix}.state.{number}"] = f"{prefix}.state.{name}"
    return names


def number_names(opt: Mapping[str, Any], model: Any = None) -> dict[int, str]:
    """Parameter number -> parameter name of an optimizer state dict: from its param groups'
    ``param_names``, else (``model`` given) from ``model.named_parameters()``. Raises
    ``ValueError`` saying why the names are not knowable."""
    names = _param_names(opt)
    if names is not None:
        return names
    if model is None:
        raise ValueError("its param groups carry no param_names (the optimizer was not built from named_parameters()) "
                         "and no model was given")
    return _model_order(opt, model)


def alias(key: str, path: tuple[Any, ...], names: Mapping[str, str]) -> str | None:
    """The key a leaf's array is named after (``None``: its own). ``path`` is the leaf's
    path in the nested state dict."""
    for i in range(len(path) - 2):
        if path[i] == "state" and isinstance(path[i + 1], int):
            prefix = ".".join(str(p) for p in path[: i + 2])
            if prefix in names and (key == prefix or key.startswith(prefix + ".")):
                return names[prefix] + key[len(prefix):]
    return None


def _optimizer_dicts(value: Any, path: tuple[str, ...]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    if not isinstance(value, Mapping):
        return
    if isinstance(value.get("state"), Mapping) and isinstance(value.get("param_groups"), list) and path:
        yield ".".join(path), value
        return
    for k, v in value.items():
        yield from _optimizer_dicts(v, path + (str(k),))


def _param_names(opt: Mapping[str, Any]) -> dict[int, str] | None:
    """From ``param_names`` in every param group (torch >= 2.6, named parameters)."""
    out: dict[int, str] = {}
    for group in opt["param_groups"]:
        params, names = (group.get("params"), group.get("param_names")) if isinstance(group, Mapping) else (None, None)
        if not (isinstance(params, list) and isinstance(names, list) and len(params) == len(names)):
            return None
        for number, name in zip(params, names):
            if not isinstance(number, int) or not isinstance(name, str) or not name:
                return None
            out[number] = name
    return out if len(set(out.values())) == len(out) else None


def _model_order(opt: Mapping[str, Any], model: Any) -> dict[int, str]:
    """Numbers in the order of ``model.named_parameters()``, when the groups number them
    0..N-1 for the model's N parameters and every state tensor of a parameter's rank has
    its shape (factored states of other ranks, and scalars, are not compared)."""
    named = list(model.named_parameters())
    numbers = [n for g in opt["param_groups"] if isinstance(g, Mapping) for n in g.get("params", [])]
    if numbers != list(range(len(named))):
        raise ValueError(f"its param groups number {len(numbers)} parameters, not the model's {len(named)} in order")
    for number, state in opt["state"].items():
        if not (isinstance(number, int) and 0 <= number < len(named) and isinstance(state, Mapping)):
            raise ValueError(f"its state {number!r} is not a state of one of the model's {len(named)} parameters")
        shape = tuple(named[number][1].shape)
        for k, v in state.items():
            if hasattr(v, "shape") and len(v.shape) == len(shape) and len(shape) and tuple(v.shape) != shape:
                raise ValueError(f"its state {number}.{k} ({list(v.shape)}) does not have the shape {list(shape)} "
                                 f"of the model's parameter {number}, {named[number][0]!r}")
    return {i: name for i, (name, _) in enumerate(named)}
