"""PyTorch Lightning with ZarrCheckpointIO: the checkpoint dict round-trips exactly (types
included, nothing pickled), ModelCheckpoint's top-k removal works, Lightning's
AsyncCheckpointIO runs it in the background, and ``trainer.fit(ckpt_path=...)`` resumes with
the losses of an uninterrupted run, bit for bit, on one process and on two (DDP, gloo)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _doc_blocks import exec_page
from _jobs import run_job
from _lightning_job import EPOCHS, STEPS_PER_EPOCH, Regression, fit
from lightning.pytorch.plugins.io import AsyncCheckpointIO

import ucp_zarr
from ucp_zarr.integrations.lightning import ZarrCheckpointIO

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    return fit(tmp_path_factory.mktemp("full"), EPOCHS, seed=0, save_top_k=0)


def _same(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` are equal with the same types at every depth (tensors: bit for bit)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (where, list(a), list(b))
        for k in a:
            _same(a[k], b[k], f"{where}.{k!r}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}.{i}")
    else:
        assert type(a) is type(b) and a == b, (where, a, b)


class _Recording(ZarrCheckpointIO):
    """Keeps a copy of the last dict Lightning asked it to save."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.saved = {"path": str(path), "checkpoint": copy.deepcopy(checkpoint)}
        super().save_checkpoint(checkpoint, path, storage_options)


def test_the_checkpoint_dict_comes_back_as_lightning_gave_it(tmp_path: Path) -> None:
    io = _Recording()
    fit(tmp_path, 1, seed=0, plugin=io, monitor="loss")
    back = io.load_checkpoint(io.saved["path"])
    _same(io.saved["checkpoint"], back)
    assert set(back) >= {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks", "hyper_parameters"}
    assert list(back["optimizer_states"][0]["state"]) == [0, 1, 2, 3]  # integer keys, as torch keys them
    assert back["hyper_parameters"]["betas"] == (0.9, 0.99)
    ck = ucp_zarr.open(io.saved["path"])  # an ordinary ucp_zarr checkpoint
    assert torch.equal(ck["state_dict.net.0.weight"][...], io.saved["checkpoint"]["state_dict"]["net.0.weight"])


def test_resume_gives_the_losses_of_the_uninterrupted_run(tmp_path: Path, full: dict[int, float]) -> None:
    ckpts = tmp_path / "ckpts"
    first = fit(ckpts, EPOCHS - 1, seed=0, monitor="loss", save_top_k=1, every_n_train_steps=1, save_last=True)
    # top-k removal went through the plug-in: one best checkpoint and last.ckpt, both committed
    kept = sorted(p.name for p in ckpts.iterdir())
    assert len(kept) == 2 and "last.ckpt" in kept, kept
    for name in kept:
        ucp_zarr.open(ckpts / name)
    second = fit(ckpts, EPOCHS, seed=123, ckpt_path=str(ckpts / "last.ckpt"))
    resumed_at = STEPS_PER_EPOCH * (EPOCHS - 1)
    assert first == {s: full[s] for s in range(1, resumed_at + 1)}
    assert second == {s: full[s] for s in range(resumed_at + 1, STEPS_PER_EPOCH * EPOCHS + 1)}  # bit for bit


@pytest.mark.parametrize("plugin", [lambda: ZarrCheckpointIO(async_save=True), lambda: AsyncCheckpointIO(ZarrCheckpointIO())],
                         ids=["async_save", "AsyncCheckpointIO"])
def test_background_saves_resume(tmp_path: Path, full: dict[int, float], plugin: Any) -> None:
    ckpts = tmp_path / "ckpts"
    fit(ckpts, EPOCHS - 1, seed=0, plugin=plugin(), monitor="loss", save_top_k=1, every_n_train_steps=1, save_last=True)
    kept = sorted(p.name for p in ckpts.iterdir())  # (the end of fit waited for the last save)
    for name in kept:
        ucp_zarr.open(ckpts / name)
    if isinstance(plugin(), ZarrCheckpointIO):  # exactly top-k: a removal waits for the save in flight
        assert len(kept) == 2 and "last.ckpt" in kept, kept
    else:  # Lightning's queue may hold a save of a path ModelCheckpoint removes meanwhile (as with torch.save)
        assert "last.ckpt" in kept and len(kept) >= 2, kept
    second = fit(ckpts, EPOCHS, seed=123, plugin=plugin(), ckpt_path=str(ckpts / "last.ckpt"))
    resumed_at = STEPS_PER_EPOCH * (EPOCHS - 1)
    assert second == {s: full[s] for s in range(resumed_at + 1, STEPS_PER_EPOCH * EPOCHS + 1)}


def test_a_linked_last_checkpoint_is_removed_as_a_link(tmp_path: Path) -> None:
    """``ModelCheckpoint(save_last="link")`` makes ``last.ckpt`` a symbolic link to a top-k
    checkpoint and later removes old links through the plugin: the link goes, the checkpoint
    it names stays (as with Lightning's own ``TorchCheckpointIO``). Before, the checkpoint
    behind the link was deleted: after a resume, a best top-k checkpoint was an empty folder."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    for steps, ckpt_path in ((5, None), (12, str(tmp_path / "last.ckpt"))):  # (a resume: last-v1.ckpt, then removal)
        torch.manual_seed(0)
        checkpoints = ModelCheckpoint(dirpath=tmp_path, monitor="loss", save_top_k=2, save_last="link", every_n_train_steps=3)
        trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[checkpoints], plugins=[ZarrCheckpointIO()])
        trainer.fit(Regression(), torch.utils.data.DataLoader(data, batch_size=8), ckpt_path=ckpt_path)
    entries = sorted(tmp_path.iterdir())
    assert {p.name for p in entries} >= {Path(p).name for p in checkpoints.best_k_models}
    links = [p for p in entries if p.is_symlink()]
    assert links and all(p.resolve().parent == tmp_path for p in links)
    for p in entries:  # every checkpoint, and what every link names, loads
        assert ZarrCheckpointIO().load_checkpoint(p)["global_step"] > 0, p


def test_a_save_over_a_linked_last_checkpoint_replaces_the_link(tmp_path: Path) -> None:
    """A resumed ``ModelCheckpoint(save_last="link")`` run saves a real ``last.ckpt`` while it
    is still a link to a top-k checkpoint: the link is replaced and the top-k checkpoint keeps
    its state, as with Lightning's own ``TorchCheckpointIO`` (before: the save went through the
    link, and ``epoch=2-step=12.ckpt``, the best model, held step 14)."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    for io, name in ((TorchCheckpointIO(), "torch"), (ZarrCheckpointIO(), "zarr")):
        best, last = tmp_path / name / "epoch=2-step=12.ckpt", tmp_path / name / "last.ckpt"
        best.parent.mkdir()
        io.save_checkpoint({"global_step": 12, "w": torch.full((3,), 12.0)}, best)
        last.symlink_to(best.name)  # (as ModelCheckpoint._link_checkpoint makes it)
        io.save_checkpoint({"global_step": 14, "w": torch.full((3,), 14.0)}, last)
        assert not last.is_symlink(), name
        assert [io.load_checkpoint(p)["global_step"] for p in (best, last)] == [12, 14], name
        assert torch.equal(io.load_checkpoint(best)["w"], torch.full((3,), 12.0)), name


@pytest.mark.parametrize("kind", ["fsdp", "mp", "tp"])
def test_sharded_strategies_save_ucp_zarr_checkpoints_and_resume_as_lightnings_own(tmp_path: Path, kind: str) -> None:
    """ZarrFSDPStrategy (FSDP1, sharded) and ZarrModelParallelStrategy (FSDP2 dp=2; TP=2) on 2
    gloo processes: ModelCheckpoint's top-k and last.ckpt are ucp_zarr checkpoints holding the
    tensors of Lightning's own DCP checkpoints of the same run; a resume from last.ckpt gives
    Lightning's resume and the uninterrupted run bit for bit (losses, every rank's shards of
    the model and optimizer, step, lr); top-k removal leaves the same names; remove_checkpoint
    removes one. (Before: these strategies wrote DCP's own format whatever the plug-in.)"""
    import subprocess

    job = Path(__file__).parent / "_lightning_strategies_job.py"
    done = subprocess.run([sys.executable, str(job), kind, str(tmp_path / "run")], capture_output=True, text=True, timeout=400,
                          cwd=tmp_path)
    assert done.returncode == 0 and "all checks passed" in done.stdout, done.stdout[-3000:] + done.stderr[-5000:]


def test_a_sharded_save_prepares_its_path_before_it_changes_anything(tmp_path: Path) -> None:
    """What rank 0 does before a sharded strategy's save (its outcome is agreed, so every
    rank raises together): a value of Lightning's other state that cannot be stored is
    refused before anything at the path changes (before: the old lightning_meta was removed
    and new shards written first, and the complete last.ckpt was lost); Lightning's own
    checkpoint files at the path are removed (before: left, and Lightning's strategy resumed
    that stale step); a folder holding both formats is refused at load (before: the ucp_zarr
    one was read, though Lightning's own was saved over it later)."""
    from ucp_zarr.integrations.lightning import META, ZarrModelParallelStrategy, is_sharded_checkpoint

    strategy = object.__new__(ZarrModelParallelStrategy)  # (only _prepare's own members are used)
    path = tmp_path / "last.ckpt"
    ZarrCheckpointIO().save_checkpoint({"global_step": 3}, path / META)
    assert is_sharded_checkpoint(path)
    with pytest.raises(ucp_zarr.NotJSONableError, match="value at key 'seen' of type set"):
        strategy._prepare(str(path), {"state_dict": {}, "global_step": 6, "seen": {1, 2}})
    assert ucp_zarr.read_state_dict(path / META)["global_step"] == 3
    for name in (".metadata", "meta.pt", "__0_0.distcp", "__1_0.distcp"):
        (path / name).write_bytes(b"Lightning's own")
    with pytest.raises(ucp_zarr.CheckpointError, match=r"holds a ucp_zarr checkpoint \(lightning_meta\) and Lightning's own"):
        is_sharded_checkpoint(path)
    strategy._prepare(str(path), {"state_dict": {}, "global_step": 6})
    assert sorted(p.name for p in path.iterdir()) == []  # (its files, and the lightning_meta the save replaces)


def test_a_value_that_needs_pickle_is_refused_naming_its_key(tmp_path: Path) -> None:
    class WithModule(Regression):
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters({"loss_fn": torch.nn.MSELoss()})

    io = ZarrCheckpointIO()
    with pytest.raises(ucp_zarr.NotJSONableError, match=r"hyper_parameters\.loss_fn.*save_hyperparameters\(ignore"):
        io.save_checkpoint({"hyper_parameters": WithModule().hparams, "state_dict": {}}, tmp_path / "x.ckpt")
    with pytest.raises(ucp_zarr.NotACheckpointError):
        ucp_zarr.open(tmp_path / "x.ckpt")


def test_two_process_ddp_resume_gives_the_losses_of_the_uninterrupted_run(tmp_path: Path) -> None:
    run_job([sys.executable, str(HERE / "_lightning_job.py"), str(tmp_path)], tmp_path)  # Lightning starts rank 1
    for rank in range(2):  # each rank takes one step of 32 per epoch
        r = {k: {int(s): v for s, v in d.items()} for k, d in json.loads((tmp_path / f"losses_{rank}.json").read_text()).items()}
        assert len(r["full"]) == EPOCHS
        assert r["first"] == {s: r["full"][s] for s in range(1, EPOCHS)}
        assert r["second"] == {EPOCHS: r["full"][EPOCHS]}


def test_the_docs_example_runs(tmp_path: Path) -> None:
    exec_page("lightning.md", tmp_path)
    assert (tmp_path / "ckpts" / "last.ckpt" / "zarr.json").is_file()


def test_a_load_waits_for_another_plug_ins_async_save(tmp_path: Path) -> None:
    """A plug-in's load of a path another plug-in (a Trainer before, in the same process) is
    still saving over in the background reads the new checkpoint (before: only its own
    pending save was waited for, and a test run after fit read the previous weights)."""
    path = tmp_path / "model.ckpt"
    ZarrCheckpointIO().save_checkpoint({"w": torch.zeros(1024, 1024), "step": 1}, path)
    writer = ZarrCheckpointIO(async_save=True)
    writer.save_checkpoint({"w": torch.ones(1024, 1024), "step": 2}, path)
    got = ZarrCheckpointIO().load_checkpoint(path)
    assert got["step"] == 2 and torch.equal(got["w"], torch.ones(1024, 1024))
    writer.teardown()


@pytest.mark.parametrize("given", [{"hmac_key": b"k" * 32}, {"async_save": True}, {"chunk_bytes": 1 << 20}])
def test_the_sharded_strategies_refuse_plug_in_options_they_do_not_apply(tmp_path: Path, given: dict) -> None:
    """A signing key, an async save or save options given to the ZarrCheckpointIO plug-in of a
    sharded strategy (which writes and reads through DCP): refused at save and at load
    (before: the checkpoint was written unsigned, an unsigned one was accepted with the key,
    and an async save ran synchronously, without a word)."""
    from ucp_zarr.integrations.lightning import META, ZarrFSDPStrategy, ZarrModelParallelStrategy

    path = tmp_path / "last.ckpt"
    ZarrCheckpointIO().save_checkpoint({"global_step": 3}, path / META)
    for cls, flag in ((ZarrFSDPStrategy, ("_state_dict_type", "sharded")),
                      (ZarrModelParallelStrategy, ("_save_distributed_checkpoint", True))):
        strategy = object.__new__(cls)  # (the members the refusal uses)
        setattr(strategy, *flag)
        strategy._checkpoint_io = ZarrCheckpointIO(**given)
        strategy.broadcast = lambda obj, src=0: obj
        with pytest.raises(ucp_zarr.CheckpointError, match=f"does not apply the ZarrCheckpointIO plug-in's {next(iter(given))}"):
            strategy.save_checkpoint({"state_dict": {}, "global_step": 6}, path)
        with pytest.raises(ucp_zarr.CheckpointError, match="does not apply"):
            strategy.load_checkpoint(path)
        assert ucp_zarr.read_state_dict(path / META)["global_step"] == 3
