"""Hugging Face folders out: the model's weights under its own names, which ``transformers``'
``from_pretrained`` loads with no missing or unexpected keys. :func:`write` is
``ucp_zarr.export(src, dst, to="hf")`` and ``ucp-zarr export SRC DST --to hf``.

What goes in: the model's weights only (no optimizer state, no values), under the model's own
names: the training prefix (``model.`` of ``{"model": model.state_dict(), "optim": ...}``,
``module.`` of DDP, ``model.module.``, ``state_dict.`` of Lightning) is removed, detected from
the keys (:func:`detect_prefix`) or given as ``prefix``. A tie is written once: an alias whose
canonical tensor is written is left out, as ``save_pretrained`` leaves out
``lm_head.weight`` of a model with tied embeddings. ``dtype`` casts floating tensors
(``"bf16"``, ``"fp16"``, ``"fp32"``; default: as stored); ``masters=True`` writes each
weight's fp32 master (``optim.state.<name>.fp32``, as the DeepSpeed converter and adapter
store it) where the checkpoint holds one, and the other floating weights of lower precision
(frozen ones: no optimizer keeps their master) in fp32 too, exactly, unless ``dtype`` is given: a folder of
several floating dtypes loads in its config's, which would round the masters.

``names`` renames (a dict, a callable, or ``"megatron_to_llama"``): each weight's name (prefix
removed) maps to its Hugging Face name, or to None to leave it out. A tensor whose rule has
named sub-parameters (``fused``/``grouped`` with ``names``: Megatron-core's ``linear_qkv``
``q, k, v``, ``linear_fc1`` ``gate, up``) is offered first as ``<name>:<sub>`` for each
sub-parameter: when every one maps to a name, the tensor is split and each sub-parameter
written under its name (sub-parameter ``j`` of a grouped tensor is the ``j``-th block of every
group, in group order: ``ucp_zarr.layout.groups.sub_ranges``). A dict leaves names it lacks
unchanged (and does not split); a callable decides every name.

The files are named as Hugging Face names them (``model.safetensors``, or
``model-00001-of-0000n.safetensors`` shards of at most ``max_shard_size`` and
``model.safetensors.index.json``), with ``{"format": "pt"}`` metadata. They are written into a
temporary sibling folder; the other files already in ``dst`` (``config.json``, the tokenizer)
join them and the two folders are exchanged atomically (:func:`~.base.atomic_update`). With a
``config.json`` there, the export is checked against the model it describes (:func:`fit_to_config`:
no weight left random, none it would drop), and its ``dtype`` is set to the one written, as
``save_pretrained`` records it (``from_pretrained`` loads in the config's dtype).
Weight files already in ``dst`` (a previous export, ``pytorch_model.bin``) are refused unless
``overwrite``, and then none of them stays (a stale ``model.safetensors`` beside a new index
would be what ``from_pretrained`` loads).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from ..protocol.reader import CheckpointReader
from ..errors import ConversionError
from ..layout import Box
from ..layout.groups import sub_ranges
from .base import atomic_update
from .safetensors import BLOCK_BYTES, OutTensor, blocks, write_shards

DEFAULT_MAX_SHARD_SIZE = "5GB"
SUB = ":"
"""Between a fused tensor's name and a sub-parameter's name (``...linear_qkv.weight:q``)."""
PREFIXES = ("model.module.", "model._orig_mod.", "module.", "_orig_mod.", "model.", "state_dict.", "")
"""Training prefixes tried, in order, when none is given."""
NOT_MODEL = frozenset({
    "optim", "optimizer", "optimizers", "optimizer_states", "lr_scheduler", "lr_schedulers", "scheduler", "rng",
    "client_state", "deepspeed", "trainer_state", "scaler", "loops", "callbacks",
})
"""First key components that never hold the model's weights (a trainer's other state)."""
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}
WEIGHT_FILE = re.compile(
    r"(model|pytorch_model|tf_model|flax_model)(-\d{5}-of-\d{5})?\.(safetensors|bin|h5|msgpack)(\.index\.json)?"
)
"""The weight files ``from_pretrained`` looks for: a folder holds one set."""
_SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}

Names = Mapping[str, "str | None"] | Callable[[str], "str | None"] | str | None


def write(
    ck: CheckpointReader,
    dst: Path,
    *,
    overwrite: bool = False,
    prefix: str | None = None,
    dtype: str | None = None,
    masters: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    names: Names = None,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Export the model weights of ``ck`` into the folder ``dst`` for ``from_pretrained``
    (see the module docstring). Raises :class:`~ucp_zarr.errors.ConversionError` naming
    what it cannot do: no weights under ``prefix``, a name mapped twice, a fused tensor
    mapped in part, no fp32 masters, an unknown dtype."""
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    limit = shard_size(max_shard_size)
    keys = [k for k, e in ck.meta.tensors.items() if e.ranks is None] + list(ck.meta.ties)
    config = _config(Path(dst))
    models = [] if config is None else list(_models(config))
    prefix = detect_prefix(keys, models if names is None else []) if prefix is None else prefix
    weights = [k for k in keys if k.startswith(prefix) and (prefix or k.split(".", 1)[0] not in NOT_MODEL)]
    if not weights:
        raise ConversionError(f"checkpoint {ck.store.url} holds no tensor under the prefix {prefix!r}")
    written = {ck.meta.canonical(k) for k in weights if k not in ck.meta.ties}
    weights = [k for k in weights if k not in ck.meta.ties or ck.meta.ties[k] not in written]  # (a tie once)
    sources = {k: _master(ck, k, prefix, keys) if masters else k for k in weights}
    if masters and all(s == k for k, s in sources.items()) and any(ck[k].dtype != torch.float32 for k in weights):
        raise ConversionError(f"checkpoint {ck.store.url} holds no fp32 masters (optim.state.<name>.fp32) of its "
                              "low-precision weights; export without masters=True")
    to_llama = names == "megatron_to_llama" or names is megatron_to_llama
    if to_llama and (ck.meta.layout.get("source") or {}).get("megatron") == "torch_dist":
        raise ConversionError(
            f"checkpoint {ck.store.url} was converted from a Megatron-core torch_dist folder: its layers are stacked "
            "on a leading axis (decoder.layers.<param> of shape [layers, ...]), its vocabulary padded and its fused "
            "tensors recorded without their rules, so names='megatron_to_llama' cannot split them. Load it into the "
            "Megatron-core model at the tensor-parallel degree that saved it (ucp_zarr.adapters.megatron_sharded), "
            "save that with Rules.from_megatron, and export the result")
    lookup = _lookup(names)
    items: list[OutTensor] = []
    for key, source in sources.items():
        cast = DTYPES[dtype] if dtype is not None else ck[source].dtype
        if masters and dtype is None and cast.is_floating_point and cast.itemsize < 4:  # a weight without master
            cast = torch.float32  # (frozen): upcast exactly, else the config's dtype would round the masters to it
        items += _items(ck, key, key[len(prefix):], source, cast, lookup)
    if to_llama:
        check_llama(ck.meta.layout.get("rules", {}).get("model"), config, models, f"checkpoint {ck.store.url}", Path(dst))
    items = fit_to_config(Path(dst), items, prefix, models, _written_names(ck, weights, prefix, lookup))
    twice = sorted(n for n, c in Counter(t.name for t in items).items() if c > 1)
    if twice:
        raise ConversionError(f"several tensors of checkpoint {ck.store.url} are mapped to the names {twice[:5]}")
    index = {"total_parameters": sum(math.prod(t.shape) for t in items)}
    with atomic_update(Path(dst), replaced=lambda n: WEIGHT_FILE.fullmatch(n) is not None, overwrite=overwrite) as tmp:
        write_shards(tmp, items, limit, {"format": "pt"}, progress, index, ck.store)
        _config_dtype(Path(dst), tmp, items)
    return Path(dst)


def _config_dtype(dst: Path, tmp: Path, items: list[OutTensor]) -> None:
    """``dst/config.json`` with the dtype the weights were written in, where it names another
    (``from_pretrained`` loads in the config's dtype: fp32 masters exported beside a bf16
    config would be rounded to bf16), written to ``tmp``; as ``save_pretrained`` records it.
    Weights of several floating dtypes, or a config naming none: left as it is."""
    floats = {t.dtype for t in items if t.dtype.is_floating_point}
    config = dst / "config.json"
    if len(floats) != 1 or not config.is_file():
        return
    try:
        doc = json.loads(config.read_text())
    except (OSError, ValueError):
        return  # (from_pretrained will say what is wrong with it)
    name = str(floats.pop()).removeprefix("torch.")
    fields = [f for f in ("dtype", "torch_dtype") if isinstance(doc, dict) and f in doc and doc[f] != name]
    if fields:
        (tmp / "config.json").write_text(json.dumps(doc | {f: name for f in fields}, indent=2, sort_keys=True) + "\n")


def fit_to_config(dst: Path, items: list[OutTensor], prefix: str, models: list[Any],
                  same: Mapping[str, set[str]] | None = None) -> list[OutTensor]:
    """``items`` checked against the model ``dst/config.json`` describes (``models``: the
    candidates :func:`_models` builds from it, on the meta device: nothing allocated, nothing
    downloaded): an export that ``from_pretrained`` would load with weights left to
    random initialisation, or with weights dropped, is refused
    (:class:`~ucp_zarr.errors.ConversionError`): every parameter must be written, one name of
    each tied group, unless the model lets it be missing, and nothing the model has no
    place for. A tie is written under the name ``save_pretrained`` keeps (the embedding, not
    ``lm_head.weight``), whichever the checkpoint stored: the one tensor it writes of a tied
    group, or where it writes several (an ``lm_head`` untied by fine-tuning), the one that
    ``same`` (each written name's names in the checkpoint) says holds the kept name. The
    model is the first candidate that leaves nothing random and takes every weight. Nothing
    to compare with (no config, no ``transformers``, an unknown architecture): ``items`` as
    they are."""
    models = _model_parameters(models)
    if not models:
        return items
    written = {t.name for t in items}
    unmet = [[g[0] for g in groups if not written.intersection(g)] for groups, _, _ in models]
    fits = [i for i, (_, _, known) in enumerate(models) if not unmet[i] and all(known(n) for n in written)]
    if all(unmet):
        (groups, _, _), missing = models[0], unmet[0]
        stray = sorted(written - {n for g in groups for n in g})
        raise ConversionError(
            f"the export to {dst} would leave {len(missing)} weight(s) of the model its config.json describes to "
            f"random initialisation ({missing[:3]}{' ...' * (len(missing) > 3)}); it names "
            f"{stray[:3] if stray else 'nothing else'}{' ...' * (len(stray) > 3)} instead, with the training "
            f"prefix {prefix!r} removed: give the right prefix= (Lightning's self.model: 'state_dict.model.') or names="
        )
    groups, dropped, known = models[fits[0] if fits else unmet.index([])]
    extra = sorted(n for n in written if not known(n))
    if extra:
        raise ConversionError(
            f"the export to {dst} would write {len(extra)} weight(s) that the model its config.json describes does "
            f"not have ({extra[:3]}{' ...' * (len(extra) > 3)}): from_pretrained would drop them silently (a config "
            "of another model, with fewer layers, say?); give the config of the trained model, or leave them out "
            "with names= (a name mapped to None)"
        )
    kept = {}
    for g in groups:
        keep = next((n for n in g if n not in dropped), g[0])
        ours = [n for n in g if n in written]
        if keep in written or not ours:
            continue
        one = ours if len(ours) == 1 else [n for n in ours if keep in (same or {}).get(n, ())]
        if len(one) != 1:  # (several tensors of one tied group, none named as the kept one)
            raise ConversionError(
                f"the export to {dst} writes {len(ours)} tensors ({ours}) for what the model its config.json "
                f"describes ties as one ({keep!r}), and the checkpoint names none of them {keep!r}: say which "
                f"it is with names= (a dict mapping it to {keep!r})")
        kept[one[0]] = keep
    return [replace(t, name=kept[t.name]) if t.name in kept else t for t in items]


def _config(dst: Path) -> Any:
    """The ``transformers`` config of ``dst/config.json``; None without one, without
    ``transformers``, or for a config it cannot read (``from_pretrained`` would say why)."""
    if not (dst / "config.json").is_file():
        return None
    try:
        import transformers
    except ImportError:
        return None
    try:
        return transformers.AutoConfig.from_pretrained(str(dst), local_files_only=True)
    except Exception:
        return None


def _models(config: Any) -> Iterator[Any]:
    """The models ``config`` may describe (its ``architectures``, else a causal language
    model, a sequence-to-sequence one (text or speech), a masked one and the bare model of
    its type), built on the meta device; those it cannot build left out."""
    import transformers

    if config.architectures:
        build = [getattr(transformers, config.architectures[0], None)]
    else:
        build = [getattr(transformers, f"AutoModelFor{kind}").from_config
                 for kind in ("CausalLM", "Seq2SeqLM", "SpeechSeq2Seq", "MaskedLM")] + [transformers.AutoModel.from_config]
    for make in build:
        try:
            with torch.device("meta"):
                model = make(config)  # type: ignore[misc]
        except Exception:  # (no such class, or one this config cannot build)
            continue
        yield model


def _model_parameters(models: Sequence[Any]) -> list[tuple[list[list[str]], set[str], Callable[[str], bool]]]:
    """For each of the ``models`` a config may describe (:func:`_models`), its parameter names grouped
    by tie (the names of one parameter), less those the model lets ``from_pretrained`` miss;
    the tied names ``save_pretrained`` leaves out; and whether ``from_pretrained`` takes a
    name (one of its state dict, or one it lets a file hold beside them); none when that
    cannot be told (no config)."""
    out = []
    for model in models:
        ignored = [re.compile(p) for p in getattr(type(model), "_keys_to_ignore_on_load_missing", None) or ()]
        groups: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(param), []).append(name)
        dropped = set(getattr(model, "_tied_weights_keys", None) or ())  # (a dict target -> source, or a list)
        unexpected = [re.compile(p) for p in getattr(type(model), "_keys_to_ignore_on_load_unexpected", None) or ()]
        names = set(model.state_dict()) | {n for g in groups.values() for n in g}

        def known(name: str, names: set[str] = names, unexpected: list[re.Pattern[str]] = unexpected) -> bool:
            return name in names or any(p.search(name) for p in unexpected)

        out.append(([g for g in groups.values() if not all(any(p.search(n) for p in ignored) for n in g)], dropped, known))
    return out


def detect_prefix(keys: list[str], models: Sequence[Any] = ()) -> str:
    """The training prefix of the model's weights among ``keys``: the first of
    :data:`PREFIXES` such that every key outside it belongs to a trainer's other state
    (:data:`NOT_MODEL`) and some key inside it does not. With the ``models`` a config
    describes (:func:`_models`), the first such prefix that leaves the names of one of them,
    every parameter written: a tied Hugging Face model's weights all start with its own
    ``model.`` (``lm_head.weight`` is not written), which is no training prefix."""
    fits = []
    for p in PREFIXES:
        inside = [k for k in keys if k.startswith(p) and (p or k.split(".", 1)[0] not in NOT_MODEL)]
        if inside and all(k.split(".", 1)[0] in NOT_MODEL for k in keys if k not in inside):
            fits.append((p, {k[len(p):] for k in inside}))
    if not fits:
        tops = sorted({k.split(".", 1)[0] for k in keys} - NOT_MODEL)
        raise ConversionError(f"cannot tell which keys are the model's weights (top-level keys {tops[:10]}); give prefix=")
    for groups, _, known in _model_parameters(models):
        for p, names in fits:
            if all(known(n) for n in names) and all(names.intersection(g) for g in groups):
                return p
    return fits[0][0]


def shard_size(size: int | str) -> int:
    """Bytes per shard from an integer or a string as Hugging Face spells it (``"5GB"``:
    5 * 10**9 bytes; units TB, GB, MB, KB)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    text = str(size).strip()
    try:
        value = int(float(text[:-2]) * _SIZE_UNITS[text[-2:].upper()])
    except (KeyError, ValueError):
        value = 0
    if value <= 0:
        raise ConversionError(f"max_shard_size {size!r} is not a positive size (an integer, or '5GB', '500MB', ...)")
    return value


def _master(ck: CheckpointReader, key: str, prefix: str, keys: list[str]) -> str:
    """The fp32 master of weight ``key`` (``<optimizer>.state.<name>.fp32``) under any name of
    its tie (an optimizer names a tied parameter as ``named_parameters()`` does, the state
    dict may keep another), else ``key``."""
    tails = [f".state.{n[len(prefix):]}.fp32" for n in _names_of(ck, key) if n.startswith(prefix)]
    found = sorted({k for k in keys for t in tails
                    if k.endswith(t) and k.split(".", 1)[0] in NOT_MODEL and k[: -len(t)].count(".") == 0})
    if len(found) > 1:
        raise ConversionError(f"weight {key!r} has several fp32 masters: {found}")
    return found[0] if found else key


def _written_names(ck: CheckpointReader, weights: list[str], prefix: str, lookup: "_Lookup") -> dict[str, set[str]]:
    """For the name each weight is written under, the names of its tensor (its tie's
    aliases too) as they would be written."""
    def written(name: str) -> str | None:
        try:
            return lookup(name, False)
        except ConversionError:  # (a mapping with no place for it: a fused tensor split, an alias)
            return None

    out: dict[str, set[str]] = {}
    for key in weights:
        mine = written(key[len(prefix):])
        if mine is not None:
            out[mine] = {written(n[len(prefix):]) for n in _names_of(ck, key) if n.startswith(prefix)} - {None}
    return out


def _names_of(ck: CheckpointReader, key: str) -> list[str]:
    """``key`` and the other names of its tensor (the aliases of its tie)."""
    canon = ck.meta.canonical(key)
    return [key] + sorted({canon} - {key} | {a for a, c in ck.meta.ties.items() if c == canon and a != key})


def _items(ck: CheckpointReader, key: str, name: str, source: str, dtype: torch.dtype, lookup: "_Lookup") -> list[OutTensor]:
    """The tensors weight ``key`` (called ``name``, read from ``source``) is written as."""
    if not ck[source].dtype.is_floating_point:
        dtype = ck[source].dtype
    rule = ck.meta.tensors[ck.meta.canonical(key)].rule or {}
    subs = rule.get("names") if rule.get("kind") in ("fused", "grouped") else None
    if subs:
        mapped = {sub: lookup(f"{name}{SUB}{sub}", True) for sub in subs}
        if all(m is not None for m in mapped.values()):
            return [_sub_tensor(ck, source, rule, j, out, dtype) for j, out in enumerate(mapped.values())]
        if any(m is not None for m in mapped.values()):
            raise ConversionError(f"weight {name!r}: names map its sub-parameters {[s for s, m in mapped.items() if m]} but "
                                  f"not {[s for s, m in mapped.items() if not m]}; map all of them or none")
    out = lookup(name, False)
    if out is None:
        return []
    shape = tuple(ck[source].shape)
    return [OutTensor(out, shape, dtype, lambda: (b.to(dtype) for b in blocks(ck, source)))]


def _sub_tensor(ck: CheckpointReader, key: str, rule: dict[str, Any], index: int, name: str, dtype: torch.dtype) -> OutTensor:
    """Sub-parameter ``index`` of the fused or grouped tensor ``key``, as ``name``."""
    shape, dim = tuple(ck[key].shape), int(rule["dim"])
    ranges = sub_ranges(int(rule.get("groups", 1)), [int(s) for s in rule["sizes"]], index)
    out_shape = shape[:dim] + (sum(b - a for a, b in ranges),) + shape[dim + 1:]
    return OutTensor(name, out_shape, dtype, lambda: (b.to(dtype) for b in _sub_blocks(ck, key, shape, dim, ranges)))


def _sub_blocks(ck: CheckpointReader, key: str, shape: tuple[int, ...], dim: int, ranges: list[tuple[int, int]]) -> Iterator[torch.Tensor]:
    """The ranges ``[a, b)`` along ``dim`` of tensor ``key``, concatenated, as flat row-major blocks."""
    if dim == 0:
        for a, b in ranges:
            yield from blocks(ck, key, (a, b))
        return
    row = math.prod(shape[1:]) * ck[key].dtype.itemsize
    step = max(1, BLOCK_BYTES // max(row, 1))
    for r in range(0, shape[0], step):
        n = min(step, shape[0] - r)
        parts = []
        for a, b in ranges:
            offset = (r,) + tuple(a if d == dim else 0 for d in range(1, len(shape)))
            size = (n,) + tuple(b - a if d == dim else shape[d] for d in range(1, len(shape)))
            parts.append(ck.read(key, Box(offset, size)))
        yield torch.cat(parts, dim).reshape(-1)


# --- names ------------------------------------------------------------------------------------


_Lookup = Callable[[str, bool], "str | None"]


def _lookup(names: Names) -> _Lookup:
    """``lookup(name, sub)``: the Hugging Face name of a weight (``sub``: of a sub-parameter
    ``<name>:<sub>``), None to leave it out (a sub-parameter: not to split its tensor)."""
    if names is None:
        return lambda name, sub: None if sub else name
    if isinstance(names, str):
        if names not in NAME_MAPS:
            raise ConversionError(f"unknown name mapping {names!r} (known: {sorted(NAME_MAPS)}; or a dict or a callable)")
        names = NAME_MAPS[names]
    if isinstance(names, Mapping):
        table = names
        return lambda name, sub: table.get(name) if sub else table.get(name, name)
    if callable(names):
        fn = names
        return lambda name, sub: fn(name)
    raise ConversionError(f"names must be a dict, a callable or one of {sorted(NAME_MAPS)}, not {type(names).__name__}")


@dataclass(frozen=True)
class _Rename:
    pattern: re.Pattern[str]
    to: str | None


_LAYER = r"decoder\.layers\.(\d+)\."
_HF_LAYER = r"model.layers.\1."
MEGATRON_TO_LLAMA = tuple(_Rename(re.compile(p), t) for p, t in (
    (r"embedding\.word_embeddings\.weight", "model.embed_tokens.weight"),
    (r"decoder\.final_layernorm\.weight", "model.norm.weight"),
    (r"output_layer\.weight", "lm_head.weight"),
    (_LAYER + r"(input_layernorm\.weight|self_attention\.linear_qkv\.layer_norm_weight)", _HF_LAYER + "input_layernorm.weight"),
    (_LAYER + r"self_attention\.linear_qkv\.(weight|bias):([qkv])", _HF_LAYER + r"self_attn.\3_proj.\2"),
    (_LAYER + r"self_attention\.linear_proj\.weight", _HF_LAYER + "self_attn.o_proj.weight"),
    (_LAYER + r"self_attention\.([qk])_layernorm\.weight", _HF_LAYER + r"self_attn.\2_norm.weight"),
    (_LAYER + r"(pre_mlp_layernorm\.weight|mlp\.linear_fc1\.layer_norm_weight)", _HF_LAYER + "post_attention_layernorm.weight"),
    (_LAYER + r"mlp\.linear_fc1\.weight:(gate|up)", _HF_LAYER + r"mlp.\2_proj.weight"),
    (_LAYER + r"mlp\.linear_fc2\.weight", _HF_LAYER + "mlp.down_proj.weight"),
    (r".*\._extra_state", None),
))
"""Megatron-core ``GPTModel`` names (local and Transformer Engine layer specs) -> Llama's
(Qwen's ``q_norm``/``k_norm`` and ``q/k/v_proj`` biases too)."""


def megatron_to_llama(name: str) -> str | None:
    """The Llama (``LlamaForCausalLM``) name of a Megatron-core ``GPTModel`` weight, or of a
    sub-parameter ``<name>:<sub>`` (``...linear_qkv.weight:q`` -> ``...self_attn.q_proj.weight``);
    None for Transformer Engine's ``_extra_state`` and for sub-parameters it does not split.
    Raises :class:`ConversionError` for a weight Llama has no place for.

    It maps names only; an export with it checks the settings the checkpoint records
    (:func:`check_llama`): the rows of ``q`` and ``k`` are Llama's only for a model that
    rotates the halves of every head's dims, as Megatron's default rotary embedding does."""
    for r in MEGATRON_TO_LLAMA:
        m = r.pattern.fullmatch(name)
        if m is not None:
            return None if r.to is None else m.expand(r.to)
    if SUB in name:
        return None
    raise ConversionError(f"megatron_to_llama: Llama has no place for Megatron-core weight {name!r} (give names= "
                          "a mapping that knows it)")


LLAMA_COMPUTES: dict[str, Any] = {
    "position_embedding_type": "rope", "rotary_interleaved": False, "normalization": "RMSNorm",
    "layernorm_zero_centered_gamma": False, "apply_residual_connection_post_layernorm": False,
    "gated_linear_unit": True, "activation_func": "silu", "glu_linear_offset": 0.0, "activation_func_clamp_value": None,
    "attention_output_gate": False, "softmax_type": "vanilla", "window_size": None, "no_rope_freq": None,
    "experimental_attention_variant": None, "qk_l2_norm": False, "linear_attention_freq": None, "mrope_section": None,
}
"""Megatron-core's settings (``Rules.model``, :func:`ucp_zarr.adapters.megatron.model_facts`)
of a model that computes what ``LlamaForCausalLM`` does (``modeling_llama.py``: RMSNorm before
attention and MLP, SwiGLU with SiLU, rotary embeddings on all of each head's ``head_dim``
dims, rotating its two halves, softmax scaled by ``head_dim ** -0.5``, full causal attention on
every layer, queries and keys not normalised)."""
LLAMA_CONFIG = (
    ("hidden_size", "hidden_size"), ("intermediate_size", "ffn_hidden_size"), ("num_hidden_layers", "num_layers"),
    ("num_attention_heads", "num_attention_heads"), ("num_key_value_heads", "num_query_groups"),
    ("head_dim", "kv_channels"), ("rms_norm_eps", "layernorm_epsilon"), ("hidden_act", "activation_func"),
    ("attention_bias", "add_qkv_bias"), ("mlp_bias", "add_bias_linear"),
)
"""``config.json`` member -> the Megatron-core setting it must equal. (A tie need not: an
untied export under a tying config loads untied, ``transformers`` says so; a tied one under an
untying config leaves ``lm_head`` random, which :func:`fit_to_config` refuses.)"""


def check_llama(facts: Mapping[str, Any] | None, config: Any, models: list[Any], what: str, dst: Path) -> None:
    """Refuse (:class:`ConversionError`, naming each setting) an export with
    ``names="megatron_to_llama"`` that would load into a model computing something else:
    a Megatron-core model (``facts``: ``Rules.model`` as :meth:`Rules.from_megatron
    <ucp_zarr.Rules.from_megatron>` records it) that does not compute what Llama does
    (:data:`LLAMA_COMPUTES`; interleaved or partial rotary embeddings, another softmax
    scale), or a ``config.json`` in ``dst`` (``config``, and the ``models`` built from it)
    that describes another model: its sizes, epsilon, activation and biases
    (:data:`LLAMA_CONFIG`), a sliding window, and the rotary frequencies its own rotary
    embedding module computes (``rope_theta``, its scaling), against those the Megatron-core
    model applied. A checkpoint that records no settings (not
    saved through ``Rules.from_megatron``, or before it recorded them) is not checked."""
    if facts is None or facts.get("framework") != "megatron-core":
        return
    wrong = [f"{k}={facts[k]!r} (Llama: {v!r})" for k, v in LLAMA_COMPUTES.items() if k in facts and facts[k] != v]
    hn, scale, freqs = facts.get("kv_channels"), facts.get("softmax_scale"), facts.get("rotary_inv_freq")
    if scale is not None and hn and not math.isclose(scale, hn ** -0.5, rel_tol=1e-6):
        wrong.append(f"softmax_scale={scale!r} (Llama: kv_channels ** -0.5 = {hn ** -0.5!r})")
    if freqs is not None and hn and 2 * len(freqs) != hn:
        wrong.append(f"rotary embeddings on {2 * len(freqs)} of each head's {hn} dims (rotary_percent < 1; Llama: all)")
    if wrong:
        raise ConversionError(
            f"{what}: its Megatron-core model computes what Llama does not: {'; '.join(wrong)}. An export with "
            "names='megatron_to_llama' would load without error and give other outputs; export it without names= (or "
            "with a mapping to a model that computes the same)")
    if config is None:
        return
    missing = object()
    wrong = [f"{hf}={getattr(config, hf)!r} where Megatron-core's {mc}={facts[mc]!r}" for hf, mc in LLAMA_CONFIG
             if mc in facts and getattr(config, hf, missing) not in (missing, None) and getattr(config, hf) != facts[mc]]
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window is not None and facts.get("window_size") is None:
        wrong.append(f"sliding_window={window!r} where Megatron-core's model attends to every earlier position "
                     "(window_size=None)")
    rotary = _rotary(models, config)
    if freqs is not None and rotary is not None:
        theirs = rotary.inv_freq.double()
        if theirs.shape != (len(freqs),) or not torch.allclose(theirs, torch.tensor(freqs, dtype=torch.float64),
                                                                rtol=1e-6, atol=0):
            wrong.append(f"rotary frequencies {[round(f, 9) for f in theirs.tolist()[:3]]}... where Megatron-core's were "
                         f"{[round(f, 9) for f in freqs[:3]]}... (rope_theta and rope scaling: Megatron's rotary_base, "
                         "rope_scaling, seq_len_interpolation_factor)")
        elif float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
            wrong.append(f"rotary attention scaling {rotary.attention_scaling!r} (Megatron-core's: 1.0)")
    if wrong:
        raise ConversionError(f"{dst / 'config.json'} describes another model than {what}'s Megatron-core model: "
                              f"{'; '.join(wrong)}. Set them in config.json as the model was trained")


def _rotary(models: list[Any], config: Any) -> Any:
    """The rotary embedding module of the first of ``models`` (:func:`_models` of ``config``)
    that has one, built on the CPU from ``config`` (its ``inv_freq`` as ``transformers``
    computes it), or None."""
    for model in models:
        for module in model.modules():
            if "inv_freq" in dict(module.named_buffers(recurse=False)):
                try:
                    return type(module)(config=config)
                except Exception:  # (a module built otherwise: nothing to compare with)
                    return None
    return None


NAME_MAPS: dict[str, Callable[[str], str | None]] = {"megatron_to_llama": megatron_to_llama}
"""Built-in ``names=`` mappings, by name."""
