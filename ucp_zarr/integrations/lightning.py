"""PyTorch Lightning: Lightning's checkpoints stored as ucp_zarr checkpoints.

:class:`ZarrCheckpointIO` is a ``CheckpointIO`` plug-in. Every path Lightning saves to
(``ModelCheckpoint``'s ``epoch=0-step=100.ckpt``, ``last.ckpt``, ``trainer.save_checkpoint(path)``)
becomes a ucp_zarr checkpoint folder of that name, and ``trainer.fit(model, ckpt_path=...)``
resumes from one::

    from lightning.pytorch import Trainer
    from ucp_zarr.integrations.lightning import ZarrCheckpointIO

    trainer = Trainer(plugins=[ZarrCheckpointIO()])
    trainer = Trainer(plugins=[ZarrCheckpointIO(async_save=True)])   # saves in the background

**What is stored**: the whole dict Lightning builds (``state_dict``, ``optimizer_states``,
``lr_schedulers``, ``loops``, ``callbacks``, hyper-parameters, ...): tensors as Zarr arrays,
everything else as JSON (integer keys, tuples, non-finite floats and bytes come back as they
were). Nothing is pickled: a value that is neither a tensor nor JSON-able (a module or a
function among the hyper-parameters, say) is refused at save time, naming its key.
:meth:`~ZarrCheckpointIO.load_checkpoint` gives the dict back as it was saved
(:func:`ucp_zarr.read_state_dict`).

**Strategies**: Lightning calls the plug-in with the whole state on global rank 0 only
(single device, DDP), so rank 0 saves alone, through a process group of its own; every rank
loads. Strategies that shard the state (FSDP, ModelParallel) write their sharded checkpoints
with torch DCP themselves, never through ``CheckpointIO``: use :class:`ZarrFSDPStrategy` or
:class:`ZarrModelParallelStrategy` instead of Lightning's, and every rank writes its shards
through DCP with :class:`ucp_zarr.ZarrStorageWriter` (a ucp_zarr checkpoint, which loads at
any other layout), Lightning's other state going into the checkpoint :data:`META` inside it::

    trainer = Trainer(strategy=ZarrFSDPStrategy(), ...)
    trainer = Trainer(strategy=ZarrModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), ...)

**Async**: ``ZarrCheckpointIO(async_save=True)`` returns to training once the state is copied
to host memory and writes in the background (:func:`ucp_zarr.save` with ``async_save``); the
next save, a removal, a load and the end of training wait for it and raise its error, so
``ModelCheckpoint(save_top_k=...)`` removes exactly the checkpoints it means to. Lightning's
own ``AsyncCheckpointIO(ZarrCheckpointIO())`` also works (it copies the tensors and runs the
saves on a thread; a removal waits for the save in progress), but a save still waiting in its
queue when ``ModelCheckpoint`` removes that path is written afterwards and stays, as with
Lightning's ``TorchCheckpointIO``.

``LightningModule.load_from_checkpoint`` reads ``torch.save`` files only; take a checkpoint's
weights from ``ZarrCheckpointIO().load_checkpoint(path)["state_dict"]``.
"""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import threading
from concurrent.futures import Future
from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from ..protocol.distributed import Comm
from ..protocol.saving import async_save, save, wait_for_pending_save
from ..protocol.read_state import read_state_dict
from ..errors import CheckpointError, NotJSONableError
from ..ops.steps import delete_step, is_committed
from ..io.factory import open_store

log = logging.getLogger(__name__)

_SET_HERE = {"state_dict", "path", "process_group", "storage_options", "hmac_key", "overwrite", "async_save", "async_group"}
SAVE_OPTIONS = frozenset(inspect.signature(save).parameters) - _SET_HERE
"""The options of :func:`ucp_zarr.save` that :class:`ZarrCheckpointIO` passes on."""


NO_PICKLES = ("ucp_zarr stores no pickles: keep it out of Lightning's checkpoint "
              "(self.save_hyperparameters(ignore=[...]), or drop it in on_save_checkpoint)")
"""What to do about a value of Lightning's checkpoint that ucp_zarr refuses."""


class ZarrCheckpointIO(CheckpointIO):
    """Save, load and remove Lightning checkpoints as ucp_zarr checkpoints.

    ``async_save``: write in the background after the host copy (one save in flight).
    ``storage_options``: for fsspec URLs (``s3://...`` checkpoint paths). ``hmac_key``: sign
    every checkpoint, and refuse to load one that is unsigned or changed. ``save_options``
    go to :func:`ucp_zarr.save` (``chunk_bytes``, ``shard_bytes``, ``max_workers``, ...).
    Saving to an existing checkpoint replaces it crash-safely (``last.ckpt``).
    """

    def __init__(
        self,
        *,
        async_save: bool = False,
        storage_options: dict[str, Any] | None = None,
        hmac_key: bytes | None = None,
        **save_options: Any,
    ) -> None:
        unknown = sorted(set(save_options) - SAVE_OPTIONS)
        if unknown:
            raise TypeError(f"ZarrCheckpointIO got unknown save options {unknown} (it takes {sorted(SAVE_OPTIONS)})")
        self.async_save = async_save
        self.storage_options = storage_options
        self.hmac_key = hmac_key
        self.save_options = save_options
        self._lock = threading.Lock()
        """Held while a save runs (on AsyncCheckpointIO's thread), so that removing or loading waits for it."""
        self._pending: Future | None = None
        """The background save in flight (``async_save``)."""
        self._own: tuple[Any, Any] | None = None
        """(the default group it was made in, a process group of this rank alone)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any | None = None) -> None:
        """Save Lightning's ``checkpoint`` dict as the ucp_zarr checkpoint ``path``. A symbolic
        link there (``last.ckpt`` of ``ModelCheckpoint(save_last="link")``, which a resumed run
        saves over) is replaced, not what it names, as Lightning's own ``TorchCheckpointIO``
        replaces it: the top-k checkpoint behind it keeps its state."""
        if storage_options is not None:
            raise TypeError(
                f"ZarrCheckpointIO takes storage_options when created (ZarrCheckpointIO(storage_options=...)), "
                f"not per save (got {storage_options!r} for {os.fspath(path)!r})"
            )
        with self._lock:
            self._wait()
            if os.path.islink(path):
                os.unlink(path)
            try:
                out = (async_save if self.async_save else save)(
                    checkpoint, path, overwrite=True, process_group=self._group(), storage_options=self.storage_options,
                    hmac_key=self.hmac_key, **self.save_options)
            except NotJSONableError as e:
                raise NotJSONableError(f"{e}. {NO_PICKLES}") from e
            if self.async_save:
                self._pending = out

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint dict saved at ``path``, its tensors on ``map_location`` (a device or
        its name; default CPU). ``weights_only`` changes nothing: nothing is ever unpickled."""
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise TypeError(f"ZarrCheckpointIO.load_checkpoint: map_location must be a device or its name, not {map_location!r}")
        with self._lock:
            self._wait()
            wait_for_pending_save()  # (another plug-in's, or a Trainer's before: it may be writing this path)
            return read_state_dict(path, device=map_location or "cpu", storage_options=self.storage_options, hmac_key=self.hmac_key)

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> bool:
        """Delete the checkpoint ``path`` crash-safely (nothing when there is none); a
        checkpoint being read is kept, with a warning (False). A symbolic link (``last.ckpt`` of
        ``ModelCheckpoint(save_last="link")``) is removed itself, not what it names, as
        Lightning's own ``TorchCheckpointIO`` removes it."""
        with self._lock:
            self._wait()
            if os.path.islink(path):
                os.unlink(path)
                return True
            store = open_store(path, self.storage_options)
            if store.is_empty():
                return True
            if not is_committed(store):
                raise CheckpointError(f"{os.fspath(path)!r} holds no committed ucp_zarr checkpoint: not removing it")
            if not delete_step(store):
                log.warning("ucp_zarr: not removing %s: it is being read, deleted or replaced", os.fspath(path))
                return False
            return True

    def teardown(self) -> None:
        """Wait for the background save (Lightning calls this at the end of ``fit``); raise its error."""
        with self._lock:
            self._wait()

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _group(self) -> Any:
        """A process group of this rank alone when torch.distributed runs (None otherwise):
        Lightning saves on global rank 0 only."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        default = dist.group.WORLD
        if self._own is None or self._own[0] is not default:
            self._own = (default, dist.new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True))
        return self._own[1]


# --- sharded strategies ---------------------------------------------------------------------

META = "lightning_meta"
"""The checkpoint inside a sharded strategy's checkpoint that holds Lightning's other state (its ``meta.pt``)."""


LIGHTNING_FILES = (".metadata", "meta.pt")
"""What marks a folder as Lightning's own sharded checkpoint (DCP's metadata, Lightning's
``meta.pt``), beside its ``__<rank>_<n>.distcp`` shards."""


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a sharded strategy's ucp_zarr checkpoint (:data:`META` inside).
    Raises :class:`~ucp_zarr.CheckpointError` where Lightning's own checkpoint is there too
    (one of them is stale, and which cannot be told)."""
    if not (os.path.isdir(path) and os.path.isdir(os.path.join(path, META))):
        return False
    theirs = [n for n in LIGHTNING_FILES if os.path.exists(os.path.join(path, n))]
    if theirs:
        raise CheckpointError(f"{os.fspath(path)!r} holds a ucp_zarr checkpoint ({META}) and Lightning's own ({theirs}): "
                              "one was saved over the other by a strategy that does not write its format; remove the "
                              "stale one")
    return True


def _sharded_or_refused(path: str) -> bool:
    """:func:`is_sharded_checkpoint`, refusing (with what happened) the shards a sharded save
    committed before it was cut short: its :data:`META`, written last, is missing, and
    Lightning's own loader would only say that the folder is no checkpoint."""
    if is_sharded_checkpoint(path):
        return True
    if os.path.isdir(path) and not _lightning_files(path) and is_committed(open_store(path)):
        from ..protocol.reader import open_reader

        if "dcp" in open_reader(path).meta.layout:
            raise CheckpointError(f"{path!r} holds the shards of a sharded strategy's save that did not finish: its "
                                  f"{META}, written last, is missing; resume from another checkpoint (an earlier "
                                  "save of this run), or remove this one")
    return False


def _lightning_files(path: str) -> list[str]:
    """The files of Lightning's own sharded checkpoint in the folder ``path``."""
    if not os.path.isdir(path):
        return []
    return [n for n in os.listdir(path) if n in LIGHTNING_FILES or n.startswith("__") and n.endswith(".distcp")]


class _ZarrSharded:
    """What :class:`ZarrFSDPStrategy` and :class:`ZarrModelParallelStrategy` share: the save,
    the other state's read and the removal of a checkpoint (mixed in before the strategy)."""

    _MODEL_KEY: str
    """Lightning's key of the model state in its distributed checkpoints."""

    def _sharded(self) -> bool:
        raise NotImplementedError

    def _check_plugin(self) -> None:
        """Refuse what a ``ZarrCheckpointIO`` plug-in was given that the sharded path (DCP with
        :class:`~ucp_zarr.ZarrStorageWriter` and its reader, on a local folder) does not apply:
        a signing key would leave the checkpoint unsigned and accept an unsigned one, an async
        save would be a synchronous one."""
        io = getattr(self, "checkpoint_io", None)
        if not isinstance(io, ZarrCheckpointIO):
            return
        given = [n for n, v in (("hmac_key", io.hmac_key), ("async_save", io.async_save),
                                ("storage_options", io.storage_options)) if v] + sorted(io.save_options)
        if given:
            raise CheckpointError(f"{type(self).__name__} writes and reads its sharded checkpoints through DCP, which "
                                  f"does not apply the ZarrCheckpointIO plug-in's {', '.join(given)}: give the plug-in "
                                  "none of them")

    def _meta_io(self) -> ZarrCheckpointIO:
        if getattr(self, "_zarr_meta_io", None) is None:
            self._zarr_meta_io = ZarrCheckpointIO()
        return self._zarr_meta_io

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank: its shards of the model and optimizers through DCP with
        :class:`~ucp_zarr.ZarrStorageWriter`; then rank 0: Lightning's other state as the
        checkpoint :data:`META` inside, which marks the checkpoint complete (as Lightning's
        ``meta.pt`` does; an earlier one is removed first, so a crash between the two leaves no
        complete-looking mix). A file or symbolic link at ``filepath`` is replaced."""
        import torch.distributed.checkpoint as dcp

        from ..adapters.dcp import ZarrStorageWriter

        if not self._sharded():
            return super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options (got {storage_options!r})")
        self._check_plugin()
        path = os.fspath(self.broadcast(filepath))  # type: ignore[attr-defined]
        self._on_rank_0(lambda: self._prepare(path, checkpoint), f"preparing the save of {path}")
        state = {self._MODEL_KEY: checkpoint.pop("state_dict")}
        state |= {f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))}
        dcp.save(state, storage_writer=ZarrStorageWriter(path))
        self._on_rank_0(lambda: self._meta_io().save_checkpoint(checkpoint, os.path.join(path, META)),
                        f"saving {path}'s {META}")

    def _on_rank_0(self, fn: Callable[[], Any], what: str) -> None:
        """``fn()`` on rank 0, the outcome agreed on every rank (rank 0 raises its own error,
        the others one naming it: none is left waiting for rank 0)."""
        error: BaseException | None = None
        if self.global_rank == 0:  # type: ignore[attr-defined]
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - every rank must learn of it
                error = e
        Comm().agree(error, what, own=True)

    def _prepare(self, path: str, checkpoint: dict[str, Any]) -> None:
        """Rank 0, before a save: ``path`` made ready for it, or refused before anything there
        changes. Lightning's other state must be storable (checked first); a file or
        symbolic link there (a ``save_last="link"`` link, a ``.ckpt`` file) is removed, as are
        the files of Lightning's own checkpoint there (it would be read instead) and this
        format's :data:`META` (which a crash must not leave beside new shards)."""
        from ..format.statedict import iter_leaves, to_json

        others = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        try:
            for leaf in iter_leaves(others):
                if not isinstance(leaf.value, torch.Tensor):
                    to_json(leaf.value, leaf.key)
        except NotJSONableError as e:
            raise NotJSONableError(f"{e}. {NO_PICKLES}") from e
        if os.path.islink(path) or os.path.isfile(path):
            os.unlink(path)
            return
        for name in _lightning_files(path):
            os.unlink(os.path.join(path, name))
        if os.path.isdir(os.path.join(path, META)) and not self._meta_io().remove_checkpoint(os.path.join(path, META)):
            raise CheckpointError(f"not saving {path!r}: its {META} is being read")

    def remove_checkpoint(self, filepath: Any) -> None:
        """Rank 0: :data:`META` first (the completeness mark), then the checkpoint crash-safely,
        then the folders left empty; a checkpoint being read is kept (with a warning).
        Anything else as the strategy removes it."""
        path = os.fspath(filepath)
        if not (self.is_global_zero and not os.path.islink(path) and is_sharded_checkpoint(path)):  # type: ignore[attr-defined]
            return super().remove_checkpoint(filepath)  # type: ignore[misc]
        if self._meta_io().remove_checkpoint(os.path.join(path, META)) and self._meta_io().remove_checkpoint(path):
            shutil.rmtree(path, ignore_errors=True)


class ZarrFSDPStrategy(_ZarrSharded, FSDPStrategy):
    """Lightning's ``FSDPStrategy`` whose sharded checkpoints (``state_dict_type="sharded"``,
    the default here) are ucp_zarr checkpoints: ``Trainer(strategy=ZarrFSDPStrategy(...))``.
    Resumes (``ckpt_path=``) from them and from Lightning's own checkpoints."""

    _MODEL_KEY = "model"

    def __init__(self, *args: Any, state_dict_type: str = "sharded", **kwargs: Any) -> None:
        super().__init__(*args, state_dict_type=state_dict_type, **kwargs)

    def _sharded(self) -> bool:
        return self._state_dict_type == "sharded"

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """As ``FSDPStrategy.load_checkpoint`` loads a sharded checkpoint, with
        :class:`~ucp_zarr.ZarrStorageReader` in place of DCP's reader."""
        import torch.distributed.checkpoint as dcp
        from lightning.fabric.strategies.fsdp import _get_sharded_state_dict_context
        from lightning.pytorch.trainer.states import TrainerFn
        from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        from ..adapters.dcp import ZarrStorageReader

        path = os.fspath(self.broadcast(checkpoint_path))
        if not _sharded_or_refused(path):
            return super().load_checkpoint(checkpoint_path, weights_only)
        self._check_plugin()
        with _get_sharded_state_dict_context(self.model):
            module_state = {"model": self.model.state_dict()}
            dcp.load(module_state, storage_reader=ZarrStorageReader(path))
            self.model.load_state_dict(module_state["model"], strict=self.lightning_module.strict_loading)
            if self.lightning_module.trainer.state.fn == TrainerFn.FITTING and self.optimizers:
                for i, optimizer in enumerate(self.optimizers):
                    key = f"optimizer_{i}"
                    state = load_sharded_optimizer_state_dict(model_state_dict=module_state["model"], optimizer_key=key,
                                                              storage_reader=ZarrStorageReader(path))
                    optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model=self.model, optim=optimizer,
                                                                            optim_state_dict=state[key]))
        return self._meta_io().load_checkpoint(os.path.join(path, META))


class ZarrModelParallelStrategy(_ZarrSharded, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallelism) whose distributed
    checkpoints (``save_distributed_checkpoint=True``, the default) are ucp_zarr checkpoints:
    ``Trainer(strategy=ZarrModelParallelStrategy(data_parallel_size=..., tensor_parallel_size=...))``."""

    _MODEL_KEY = "state_dict"

    def _sharded(self) -> bool:
        return self._save_distributed_checkpoint

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """As Lightning's ``ModelParallelStrategy`` loads a distributed checkpoint
        (``lightning.fabric.strategies.model_parallel._load_checkpoint``), with
        :class:`~ucp_zarr.ZarrStorageReader` in place of DCP's reader."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        from ..adapters.dcp import ZarrStorageReader

        path = os.fspath(self.broadcast(checkpoint_path))
        if not _sharded_or_refused(path):
            return super().load_checkpoint(checkpoint_path, weights_only)
        self._check_plugin()
        module_state = {"state_dict": get_model_state_dict(self.model)}
        dcp.load(module_state, storage_reader=ZarrStorageReader(path))
        self.model.load_state_dict(module_state["state_dict"], strict=self.lightning_module.strict_loading)
        for i, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{i}"
            state = {key: get_optimizer_state_dict(self.model, optimizer)}
            dcp.load(state, storage_reader=ZarrStorageReader(path))
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state[key],
                                     options=StateDictOptions(cpu_offload=True))
        return self._meta_io().load_checkpoint(os.path.join(path, META))
