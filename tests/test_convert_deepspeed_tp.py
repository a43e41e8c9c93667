"""Tensor-parallel DeepSpeed checkpoints (AutoTP on a Hugging Face Llama, TP=2 x DP=2, written
by DeepSpeed itself on 4 gloo processes) converted with ``ucp_zarr.convert``: the TP ranks'
partitions are placed on the consolidated tensors by the ``universal_checkpoint_info`` the
checkpoint holds (row-parallel projections, TP-replicated norms and embedding, a vocabulary-
parallel head), and every fp32 master and Adam moment equals DeepSpeed's own
``ds_to_universal`` output bit for bit."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import ds_checkpoints as D
import pytest
import torch

import ucp_zarr
from ucp_zarr.errors import ConversionError

pytest.importorskip("transformers")

TRAIN = textwrap.dedent('''
    import collections, sys, torch
    import deepspeed, deepspeed.ops
    deepspeed.ops.__compatible_ops__ = collections.defaultdict(bool)  # no shm_comm JIT build
    deepspeed.init_distributed(dist_backend="gloo")
    from transformers import LlamaConfig, LlamaForCausalLM
    for variant in sys.argv[1:]:  # out:stage:dtype, each trained afresh in these processes
        out, stage, dtype = variant.split(":")
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        model = LlamaForCausalLM(config)
        cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": int(stage)},
               "tensor_parallel": {"autotp_size": 2}, "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
               "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
        if dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        for step in range(2):
            x = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(step))
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
        engine.save_checkpoint(out)
        engine.destroy()
''')
VARIANTS = [(1, "fp32"), (2, "bf16")]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, str], tuple[Path, Path]]:
    """(stage, dtype) -> (DeepSpeed checkpoint folder, DeepSpeed's ds_to_universal output)."""
    work = tmp_path_factory.mktemp("autotp")
    (work / "train.py").write_text(TRAIN)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    folders = {(stage, dtype): work / f"z{stage}-{dtype}" for stage, dtype in VARIANTS}
    # one launch trains every variant (4 processes importing DeepSpeed and transformers once)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", f"--master_port={_port()}",
                    str(work / "train.py"), *(f"{ck}:{stage}:{dtype}" for (stage, dtype), ck in folders.items())],
                   check=True, env=env, timeout=600, capture_output=True)
    out, converting = {}, []
    for (stage, dtype), ck in folders.items():  # DeepSpeed's own converter, on every variant at once
        step = ck / (ck / "latest").read_text().strip()
        uni = work / f"uni-z{stage}-{dtype}"
        converting.append(subprocess.Popen(
            [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(step),
             "--output_folder", str(uni), "--num_extract_workers", "1", "--num_merge_workers", "1"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        out[(stage, dtype)] = (ck, uni)
    for proc in converting:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err.decode()[-4000:]
    return out


@pytest.mark.parametrize("stage, dtype", VARIANTS, ids=[f"z{s}-{d}" for s, d in VARIANTS])
def test_tp_checkpoint_equals_deepspeeds_universal_output(checkpoints, tmp_path: Path, stage: int, dtype: str) -> None:
    src, uni = checkpoints[(stage, dtype)]
    assert len(list((src / (src / "latest").read_text().strip()).glob("mp_rank_01_model_states.pt"))) == 1
    ucp_zarr.convert(src, tmp_path / "ck")
    ck = ucp_zarr.open(tmp_path / "ck")
    assert ck.meta.tensors["model.model.layers.0.self_attn.q_proj.weight"].shape == (32, 32)  # 16 rows per TP rank
    assert ck.meta.tensors["model.model.layers.0.self_attn.o_proj.weight"].shape == (32, 32)  # row-parallel
    assert ck.meta.tensors["model.lm_head.weight"].shape == (100, 32)  # vocabulary-parallel
    assert ck.meta.tensors["model.model.norm.weight"].shape == (32,)  # TP-replicated
    assert ck.meta.layout["source"]["tp"] == 2 and ck.meta.layout["rules"]["format"] == "ucp_zarr.rules/1"
    compared = 0
    for name, state_key, want in D.universal_tensors(uni):
        key = D.converted_key(ck, name, state_key)
        got = ck.read(key)
        assert got.shape == want.shape and torch.equal(got, want), key
        compared += 1
    assert compared >= 3 * 19  # fp32 + two moments of every trainable parameter
    if dtype == "bf16":  # the module's weights are the masters rounded
        for name in ("model.layers.1.mlp.down_proj.weight", "lm_head.weight"):
            assert torch.equal(ck.read(f"model.{name}"), ck.read(f"optim.state.{name}.fp32").to(torch.bfloat16))


def test_rules_that_do_not_fit_are_named(checkpoints, tmp_path: Path) -> None:
    src, _ = checkpoints[(1, "fp32")]
    rules = ucp_zarr.Rules.from_dict({"params": [{"kind": "fused", "patterns": [r".*q_proj\.weight"], "sizes": [7, -1]}],
                                      "strict": False})
    with pytest.raises(ConversionError, match=r"tensor-parallel rank 0: .*q_proj"):
        ucp_zarr.convert(src, tmp_path / "ck", rules=rules)
    assert not (tmp_path / "ck" / "zarr.json").exists()


def test_a_replicated_tensor_that_differs_between_tensor_parallel_ranks_is_refused(checkpoints, tmp_path: Path) -> None:
    """Megatron-DeepSpeed's form of the same checkpoint (its universal_checkpoint_info as
    patterns: row-parallel projections, a vocabulary-parallel embedding and head, replicated
    norms, no affine map): the converter took TP rank 0's copy of a replicated tensor without
    a look, where DeepSpeed's ds_to_universal asserts the copies equal. The copies of the
    final norm made to differ in TP rank 1's file: refused, naming the tensor and the rank;
    as DeepSpeed wrote them, the same values as DeepSpeed's own universal output."""
    import shutil

    src, uni = checkpoints[(1, "fp32")]
    info = {"universal_checkpoint_version": 0.2, "original_vocab_size": 100, "padded_vocab_size": 100,
            "tp_replicated_parameter_patterns": [r".*norm\.weight"],
            "parameter_with_row_parallelism_patterns": [r".*o_proj\.weight", r".*down_proj\.weight"],
            "vocabulary_parameter_patterns": [r".*embed_tokens\.weight", r"lm_head\.weight"]}
    for name, change in (("patterns", False), ("bad", True)):
        folder = tmp_path / name
        shutil.copytree(src, folder)
        step = folder / (folder / "latest").read_text().strip()
        for tp in range(2):
            file = step / f"mp_rank_{tp:02d}_model_states.pt"
            states = torch.load(file, weights_only=False)  # (this test's own file)
            states["universal_checkpoint_info"] = info
            if change and tp == 1:
                states["module"]["model.norm.weight"] += 1.0
            torch.save(states, file)
        if not change:
            ucp_zarr.convert(folder, tmp_path / "ck")
            ck = ucp_zarr.open(tmp_path / "ck")
            assert not ck.meta.layout["rules"].get("affine_map")
            wanted = {D.converted_key(ck, n, k): w for n, k, w in D.universal_tensors(uni)}
            assert all(torch.equal(ck.read(k), w) for k, w in wanted.items()) and len(wanted) >= 57
            continue
        with pytest.raises(ConversionError, match=r"'model\.model\.norm\.weight': tensor-parallel rank 1 holds other"):
            ucp_zarr.convert(folder, tmp_path / "ck_bad")
