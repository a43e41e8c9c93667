"""Megatron-core ``GPTModel``s of Llama's architecture (RMSNorm, SwiGLU, RoPE, grouped-query
attention, no biases) saved through ``Rules.from_megatron``, with Megatron-core's own logits as
the reference an export to ``LlamaForCausalLM`` must reproduce (``tests/test_export_hf.py``).

Run by ``megatron_core_models.run_job(job, 2, folder)``: on 2 ranks,

1. an untied model at TP=2 is saved to ``folder/untied``; its logits on :data:`TOKENS`
   (Megatron's forward with TP collectives, the vocabulary shards gathered) go to
   ``folder/untied.pt``;
2. a tied model at PP=2 (the last stage holds the output layer, a copy of the embedding:
   ``rename`` + ``pipeline_replicated``) is saved to ``folder/tied``; the same model at TP=1,
   PP=1 (the same seed gives the same tensors) gives the logits and state dict in
   ``folder/tied.pt``;
3. Llama's architecture but rotary embeddings Llama does not apply (interleaved; on half of
   each head's dims), untied at TP=2, to ``folder/interleaved`` and ``folder/partial``, their
   logits to ``folder/interleaved.pt`` and ``folder/partial.pt``; and queries and keys scaled
   by a weightless L2 norm (``qk_l2_norm``, Llama 4's), to ``folder/qk_l2``.
"""

from __future__ import annotations

from typing import Any

import megatron_core_models as MC
import torch
import torch.distributed as dist

import ucp_zarr

LLAMA = MC.Variant("llama", tied=False, normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=False,
                   qk_layernorm=False, position_embedding_type="rope")
TIED_LLAMA = MC.Variant("tied-llama", tied=True, normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=False,
                        qk_layernorm=False, position_embedding_type="rope")
INTERLEAVED = MC.Variant("interleaved", tied=False, normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=False,
                         qk_layernorm=False, position_embedding_type="rope", rotary_interleaved=True)
PARTIAL = MC.Variant("partial", tied=False, normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=False,
                     qk_layernorm=False, position_embedding_type="rope", rotary_percent=0.5)
QK_L2 = MC.Variant("qk-l2", tied=False, normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=False,
                   qk_layernorm=False, position_embedding_type="rope", qk_l2_norm=True)
TOKENS = torch.randint(0, MC.VOCAB, (2, MC.MAX_SEQ), generator=torch.Generator().manual_seed(5))


def logits(model: Any) -> torch.Tensor:
    """Megatron-core's forward on :data:`TOKENS`: this TP rank's vocabulary columns."""
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    causal = torch.ones(1, 1, MC.MAX_SEQ, MC.MAX_SEQ, dtype=torch.bool).triu(1)
    with torch.no_grad(), MC._cuda_is_cpu():
        return model(TOKENS, torch.arange(MC.MAX_SEQ).expand(2, MC.MAX_SEQ), causal)


def _untied(variant: MC.Variant, name: str, rank: int, world: int, folder: str) -> None:
    """``variant`` at TP=``world`` saved to ``folder/name``, its logits to ``folder/name.pt``."""
    from megatron.core import parallel_state as ps

    model = MC.build(variant, world, 1, seed=11)
    rules = ucp_zarr.Rules.from_megatron(model, vocab_size=MC.VOCAB)
    ucp_zarr.save(ucp_zarr.place({"model": model.state_dict()}, rules, **MC.coords()), f"{folder}/{name}")
    local = logits(model)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    if rank == 0:
        torch.save({"tokens": TOKENS, "logits": torch.cat(parts, -1)[..., :MC.VOCAB]}, f"{folder}/{name}.pt")


def job(rank: int, world: int, folder: str) -> None:
    _untied(LLAMA, "untied", rank, world, folder)
    _untied(INTERLEAVED, "interleaved", rank, world, folder)
    _untied(PARTIAL, "partial", rank, world, folder)
    _untied(QK_L2, "qk_l2", rank, world, folder)

    model = MC.build(TIED_LLAMA, 1, world, seed=12)
    rules = ucp_zarr.Rules.from_megatron(model, vocab_size=MC.VOCAB)
    ucp_zarr.save(ucp_zarr.place({"model": model.state_dict()}, rules, **MC.coords()), f"{folder}/tied")
    whole = MC.build(TIED_LLAMA, 1, 1, seed=12)
    if rank == 0:
        torch.save({"logits": logits(whole)[..., :MC.VOCAB], "state": MC.tensors(whole.state_dict())}, f"{folder}/tied.pt")
