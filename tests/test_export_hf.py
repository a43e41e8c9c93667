"""``ucp_zarr.export(src, dst, to="hf")`` (issue 19 section 4): a folder that transformers'
``from_pretrained`` loads with no missing or unexpected keys (checked with
``output_loading_info=True``), equal weights; files and index named as ``save_pretrained``
names them; ``config.json`` and tokenizer files kept; crash-safe; Megatron-core's fused
tensors split into Llama's names, checked against Megatron-core's own logits. Also
``--to safetensors`` into a ``.safetensors`` file."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors import safe_open
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

import ucp_zarr
from ucp_zarr.cli import main as cli
from ucp_zarr.converters import base, hf
from ucp_zarr.errors import ConversionError

hf_logging.set_verbosity_error()


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))


def _llama(tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(1)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))


def _names(folder: Path) -> list[str]:
    names: list[str] = []
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            names += list(st.keys())
    return sorted(names)


def _loads(cls: type, folder: Path, **kw: object) -> torch.nn.Module:
    model, info = cls.from_pretrained(folder, output_loading_info=True, **kw)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model


def test_gpt2_tied_bare_state_dict(tmp_path: Path) -> None:
    gpt = _gpt2()
    ucp_zarr.save(gpt.state_dict(), tmp_path / "ck")  # no training prefix: the model's own names
    gpt.config.save_pretrained(tmp_path / "hf")
    ucp_zarr.export(tmp_path / "ck", tmp_path / "hf", to="hf")
    loaded = _loads(GPT2LMHeadModel, tmp_path / "hf")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in gpt.state_dict().items())
    gpt.save_pretrained(tmp_path / "theirs")
    assert _names(tmp_path / "hf") == _names(tmp_path / "theirs")  # lm_head.weight written once, as HF does
    assert "lm_head.weight" not in _names(tmp_path / "hf")


def test_llama_training_state_sharded_as_hf_shards(tmp_path: Path) -> None:
    llama = _llama()
    opt = torch.optim.AdamW(llama.parameters())
    llama(torch.arange(8)[None]).logits.sum().backward()
    opt.step()
    ucp_zarr.save({"model": llama.state_dict(), "optim": opt.state_dict(), "step": 7}, tmp_path / "ck")
    out = tmp_path / "hf"
    llama.config.save_pretrained(out)
    (out / "tokenizer.json").write_text('{"version": "1.0"}')
    (out / "extra").mkdir()
    (out / "extra" / "notes.txt").write_text("kept")
    config = os.stat(out / "config.json").st_ino
    ucp_zarr.export(tmp_path / "ck", out, to="hf", dtype="bf16", max_shard_size="10KB")
    llama.to(torch.bfloat16).save_pretrained(tmp_path / "theirs", max_shard_size="10KB")
    ours, theirs = (json.loads((d / "model.safetensors.index.json").read_text()) for d in (out, tmp_path / "theirs"))
    assert ours["weight_map"] == theirs["weight_map"] and len(set(ours["weight_map"].values())) > 2
    assert ours["metadata"] == theirs["metadata"]  # total_size, total_parameters
    assert sorted(p.name for p in out.glob("model*")) == sorted(p.name for p in (tmp_path / "theirs").glob("model*"))
    assert os.stat(out / "config.json").st_ino == config and (out / "tokenizer.json").is_file()
    assert (out / "extra" / "notes.txt").read_text() == "kept"
    loaded = _loads(LlamaForCausalLM, out, dtype=torch.bfloat16)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in llama.state_dict().items())
    # weights already there: refused, or replaced whole (no stale shard stays beside the new file)
    with pytest.raises(ConversionError, match=r"already holds \['model-00001-of-"):
        ucp_zarr.export(tmp_path / "ck", out, to="hf")
    ucp_zarr.export(tmp_path / "ck", out, to="hf", overwrite=True, dtype="bf16")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "extra", "model.safetensors", "tokenizer.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "hf", "theirs"]  # no temporary sibling left
    loaded = _loads(LlamaForCausalLM, out, dtype=torch.bfloat16)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"} and f.get_tensor("lm_head.weight").dtype == torch.bfloat16


def test_fp32_masters_and_prefix(tmp_path: Path) -> None:
    gpt = _gpt2()
    masters = {k: v + 1e-3 for k, v in gpt.state_dict().items() if k != "lm_head.weight"}
    low = {k: v.to(torch.bfloat16) for k, v in gpt.state_dict().items()}
    low["lm_head.weight"] = low["transformer.wte.weight"]
    state = {"model": {"module": low}, "optim": {"state": {k: {"fp32": v} for k, v in masters.items()}}}
    ucp_zarr.save(state, tmp_path / "ck")
    ucp_zarr.export(tmp_path / "ck", tmp_path / "hf", to="hf", masters=True)  # prefix detected: model.module.
    gpt.config.save_pretrained(tmp_path / "hf")
    loaded = _loads(GPT2LMHeadModel, tmp_path / "hf")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in masters.items())
    ucp_zarr.export(tmp_path / "ck", tmp_path / "low", to="hf", prefix="model.module.")
    with safe_open(str(tmp_path / "low" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("transformer.wte.weight").dtype == torch.bfloat16
    ucp_zarr.save({"model": low}, tmp_path / "no_masters")
    with pytest.raises(ConversionError, match="holds no fp32 masters"):
        ucp_zarr.export(tmp_path / "no_masters", tmp_path / "x", to="hf", masters=True)
    with pytest.raises(ConversionError, match="no tensor under the prefix 'nothing.'"):
        ucp_zarr.export(tmp_path / "ck", tmp_path / "x", to="hf", prefix="nothing.")


def test_a_tie_is_written_under_the_name_save_pretrained_keeps(tmp_path: Path) -> None:
    """With the config in the folder, a tie stored under ``lm_head.weight`` (first in the
    saved state dict's order) is written as the embedding, as ``save_pretrained`` writes it
    (before: as ``lm_head.weight``, which tools reading the embedding do not find)."""
    llama = _llama(tied=True)
    sd = llama.state_dict()
    ucp_zarr.save({"model": {k: sd[k] for k in sorted(sd)}}, tmp_path / "ck")  # lm_head.weight first
    assert ucp_zarr.open(tmp_path / "ck").meta.ties == {"model.model.embed_tokens.weight": "model.lm_head.weight"}
    llama.config.save_pretrained(tmp_path / "hf")
    ucp_zarr.export(tmp_path / "ck", tmp_path / "hf", to="hf")
    llama.save_pretrained(tmp_path / "theirs")
    assert _names(tmp_path / "hf") == _names(tmp_path / "theirs") and "lm_head.weight" not in _names(tmp_path / "hf")
    loaded = _loads(LlamaForCausalLM, tmp_path / "hf")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in sd.items())


def test_an_export_that_would_leave_weights_random_is_refused(tmp_path: Path) -> None:
    """A Lightning checkpoint of a module holding the HF model as ``self.model``: the prefix
    detected is ``state_dict.``, so every name keeps a ``model.`` that the HF model does not
    have. With the model's config.json in the folder, the export is refused naming the
    weights that from_pretrained would initialise at random and the prefix to give (before:
    written under those names, and from_pretrained loaded a random model with a warning)."""
    llama = _llama(tied=True)
    ucp_zarr.save({"state_dict": {f"model.{k}": v for k, v in llama.state_dict().items()}, "epoch": 1}, tmp_path / "ck")
    llama.config.save_pretrained(tmp_path / "hf")
    with pytest.raises(ConversionError, match=r"random initialisation \(\['model\.embed_tokens\.weight'.*'state_dict\.model\.'"):
        ucp_zarr.export(tmp_path / "ck", tmp_path / "hf", to="hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json"]
    ucp_zarr.export(tmp_path / "ck", tmp_path / "hf", to="hf", prefix="state_dict.model.")
    loaded = _loads(LlamaForCausalLM, tmp_path / "hf")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in llama.state_dict().items())


def test_prefix_detection() -> None:
    llama = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    assert hf.detect_prefix(llama) == ""  # Llama's own "model." is no training prefix
    assert hf.detect_prefix(["model." + k for k in llama] + ["optim.state.lm_head.weight.exp_avg"]) == "model."
    assert hf.detect_prefix(["module.fc.weight", "optimizer.state.0.exp_avg"]) == "module."
    assert hf.detect_prefix(["model.module.fc.weight", "model.module.fc.bias", "rng.0"]) == "model.module."
    assert hf.detect_prefix(["state_dict.model.fc.weight", "optimizer_states.0.state.0.exp_avg"]) == "state_dict."
    assert hf.detect_prefix(["net.fc.weight", "ema.fc.weight"]) == ""  # (which is the model's, only prefix= can say)
    with pytest.raises(ConversionError, match=r"cannot tell which keys are the model's weights .*; give prefix="):
        hf.detect_prefix(["optim.state.0.exp_avg", "rng.0"])
    assert hf.shard_size("5GB") == 5 * 10**9 and hf.shard_size("500MB") == 5 * 10**8 and hf.shard_size(1234) == 1234
    with pytest.raises(ConversionError, match="not a positive size"):
        hf.shard_size("5 parsecs")


def test_an_interrupted_export_leaves_the_folder_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gpt = _gpt2()
    ucp_zarr.save({"model": gpt.state_dict()}, tmp_path / "ck")
    gpt.config.save_pretrained(tmp_path / "hf")
    before = (tmp_path / "hf" / "config.json").read_bytes()

    def broken(folder: Path, *args: object) -> None:
        (folder / "model-00001-of-00002.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(hf, "write_shards", broken)
    with pytest.raises(OSError, match="disk full"):
        ucp_zarr.export(tmp_path / "ck", tmp_path / "hf", to="hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "hf"]
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json"]
    assert (tmp_path / "hf" / "config.json").read_bytes() == before
    monkeypatch.undo()
    monkeypatch.setattr(base, "exchange_paths", lambda a, b: False)  # a file system without renameat2's exchange
    ucp_zarr.export(tmp_path / "ck", tmp_path / "hf", to="hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "hf"]
    _loads(GPT2LMHeadModel, tmp_path / "hf")


def test_safetensors_file_and_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import load_file

    gpt = _gpt2()
    ucp_zarr.save({"model": gpt.state_dict(), "step": 3}, tmp_path / "ck")
    assert cli(["export", str(tmp_path / "ck"), str(tmp_path / "out" / "model.safetensors"), "--to", "safetensors"]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert sorted(load_file(tmp_path / "out" / "model.safetensors")) == sorted(f"model.{k}" for k in gpt.state_dict()
                                                                              if k != "lm_head.weight")
    gpt.config.save_pretrained(tmp_path / "hf")
    assert cli(["export", str(tmp_path / "ck"), str(tmp_path / "hf"), "--to", "hf", "--dtype", "fp16"]) == 0
    assert _loads(GPT2LMHeadModel, tmp_path / "hf", dtype=torch.float16).transformer.wte.weight.dtype == torch.float16
    with pytest.raises(SystemExit):
        cli(["export", "--help"])
    shown = capsys.readouterr().out
    assert all(f"  {kind} " in shown for kind in ("hf", "safetensors", "dcp", "ds-universal"))


@pytest.fixture(scope="module")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoints and logits of ``tests/_hf_export_job.py``, made once."""
    import _hf_export_job as job
    import megatron_core_models as MC

    folder = tmp_path_factory.mktemp("megatron")
    MC.run_job(job.job, 2, str(folder), timeout_s=600)
    return folder


def _llama_config(out: Path, tied: bool, **kw: object) -> None:
    """A config.json in ``out`` of the Llama that Megatron-core's test models are."""
    import megatron_core_models as MC

    LlamaConfig(**{"vocab_size": MC.VOCAB, "hidden_size": MC.HIDDEN, "intermediate_size": MC.FFN,
                   "num_hidden_layers": MC.NUM_LAYERS, "num_attention_heads": MC.HEADS,
                   "num_key_value_heads": MC.GROUPS, "head_dim": MC.KV_CHANNELS, "rms_norm_eps": 1e-5,
                   "max_position_embeddings": MC.MAX_SEQ, "tie_word_embeddings": tied} | kw).save_pretrained(out)


def test_megatron_core_to_llama(megatron: Path, tmp_path: Path) -> None:
    """Megatron-core's GPTModel (Llama's architecture) saved at TP=2 (untied) and PP=2 (tied)
    through Rules.from_megatron, exported with names="megatron_to_llama": LlamaForCausalLM
    loads each with no missing or unexpected keys and gives Megatron-core's own logits."""
    import _hf_export_job as job
    import megatron_core_models as MC

    for name, tied in (("untied", False), ("tied", True)):
        out = tmp_path / f"hf_{name}"
        _llama_config(out, tied)
        ucp_zarr.export(megatron / name, out, to="hf", names="megatron_to_llama")
        llama = _loads(LlamaForCausalLM, out)
        ref = torch.load(megatron / f"{name}.pt")
        with torch.no_grad():
            torch.testing.assert_close(llama(job.TOKENS).logits, ref["logits"], rtol=0, atol=1e-5)
        names = _names(out)
        assert ("lm_head.weight" in names) != tied and "model.layers.1.self_attn.k_proj.weight" in names
    # the weights Megatron-core built, where no layout is involved (the fused ones: the logits above)
    state, sd = ref["state"], llama.state_dict()
    assert torch.equal(sd["model.embed_tokens.weight"], state["embedding.word_embeddings.weight"][:MC.VOCAB])
    assert torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
    for i in range(MC.NUM_LAYERS):
        assert torch.equal(sd[f"model.layers.{i}.self_attn.o_proj.weight"],
                           state[f"decoder.layers.{i}.self_attention.linear_proj.weight"])
        assert torch.equal(sd[f"model.layers.{i}.mlp.down_proj.weight"], state[f"decoder.layers.{i}.mlp.linear_fc2.weight"])
    # a fused tensor is split whole or not at all
    with pytest.raises(ConversionError, match=r"names map its sub-parameters \['q'\] but not \['k', 'v'\]"):
        ucp_zarr.export(megatron / "untied", tmp_path / "x", to="hf",
                        names={"decoder.layers.0.self_attention.linear_qkv.weight:q": "q"})


@pytest.mark.parametrize("name, setting", [("interleaved", r"rotary_interleaved=True \(Llama: False\)"),
                                           ("partial", r"rotary embeddings on 4 of each head's 8 dims"),
                                           ("qk_l2", r"qk_l2_norm=True \(Llama: False\)")])
def test_megatron_core_rotary_llama_does_not_apply_is_refused(megatron: Path, tmp_path: Path, name: str,
                                                               setting: str) -> None:
    """Megatron-core models of Llama's architecture but for their rotary embeddings
    (``rotary_interleaved``, ``rotary_percent=0.5``) or a weightless L2 norm of queries and
    keys (``qk_l2_norm``, Llama 4's: no name or shape shows it): exported under Llama's names, Llama
    loads them without a word and gives other logits (shown with the same mapping, unchecked);
    names="megatron_to_llama" is refused naming the setting (before: exported)."""
    import megatron_core_models as MC

    assert MC.KV_CHANNELS == 8
    unchecked = tmp_path / "unchecked"
    _llama_config(unchecked, False)
    ucp_zarr.export(megatron / name, unchecked, to="hf", names=lambda n: hf.megatron_to_llama(n))
    with torch.no_grad():
        got = _loads(LlamaForCausalLM, unchecked)(torch.load(megatron / f"{name}.pt")["tokens"]).logits
    assert (got - torch.load(megatron / f"{name}.pt")["logits"]).abs().max() > 1e-4  # (equal: below 1e-5)
    _llama_config(tmp_path / "hf", False)
    for names in ("megatron_to_llama", hf.megatron_to_llama):
        with pytest.raises(ConversionError, match=setting):
            ucp_zarr.export(megatron / name, tmp_path / "hf", to="hf", names=names)
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["config.json"]


@pytest.mark.parametrize("setting, message", [
    ({"rms_norm_eps": 1e-6}, r"rms_norm_eps=1e-06 where Megatron-core's layernorm_epsilon=1e-05"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, r"rotary frequencies"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}, r"rotary frequencies"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' where Megatron-core's activation_func='silu'"),
])
def test_a_llama_config_of_other_settings_than_megatron_core_trained_is_refused(
        megatron: Path, tmp_path: Path, setting: dict[str, object], message: str) -> None:
    """A config.json whose epsilon (Llama's default 1e-6; Megatron's 1e-5), rope theta or
    scaling, or activation differs from the Megatron-core model's: from_pretrained loads
    the export without a word and gives other logits (shown unchecked); the export with
    names="megatron_to_llama" is refused naming both settings (before: exported)."""
    ref = torch.load(megatron / "untied.pt")
    unchecked = tmp_path / "unchecked"
    _llama_config(unchecked, False, **setting)
    ucp_zarr.export(megatron / "untied", unchecked, to="hf", names=lambda n: hf.megatron_to_llama(n))
    with torch.no_grad():
        got = _loads(LlamaForCausalLM, unchecked)(ref["tokens"]).logits
    assert (got - ref["logits"]).abs().max() > 1e-6
    _llama_config(tmp_path / "hf", False, **setting)
    with pytest.raises(ConversionError, match=message):
        ucp_zarr.export(megatron / "untied", tmp_path / "hf", to="hf", names="megatron_to_llama")


def test_a_mistral_config_with_a_sliding_window_is_refused(megatron: Path, tmp_path: Path) -> None:
    """Mistral has Llama's names: a config.json with a sliding window shorter than the
    sequence loads the export of a Megatron-core model that attends to every earlier position
    and gives other logits (shown unchecked); the export is refused naming the window; without
    a window it loads and gives Megatron-core's logits."""
    import megatron_core_models as MC
    from transformers import MistralConfig, MistralForCausalLM

    ref = torch.load(megatron / "untied.pt")
    for window in (4, None):
        out = tmp_path / f"w{window}"
        MistralConfig(vocab_size=MC.VOCAB, hidden_size=MC.HIDDEN, intermediate_size=MC.FFN, num_hidden_layers=MC.NUM_LAYERS,
                      num_attention_heads=MC.HEADS, num_key_value_heads=MC.GROUPS, head_dim=MC.KV_CHANNELS,
                      rms_norm_eps=1e-5, max_position_embeddings=MC.MAX_SEQ, sliding_window=window,
                      tie_word_embeddings=False).save_pretrained(out)
        if window is not None:
            ucp_zarr.export(megatron / "untied", tmp_path / "unchecked", to="hf", names=lambda n: hf.megatron_to_llama(n))
            (tmp_path / "unchecked" / "config.json").write_bytes((out / "config.json").read_bytes())
            with torch.no_grad():
                got = _loads(MistralForCausalLM, tmp_path / "unchecked")(ref["tokens"]).logits
            assert (got - ref["logits"]).abs().max() > 1e-4
            with pytest.raises(ConversionError, match=r"sliding_window=4 where Megatron-core's model attends"):
                ucp_zarr.export(megatron / "untied", out, to="hf", names="megatron_to_llama")
        else:
            ucp_zarr.export(megatron / "untied", out, to="hf", names="megatron_to_llama")
            with torch.no_grad():
                got = _loads(MistralForCausalLM, out)(ref["tokens"]).logits
            torch.testing.assert_close(got, ref["logits"], rtol=0, atol=1e-5)


def test_an_export_the_config_has_no_place_for_is_refused(tmp_path: Path) -> None:
    """A config.json of the same model with fewer layers (an old one left in the folder):
    from_pretrained would load it and drop layer 1 silently; the export is refused naming the
    weights (before: written, and the model loaded without them)."""
    llama = _llama()
    ucp_zarr.save({"model": llama.state_dict()}, tmp_path / "ck")
    smaller = LlamaConfig(**(llama.config.to_dict() | {"num_hidden_layers": 1}))
    smaller.save_pretrained(tmp_path / "hf")
    with pytest.raises(ConversionError, match=r"9 weight\(s\) that the model its config.json describes does not have"):
        ucp_zarr.export(tmp_path / "ck", tmp_path / "hf", to="hf")
    ucp_zarr.export(tmp_path / "ck", tmp_path / "hf", to="hf",  # (left out by names=: what the config describes)
                    names=lambda n: None if n.startswith("model.layers.1.") else n)
    assert _loads(LlamaForCausalLM, tmp_path / "hf").config.num_hidden_layers == 1


def test_the_config_records_the_dtype_the_weights_were_written_in(tmp_path: Path) -> None:
    """fp32 masters (or dtype=) exported into a folder whose config.json says bfloat16 (as
    save_pretrained of a bf16 model writes it) load in the dtype written, bit-exact, as
    save_pretrained of the fp32 model gives (before: from_pretrained followed the config and
    rounded them to bf16)."""
    llama = _llama()
    masters = {k: v.clone() for k, v in llama.state_dict().items()}
    low = {k: v.to(torch.bfloat16) for k, v in masters.items()}
    ucp_zarr.save({"model": low, "optim": {"state": {k: {"fp32": v} for k, v in masters.items()}}}, tmp_path / "ck")
    llama.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")  # (its config, as save_pretrained writes it)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_bytes((tmp_path / "bf16" / "config.json").read_bytes())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    ucp_zarr.export(tmp_path / "ck", tmp_path / "hf", to="hf", masters=True)
    loaded = _loads(LlamaForCausalLM, tmp_path / "hf")
    assert loaded.dtype == torch.float32 and all(torch.equal(loaded.state_dict()[k], v) for k, v in masters.items())
    ucp_zarr.export(tmp_path / "ck", tmp_path / "hf", to="hf", dtype="fp16", overwrite=True)
    assert _loads(LlamaForCausalLM, tmp_path / "hf").dtype == torch.float16


def test_a_tied_hugging_face_model_converted_as_it_is_exports_under_its_names(tmp_path: Path) -> None:
    """save_pretrained of a tied Llama writes only model.* names (lm_head.weight is the tie):
    converted without a prefix and exported into a folder with its config.json, the export
    took model. for a training prefix and was refused as leaving 20 weights random. The
    config tells: the names stay, as save_pretrained wrote them."""
    llama = _llama(tied=True)
    llama.save_pretrained(tmp_path / "src")
    assert all(n.startswith("model.") for n in _names(tmp_path / "src"))
    ucp_zarr.convert(tmp_path / "src", tmp_path / "ck")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_bytes((tmp_path / "src" / "config.json").read_bytes())
    ucp_zarr.export(tmp_path / "ck", tmp_path / "hf", to="hf")
    assert _names(tmp_path / "hf") == _names(tmp_path / "src")
    loaded = _loads(LlamaForCausalLM, tmp_path / "hf")
    ids = torch.tensor([[1, 5, 9, 3]])
    assert torch.equal(loaded(ids).logits, llama(ids).logits)


def test_masters_of_a_model_with_frozen_weights_load_unrounded(tmp_path: Path) -> None:
    """A frozen weight has no fp32 master (no optimizer keeps one): masters=True wrote it in
    bf16 beside fp32 masters, the config kept bfloat16 and from_pretrained rounded every
    master to it. The frozen weight is written in fp32 too (exactly), so the folder loads in
    fp32 with the masters bit-exact."""
    llama = _llama()
    masters = {k: v.clone() for k, v in llama.state_dict().items()}
    low = {k: v.to(torch.bfloat16) for k, v in masters.items()}
    frozen = "model.embed_tokens.weight"
    state = {k: {"fp32": v} for k, v in masters.items() if k != frozen}
    ucp_zarr.save({"model": low, "optim": {"state": state}}, tmp_path / "ck")
    llama.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_bytes((tmp_path / "bf16" / "config.json").read_bytes())
    ucp_zarr.export(tmp_path / "ck", tmp_path / "hf", to="hf", masters=True)
    loaded = _loads(LlamaForCausalLM, tmp_path / "hf")
    assert loaded.dtype == torch.float32
    for k, v in masters.items():
        assert torch.equal(loaded.state_dict()[k], low[k].float() if k == frozen else v), k
    from safetensors.torch import load_file

    wide = torch.tensor([1e-300, 3.0], dtype=torch.float64)  # (no master, and wider than fp32: kept as it is)
    ucp_zarr.save({"model": {"w": low[frozen], "f64": wide, "n": torch.arange(3)},
                   "optim": {"state": {"w": {"fp32": masters[frozen]}}}}, tmp_path / "ck2")
    ucp_zarr.export(tmp_path / "ck2", tmp_path / "hf2", to="hf", masters=True)
    written = load_file(tmp_path / "hf2" / "model.safetensors")
    assert torch.equal(written["f64"], wide) and torch.equal(written["n"], torch.arange(3))
    assert torch.equal(written["w"], masters[frozen])


def test_a_sequence_to_sequence_model_without_architectures_exports(tmp_path: Path) -> None:
    """A tied BART whose config.json names no architectures (config.save_pretrained): the
    export is checked against BartForConditionalGeneration, as from_pretrained of that class
    loads it (before: only a causal LM and the bare model were tried, and the export was
    refused as leaving the decoder's embedding random)."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    bart = BartForConditionalGeneration(BartConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=32))
    ucp_zarr.save({"model": bart.state_dict()}, tmp_path / "ck")
    bart.config.save_pretrained(tmp_path / "hf")
    ucp_zarr.export(tmp_path / "ck", tmp_path / "hf", to="hf")
    loaded = _loads(BartForConditionalGeneration, tmp_path / "hf")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in bart.state_dict().items())


def _bart() -> torch.nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    return BartForConditionalGeneration(BartConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=32))


@pytest.mark.parametrize("max_shard_size, renamed", [("5GB", False), ("4KB", False), ("5GB", True)])
def test_an_lm_head_untied_by_fine_tuning_keeps_its_name(tmp_path: Path, max_shard_size: str, renamed: bool) -> None:
    """A BART whose lm_head was untied (its own tensor; the shared, encoder and decoder
    embeddings still one), saved in sorted key order (the embedding tie's kept name then
    ``decoder.embed_tokens.weight``), under its own names or under others that ``names=``
    maps back: the embedding is written as ``model.shared.weight`` and the lm_head under its
    own name, as save_pretrained writes them, with its logits (before: both renamed to the
    tie's kept name; one shard refused, several shards wrote one name twice and
    from_pretrained loaded the other tensor, without a word). A checkpoint that names none
    of its tensors as the kept one is refused, naming names= as the way out."""
    bart = _bart()
    bart.lm_head.weight = torch.nn.Parameter(bart.lm_head.weight.detach() + 0.5)
    sd = bart.state_dict()
    pre = "net." if renamed else ""
    ucp_zarr.save({"model": {pre + k: sd[k] for k in sorted(sd)}, "step": 1}, tmp_path / "ck")
    bart.config.save_pretrained(tmp_path / "hf")
    names = {"names": {pre + k: k for k in sd}, "prefix": "model."} if renamed else {}
    ucp_zarr.export(tmp_path / "ck", tmp_path / "hf", to="hf", max_shard_size=max_shard_size, **names)
    bart.save_pretrained(tmp_path / "theirs")
    assert _names(tmp_path / "hf") == _names(tmp_path / "theirs")
    loaded = _loads(type(bart), tmp_path / "hf").eval()
    ids = torch.tensor([[5, 9, 3, 7, 11]])
    assert torch.equal(loaded(input_ids=ids, decoder_input_ids=ids).logits, bart.eval()(input_ids=ids, decoder_input_ids=ids).logits)
    if not renamed:
        ucp_zarr.save({"model": {k: sd[k] for k in sorted(sd) if k != "model.shared.weight"}}, tmp_path / "ck2")
        (tmp_path / "hf2").mkdir()
        (tmp_path / "hf2" / "config.json").write_bytes((tmp_path / "hf" / "config.json").read_bytes())
        with pytest.raises(ConversionError, match=r"names none of them 'model\.shared\.weight': say which it is with names="):
            ucp_zarr.export(tmp_path / "ck2", tmp_path / "hf2", to="hf", max_shard_size=max_shard_size)


def test_the_master_of_a_tie_is_found_under_its_other_name(tmp_path: Path) -> None:
    """masters=True for a tied Llama stored in sorted key order (its tie kept as
    ``lm_head.weight``) whose optimizer names the master by named_parameters()
    (``model.embed_tokens.weight``): the master is written, bit for bit (before: the bf16
    weight, upcast, as if it were frozen, without a word)."""
    llama = _llama(tied=True)
    masters = {n: p.detach().clone() for n, p in llama.named_parameters()}
    low = {k: v.to(torch.bfloat16) for k, v in llama.state_dict().items()}
    low["lm_head.weight"] = low["model.embed_tokens.weight"]  # (one tensor, as the model holds it)
    state = {k: {"fp32": v} for k, v in masters.items()}
    ucp_zarr.save({"model": {k: low[k] for k in sorted(low)}, "optim": {"state": state}}, tmp_path / "ck")
    llama.config.save_pretrained(tmp_path / "hf")
    ucp_zarr.export(tmp_path / "ck", tmp_path / "hf", to="hf", masters=True)
    loaded = _loads(LlamaForCausalLM, tmp_path / "hf")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in masters.items())


def test_a_config_without_architectures_is_fitted_by_the_model_taking_every_weight(tmp_path: Path) -> None:
    """A config.json naming no architectures (config.save_pretrained) of a speech
    sequence-to-sequence model and of a masked LM: the export is checked against the model
    that takes every weight and leaves none random (before: the first leaving none random
    won, WhisperForCausalLM without the encoder, or the bare DistilBERT without its head, and
    an export that loads right was refused)."""
    from transformers import DistilBertConfig, DistilBertForMaskedLM, WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    whisper = WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=48, decoder_ffn_dim=48, num_mel_bins=8, max_source_positions=16, max_target_positions=16,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1))
    bert = DistilBertForMaskedLM(DistilBertConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, hidden_dim=48,
                                                  max_position_embeddings=16))
    for name, model in (("whisper", whisper), ("bert", bert)):
        ucp_zarr.save({"model": model.state_dict()}, tmp_path / f"ck_{name}")
        model.config.save_pretrained(tmp_path / name)
        ucp_zarr.export(tmp_path / f"ck_{name}", tmp_path / name, to="hf")
        loaded = _loads(type(model), tmp_path / name)
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items()), name
