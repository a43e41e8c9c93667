"""Megatron-core's conventions as rules: :func:`rules_from_megatron` (``Rules.from_megatron``).

What a megatron-core ``GPTModel`` (0.16, local layer spec) holds on each rank, from its source
and checked against the real model in ``tests/test_place_megatron.py``:

* ``self_attention.linear_qkv``: per query group, the group's ``np/ng`` query heads, its key head,
  its value head, ``hn`` rows each (``[query; gate; key; value]`` with ``attention_output_gate``);
  the groups split contiguously over TP (``SelfAttention.get_query_key_value_tensors`` in
  ``megatron/core/transformer/attention.py``): a ``grouped`` rule named ``q, k, v``;
* ``mlp.linear_fc1`` with ``gated_linear_unit``: ``[gate; up]``, rank ``r`` holding
  ``[gate_r; up_r]`` (``MLP`` builds it with stride 2, ``megatron/core/transformer/mlp.py``): a
  ``fused`` rule named ``gate, up``; without it a column split;
* ``linear_proj``/``linear_fc2`` (``RowParallelLinear``): split along dim 1, their biases replicated;
* norms and learned position embeddings: replicated;
* ``embedding.word_embeddings``/``output_layer``: vocabulary rows split over TP, padded by the
  trainer (Megatron-LM: to a multiple of ``make_vocab_size_divisible_by * TP``), so the padding is
  stripped with the tokenizer's ``vocab_size``;
* pipeline stages name their layers from 0; stage ``s``'s layer ``i`` is global layer
  ``get_transformer_layer_offset(config, pp_rank=s) + i``;
* a tied output layer (``share_embeddings_and_output_weights``) has no weight of its own on a
  single stage; with PP > 1 the last stage holds a copy of the embedding, stored once.

Every parameter of the model must match a rule, and a parameter Megatron marks as split
(``tensor_model_parallel``, ``partition_dim``, ``partition_stride``, set as it initialises them)
a rule that splits it so; anything else (mixture of experts, multi-latent attention, virtual
pipeline stages, Transformer Engine's fused layers) is refused by name.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from ..rules.params import ParamRule, Renumber, RuleError

_LAYER = r"decoder\.layers\.\d+\."
_EMBEDDING = r"embedding\.word_embeddings\.weight$"
_OUTPUT_NAME = r"output_layer\.weight"
_OUTPUT = _OUTPUT_NAME + "$"
_REFUSED = {  # config member -> what it is (its parameters are laid out in ways these rules do not describe)
    "num_moe_experts": "mixture of experts",
    "multi_latent_attention": "multi-latent attention",
    "virtual_pipeline_model_parallel_size": "virtual pipeline stages",
    "pipeline_model_parallel_layout": "a custom pipeline layout",
    "mtp_num_layers": "multi-token prediction",
}

R = TypeVar("R")


def rules_from_megatron(rules_type: Callable[..., R], model: Any, *, vocab_size: int) -> R:
    """The rules (built by ``rules_type``: :class:`~ucp_zarr.Rules`, whose ``from_megatron``
    calls this; this adapter does not import the rule language) of a megatron-core ``GPTModel`` (or a wrapper of it with ``.module``, such as
    Megatron's ``DistributedDataParallel`` or ``Float16Module``) on its rank; ``vocab_size`` is
    the tokenizer's vocabulary before Megatron pads it. The same on every rank of a layout."""
    try:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    except ImportError as e:
        raise ImportError(f"Rules.from_megatron needs megatron-core: {e}") from e
    gpt = model
    while not isinstance(gpt, GPTModel) and hasattr(gpt, "module"):
        gpt = gpt.module
    if not isinstance(gpt, GPTModel):
        raise RuleError(f"Rules.from_megatron takes a megatron-core GPTModel, not {type(model).__name__}")
    cfg = gpt.config
    for member, what in _REFUSED.items():
        if getattr(cfg, member, None):
            raise RuleError(f"Rules.from_megatron: {what} ({member}={getattr(cfg, member)!r}) is not supported; "
                            "describe its parameters with Rules.from_dict")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= gpt.vocab_size:
        raise RuleError(f"Rules.from_megatron: vocab_size={vocab_size!r} must be the tokenizer's size, between 1 "
                        f"and the model's padded vocabulary of {gpt.vocab_size}")

    heads, groups, hn = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    q = heads // groups * hn
    qkv = ParamRule("grouped", (_LAYER + r"self_attention\.linear_qkv\.(weight|bias)$",), groups=groups,
                    sizes=(q, q, hn, hn) if cfg.attention_output_gate else (q, hn, hn),
                    names=("q", "gate", "k", "v") if cfg.attention_output_gate else ("q", "k", "v"))
    fc1 = _LAYER + r"mlp\.linear_fc1\.(weight|bias)$"
    replicated = [r".*layernorm\.(weight|bias)$"]
    if gpt.position_embedding_type == "learned_absolute":
        replicated.append(r"embedding\.position_embeddings\.weight$")
    if cfg.add_bias_linear:
        replicated.append(_LAYER + r"(self_attention\.linear_proj|mlp\.linear_fc2)\.bias$")
    has_output = not gpt.share_embeddings_and_output_weights or cfg.pipeline_model_parallel_size > 1
    vocab = (_EMBEDDING, _OUTPUT) if has_output else (_EMBEDDING,)
    params = (
        ParamRule("replicated", tuple(replicated)),
        qkv,
        ParamRule("fused", (fc1,), sizes=(cfg.ffn_hidden_size,) * 2, names=("gate", "up"))
        if cfg.gated_linear_unit else ParamRule("split", (fc1,)),
        ParamRule("split", (_LAYER + r"(self_attention\.linear_proj|mlp\.linear_fc2)\.weight$",), dim=1),
        ParamRule("split", vocab),
    )
    tied = gpt.share_embeddings_and_output_weights and has_output
    rules = rules_type(
        params=params, vocab_patterns=vocab, vocab_size=vocab_size,
        rename=((_OUTPUT_NAME, "embedding.word_embeddings.weight"),) if tied else (),
        pipeline=_pipeline(gpt, get_transformer_layer_offset), pipeline_replicated=(_OUTPUT,) if tied else (),
        model=model_facts(gpt), default="error",
    )
    _check_against_megatron(gpt, rules)
    return rules


_CONFIG_FACTS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "normalization", "layernorm_epsilon", "layernorm_zero_centered_gamma", "apply_residual_connection_post_layernorm",
    "gated_linear_unit", "glu_linear_offset", "activation_func_clamp_value", "add_bias_linear", "add_qkv_bias",
    "qk_layernorm", "attention_output_gate", "softmax_scale", "softmax_type", "window_size", "no_rope_freq",
    "experimental_attention_variant", "rotary_interleaved", "qk_l2_norm", "linear_attention_freq", "mrope_section",
)
"""``TransformerConfig`` members that change what the weights compute (those this version has)."""


def model_facts(gpt: Any) -> dict[str, Any]:
    """What a megatron-core ``GPTModel`` computes that its weights' names and shapes do not
    tell, as JSON (``Rules.model``), for an export to check (``names="megatron_to_llama"``):
    the config members of :data:`_CONFIG_FACTS` as Megatron names them, the activation's
    name, the position embedding, and for rotary embeddings the inverse frequencies the
    model's ``RotaryEmbedding`` applies (base, ``rotary_percent``, Llama 3 scaling and
    ``seq_len_interpolation_factor`` folded in: the frequencies themselves, not the
    arguments, which ``GPTModel`` and its config may record differently)."""
    cfg = gpt.config
    facts: dict[str, Any] = {"framework": "megatron-core", "position_embedding_type": gpt.position_embedding_type,
                             "share_embeddings_and_output_weights": bool(gpt.share_embeddings_and_output_weights)}
    for name in _CONFIG_FACTS:
        if hasattr(cfg, name):
            value = getattr(cfg, name)
            facts[name] = list(value) if isinstance(value, tuple) else value
    act = cfg.activation_func  # (F.silu, or a module such as torch.nn.SiLU(): its name in lower case)
    facts["activation_func"] = getattr(act, "__name__", type(act).__name__).lower()
    rotary = getattr(gpt, "rotary_pos_emb", None)
    if rotary is not None and hasattr(rotary, "inv_freq"):
        factor = getattr(rotary, "seq_len_interpolation_factor", None) or 1.0
        facts["rotary_inv_freq"] = [float(f) / factor for f in rotary.inv_freq.tolist()]
    return facts


def _pipeline(gpt: Any, layer_offset: Any) -> Renumber:
    """Layers renumbered per stage by Megatron's own offsets (checked against this stage's layers)."""
    cfg = gpt.config
    pp = cfg.pipeline_model_parallel_size
    offsets = tuple(int(layer_offset(cfg, None, s)) if pp > 1 else 0 for s in range(pp))
    stage = gpt.pp_group.rank() if pp > 1 else 0
    layers = list(gpt.decoder.layers)
    if layers and layers[0].layer_number - 1 != offsets[stage]:
        raise RuleError(f"Rules.from_megatron: stage {stage}'s first layer is global layer {layers[0].layer_number - 1}, "
                        f"not {offsets[stage]} as get_transformer_layer_offset gives")
    pattern = r"decoder\.layers\.(\d+)\."
    if offsets == tuple(s * (cfg.num_layers // pp) for s in range(pp)) and cfg.num_layers % pp == 0:
        return Renumber(pattern, count=cfg.num_layers)
    return Renumber(pattern, offsets=offsets)


def _check_against_megatron(gpt: Any, rules: Any) -> None:
    """Every parameter has a rule, and one Megatron marks as split a rule that splits it so
    (:func:`ucp_zarr.rules.place.check_split_marks`)."""
    from ..rules.place import check_split_marks

    names = [name for name, _ in gpt.named_parameters()]
    for name in names:
        try:
            rules.match(name)
        except RuleError:
            raise RuleError(f"Rules.from_megatron does not know parameter {name!r} of this GPTModel (a layer spec or "
                            "feature it does not describe); describe it with Rules.from_dict") from None
    try:
        check_split_marks(rules, gpt, names, gpt.config.tensor_model_parallel_size)
    except RuleError as e:
        raise RuleError(f"Rules.from_megatron: {e}") from None
