"""Megatron-core's own ``GPTModel`` on CPU with gloo: the references of the Megatron tests.

:func:`run_job` runs ``fn(rank, world, *args)`` on ``world`` real processes with a gloo group:
a fresh interpreter imports megatron-core once (about 9 s of CPU), then forks the ranks, so a
job costs one import, not one per rank. In a rank, :func:`trained` builds the model of a
:class:`Variant` with ``parallel_state.initialize_model_parallel(TP, PP)``, the local (no
Transformer Engine) layer spec ``get_gpt_layer_local_spec()`` and CPU initialisation, and takes
one Adam step. What makes the same seed give the same tensors on every layout:

* CPU initialisation draws each full weight, then keeps the rank's part
  (``_initialize_affine_weight_cpu`` in ``megatron/core/tensor_parallel/layers.py``), so a
  weight's values do not depend on TP;
* every transformer layer reseeds torch's generator by its global layer number before it
  draws (a thin ``TransformerLayer`` subclass in the spec), so a layer draws the same numbers on
  every pipeline stage, whatever the stages and the padded embedding before it drew;
* Megatron initialises biases to zero and norms to one, which would hide a permutation: the
  harness gives a column-parallel bias its weight's first column (``F.linear`` pairs bias row
  ``i`` with weight row ``i`` on every rank), and every parameter Megatron does not split (norms,
  row-parallel biases, learned position embeddings, which are drawn after the padded embedding)
  values from a generator seeded by its global name;
* the Adam step's gradient is an elementwise function of the parameter, so the step computes
  the same bits on every layout (a forward/backward pass sums in another order per TP degree).

Derived from source, not run: Megatron-core does not pad the vocabulary; Megatron-LM's trainer
does (``_vocab_size_with_padding`` in ``megatron/training/tokenizer/tokenizer.py``: up to a
multiple of ``make_vocab_size_divisible_by * TP``), reproduced by :func:`padded_vocab`.
CPU-only workarounds (no layout effect): a tied output layer with PP > 1 is synchronised with
``weight.data.cuda()`` then an all-reduce (``LanguageModule.setup_embeddings_and_output_layer``),
and the forward pass allocates on ``torch.cuda.current_device()``, so while a model is built or
run ``Tensor.cuda`` returns the tensor itself and ``current_device`` the CPU; :func:`train` gives
the attention an explicit causal mask, uses no dropout and a no-op RNG tracker (Megatron's tracks
CUDA generators).

Run ``python tests/megatron_core_models.py MODULE:FUNCTION WORLD ARGS_JSON`` (what
:func:`run_job` does).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import os
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

NUM_LAYERS, HIDDEN, HEADS, GROUPS, KV_CHANNELS, FFN = 2, 32, 4, 2, 8, 48
VOCAB = 300
"""The tokenizer's size: TP=4 pads it to 512, so rank 2 holds part padding and rank 3 only padding."""
DIVISIBLE_BY = 128
"""Megatron-LM's default ``make_vocab_size_divisible_by``."""
MAX_SEQ = 16
LR = 1e-2


@dataclass(frozen=True)
class Variant:
    """One model configuration (all have grouped-query attention and SwiGLU)."""

    name: str
    tied: bool
    normalization: str
    add_bias_linear: bool
    add_qkv_bias: bool
    qk_layernorm: bool
    position_embedding_type: str
    rotary_interleaved: bool = False
    rotary_percent: float = 1.0
    qk_l2_norm: bool = False


VARIANTS = {
    v.name: v
    for v in (
        Variant("gqa", tied=False, normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=True,
                qk_layernorm=True, position_embedding_type="rope"),
        Variant("tied", tied=True, normalization="LayerNorm", add_bias_linear=True, add_qkv_bias=False,
                qk_layernorm=False, position_embedding_type="learned_absolute"),
    )
}


def padded_vocab(tp: int, vocab: int = VOCAB) -> int:
    """Megatron-LM's padded vocabulary at TP degree ``tp``."""
    multiple = DIVISIBLE_BY * tp
    return -(-vocab // multiple) * multiple


# --------------------------------------------------------------------------- in a rank


@contextlib.contextmanager
def _cuda_is_cpu() -> Iterator[None]:
    """``Tensor.cuda`` returns the tensor and ``torch.cuda.current_device`` the CPU."""
    cuda, device = torch.Tensor.cuda, torch.cuda.current_device
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.cuda.current_device = cuda, device  # type: ignore[method-assign]


def build(variant: Variant, tp: int, pp: int, seed: int, vocab: int = VOCAB) -> Any:
    """Megatron-core's ``GPTModel`` of ``variant`` on this rank of a TP x PP (x DP) layout."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset

    if not ps.model_parallel_is_initialized() or (
        ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) != (tp, pp):
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tp, pp)

    class SeededLayer(TransformerLayer):  # type: ignore[misc]
        def __init__(self, config: Any, submodules: Any, layer_number: int = 1, **kw: Any) -> None:
            # (layer_number is the stage's; TransformerLayer adds the stage's offset as this does)
            torch.manual_seed(seed * 1000 + layer_number + get_transformer_layer_offset(config))
            super().__init__(config, submodules, layer_number=layer_number, **kw)

    l2 = {"qk_l2_norm": True} if variant.qk_l2_norm else {}  # (Llama 4's weightless norm of queries and keys)
    spec = get_gpt_layer_local_spec(normalization=variant.normalization, qk_layernorm=variant.qk_layernorm, **l2)
    spec.module = SeededLayer
    config = TransformerConfig(
        num_layers=NUM_LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        kv_channels=KV_CHANNELS, ffn_hidden_size=FFN, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization=variant.normalization,
        add_bias_linear=variant.add_bias_linear, add_qkv_bias=variant.add_qkv_bias,
        qk_layernorm=variant.qk_layernorm, rotary_interleaved=variant.rotary_interleaved,
        hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, perform_initialization=True,
        pipeline_dtype=torch.float32, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, **l2,
    )
    torch.manual_seed(seed)
    with _cuda_is_cpu():
        model = GPTModel(
            config, spec, vocab_size=padded_vocab(tp, vocab), max_sequence_length=MAX_SEQ,
            pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=variant.tied,
            position_embedding_type=variant.position_embedding_type, rotary_percent=variant.rotary_percent,
        )
    _fill_constants(model, seed)
    return model


def _fill_constants(model: Any, seed: int) -> None:
    """Distinct values, the same on every layout, for what Megatron initialises to a constant
    (or, for learned position embeddings, draws after the padded embedding)."""
    layers = {str(i): layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    with torch.no_grad():
        for name, module in model.named_modules():
            weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
            if isinstance(bias, torch.Tensor) and getattr(weight, "tensor_model_parallel", False) and weight.partition_dim == 0:
                bias.copy_(weight[:, 0])
        for name, p in model.named_parameters():
            if getattr(p, "tensor_model_parallel", False):
                continue
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(layers[parts[2]])
            g = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(".".join(parts).encode()))
            p.copy_(torch.randn(p.shape, generator=g))


def trained(variant: Variant, tp: int, pp: int, seed: int) -> tuple[Any, torch.optim.Adam]:
    """The model after one Adam step whose gradient is ``cos(7 p)``."""
    model = build(variant, tp, pp, seed)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for p in model.parameters():
        p.grad = torch.cos(7 * p.detach())
    opt.step()
    return model, opt


def train(model: Any, opt: torch.optim.Adam, steps: range, vocab: int) -> list[float]:
    """Megatron-core's forward and backward (TP collectives over gloo) and an Adam step per
    batch (the same batches on every rank: a single pipeline stage, DP replicas equal)."""
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)  # (no CUDA generator to track)
    losses = []
    causal = torch.ones(1, 1, MAX_SEQ, MAX_SEQ, dtype=torch.bool).triu(1)  # (True: masked out)
    with _cuda_is_cpu():
        for step in steps:
            g = torch.Generator().manual_seed(100 + step)
            tokens, labels = (torch.randint(0, vocab, (2, MAX_SEQ), generator=g) for _ in range(2))
            opt.zero_grad()
            loss = model(tokens, torch.arange(MAX_SEQ).expand(2, MAX_SEQ), causal, labels=labels).mean()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    return losses


def state(model: Any, opt: torch.optim.Adam) -> dict[str, Any]:
    """The model's own state dict and the Adam state keyed by parameter FQN."""
    return {"model": model.state_dict(),
            "optim": {"state": {name: opt.state[p] for name, p in model.named_parameters()}}}


def coords() -> dict[str, int]:
    """This rank's place in the current layout (Megatron's own parallel state)."""
    from megatron.core import parallel_state as ps

    return {"tp_rank": ps.get_tensor_model_parallel_rank(), "tp_size": ps.get_tensor_model_parallel_world_size(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(), "pp_size": ps.get_pipeline_model_parallel_world_size()}


def vocab_start(tp_rank: int, tp: int) -> int:
    """The first padded-vocabulary row this TP rank holds (Megatron's ``VocabUtility``)."""
    from megatron.core.tensor_parallel.utils import VocabUtility

    return int(VocabUtility.vocab_range_from_global_vocab_size(padded_vocab(tp), tp_rank, tp)[0])


def tensors(value: Any) -> Any:
    """A copy of the tensors of a nested state (for ``torch.save``; non-tensors dropped)."""
    if isinstance(value, dict):
        out = {k: tensors(v) for k, v in value.items()}
        return {k: v for k, v in out.items() if v is not None}
    return value.detach().clone() if isinstance(value, torch.Tensor) else None


# --------------------------------------------------------------------------- the job


def run_job(target: Callable[..., Any], world: int, *args: Any, timeout_s: float = 420) -> None:
    """Run ``target(rank, world, *args)`` (a module-level function; JSON-able ``args``) on
    ``world`` gloo ranks forked from one fresh interpreter that imported megatron-core."""
    spec = f"{target.__module__}:{target.__qualname__}"
    cmd = [sys.executable, str(Path(__file__).resolve()), spec, str(world), json.dumps(args)]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, cwd=Path(__file__).parent, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode:
        raise RuntimeError(f"the Megatron-core job {spec} on {world} ranks failed ({done.returncode}):\n"
                           f"{done.stdout[-4000:]}\n{done.stderr[-8000:]}")


def _rank(rank: int, world: int, port: int, spec: str, args: list[Any]) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    module, name = spec.split(":")
    getattr(importlib.import_module(module), name)(rank, world, *args)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # (as tests/_dist.py: gloo's threads were seen to abort a finished process's teardown)


def _main(spec: str, world: int, args: list[Any]) -> None:
    import socket

    import megatron.core.models.gpt  # noqa: F401  (imported once, before the ranks fork)
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(world, port, spec, args), nprocs=world, start_method="fork", join=True)


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]))
