"""Hugging Face Trainer: checkpoints through ucp_zarr, and resuming from them.

::

    from ucp_zarr.integrations.transformers import ZarrCheckpointCallback

    callback = ZarrCheckpointCallback("ckpt/run1", keep_last=3)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train(resume_from_checkpoint=callback.resume(trainer))   # None on a fresh start

**Saving.** At each of the Trainer's save steps (``save_strategy="steps"`` or ``"epoch"``)
the callback saves step ``global_step`` through a :class:`ucp_zarr.CheckpointManager` under
``root`` (retention: ``keep_last``, ``keep_every``), every rank taking part:

* ``model``, ``optimizer``, ``lr_scheduler``: their state dicts (DDP replicas are written once);
* ``rng``: each rank's Python, NumPy, torch (and CUDA) generator states (:class:`ucp_zarr.PerRank`);
* ``scaler``: the mixed-precision loss scaler's state (fp16 on a GPU), as the Trainer saves
  ``scaler.pt``, when the Trainer's accelerator has one;
* ``trainer_state``: the Trainer's ``TrainerState`` (step, epoch, log history, best metric), as JSON.

It saves in the Trainer's place: :meth:`ZarrCheckpointCallback.resume` (which every run
calls, a fresh start too) replaces that Trainer's own ``_save_checkpoint``, so the Trainer
writes no ``checkpoint-N`` folder (no pickled ``optimizer.pt``), and the
save happens exactly where the Trainer's own would: after the step's logging, every
evaluation (one per eval dataset), the ``ReduceLROnPlateau`` step and the best metric, with
the state brought up to date as the Trainer does it (``store_flos``, the stateful callbacks,
``best_model_checkpoint``, which names the manager's step; retention counts it within
``keep_last``, as the Trainer's ``save_total_limit`` does).
``save_strategy="best"`` and ``load_best_model_at_end``, which read the Trainer's own
folders, are refused; ``save_total_limit`` is the callback's ``keep_last``.

**Resuming.** :meth:`ZarrCheckpointCallback.resume` (every rank, before ``trainer.train``)
finds the newest committed step and returns a folder for ``trainer.train(resume_from_checkpoint=...)``
holding what the Trainer reads itself: ``trainer_state.json`` and the weights
(``model.safetensors``), written under ``args.output_dir`` by the process that writes the
Trainer's own checkpoints, and each process's generators as the Trainer's own checkpoint
holds them (``rng_state.pth`` from a single-process run, ``rng_state_<rank>.pth`` from each
rank of several; a process whose rank saved none writes none), removed after the first
step. The Trainer then restores its state, the weights, the data position (it skips the
batches already trained on) and the generators (where, and for which world sizes, it
restores its own: on another number of processes a rank without a file keeps its own) as
for its own checkpoints; the callback restores the optimizer, the scheduler and the loss
scaler when training begins. Only single-process and DDP training are supported (a
DeepSpeed or FSDP Trainer saves through its engine).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import random
import shutil
import weakref
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.training_args import ParallelMode

from ..protocol.distributed import Comm
from ..errors import CheckpointError, CheckpointExistsError
from ..protocol.fragments import PerRank
from ..protocol.loader import load
from ..protocol.read_state import read_state_dict
from ..protocol.reader import open_reader
from ..ops import CheckpointManager
from ..ops.steps import step_name

RESUME_FOLDER = "ucp_zarr-resume"
"""The folder under ``args.output_dir`` that :meth:`ZarrCheckpointCallback.resume` writes."""


class ZarrCheckpointCallback(TrainerCallback):
    """Save the Trainer's state through ucp_zarr at its save steps; resume from the newest.

    ``root``: the manager's root (a local path or fsspec URL, ``storage_options`` for the
    latter); ``keep_last``/``keep_every``: its retention; ``async_save``: return to training
    after the host copy, writing in the background (the next save, and the end of training,
    wait for it and raise its error).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        async_save: bool = False,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.root = os.fspath(root)
        self.async_save = async_save
        self._manager_options = {"keep_last": keep_last, "keep_every": keep_every, "storage_options": storage_options}
        self._manager: CheckpointManager | None = None
        self._restore: dict[str, Any] | None = None
        """What :meth:`resume` read for the callback to restore (its step, optimizer, scheduler, scaler)."""
        self._folder: str | None = None
        """The resume folder this process wrote (removed after the first step: every rank has read its generators)."""
        self._trainer: weakref.ref[Any] | None = None
        """The Trainer :meth:`resume` was given, whose saves this callback makes."""

    @property
    def manager(self) -> CheckpointManager:
        """The :class:`~ucp_zarr.CheckpointManager` of ``root`` (made on first use, in the
        training processes)."""
        if self._manager is None:
            self._manager = CheckpointManager(self.root, **self._manager_options)
        return self._manager

    # --- resuming ------------------------------------------------------------------------

    def resume(self, trainer: Any) -> str | None:
        """Prepare resuming ``trainer`` from the newest committed step under ``root`` and
        return the folder to pass as ``trainer.train(resume_from_checkpoint=...)``; None
        (a fresh start) when there is none. Every rank calls it, before ``trainer.train``."""
        if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
            raise CheckpointError("ZarrCheckpointCallback supports single-process and DDP training, not DeepSpeed or FSDP")
        self._attach(trainer)
        comm = Comm()
        step = self.manager.agreed_latest()  # (rank 0's, on every rank; its failure raised on every rank)
        if step is None:
            return None
        path, options = self.manager.path(step), self._manager_options["storage_options"]
        args = trainer.args
        state = read_state_dict(path, keys=["trainer_state", "optimizer", "lr_scheduler"] + (["model"] if args.should_save else []),
                                storage_options=options)
        scaler = _scaler(trainer)
        own = {"rng": rng_states()} | ({} if scaler is None else {"scaler": scaler.state_dict()})  # (filled in place)
        _, skipped = load(own, path, strict=False, return_incompatible_keys=True, storage_options=options)
        missing = set(skipped.missing_keys)
        folder = os.path.join(args.output_dir, RESUME_FOLDER, step_name(step))
        with args.main_process_first(local=args.save_on_each_node, desc="ucp_zarr resume folder"):
            if args.should_save:
                _write_resume_folder(folder, state["model"], state["trainer_state"])
                self._folder = folder
        if not {"rng.python", "rng.numpy", "rng.torch"} & missing:  # (this rank saved its generators: the file
            saved_world = open_reader(path, storage_options=options).meta.world_size  # the Trainer's own save made)
            rng = {k: v for k, v in own["rng"].items() if f"rng.{k}" not in missing}  # (CUDA's, where saved)
            _write_rng_file(folder, rng, None if saved_world == 1 else comm.rank,
                            distributed=args.parallel_mode == ParallelMode.DISTRIBUTED)
        saved_scaler = scaler is not None and not any(k.startswith("scaler.") for k in missing)
        self._restore = {"step": step, "optimizer": state["optimizer"], "lr_scheduler": state["lr_scheduler"],
                         "scaler": own["scaler"] if saved_scaler else None}
        return folder

    def _attach(self, trainer: Any) -> None:
        """Make ``trainer``'s saves (its own ``_save_checkpoint``) this callback's."""
        self._trainer = ref = weakref.ref(trainer)

        def save_checkpoint(model: Any, trial: Any) -> None:
            t = ref()
            if self._trainer is ref and self in t.callback_handler.callbacks:
                self._save(t, trial)
            else:  # (the callback was removed, or saves for another Trainer now: the Trainer's own save)
                type(t)._save_checkpoint(t, model, trial)

        trainer._save_checkpoint = save_checkpoint

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if args.save_strategy == "best" or args.load_best_model_at_end:
            raise ValueError(
                "ZarrCheckpointCallback saves at the Trainer's save steps and writes no checkpoint-N folders: "
                "use save_strategy='steps' or 'epoch', without load_best_model_at_end"
            )
        trainer = _calling_trainer(self) or (None if self._trainer is None else self._trainer())
        if trainer is None:
            raise CheckpointError("ZarrCheckpointCallback saves in its Trainer's place and cannot tell which Trainer "
                                  "runs it: call trainer.train(resume_from_checkpoint=callback.resume(trainer))")
        if self._trainer is None or self._trainer() is not trainer:  # (train() without resume(), or another Trainer's)
            self._attach(trainer)
        keep = self._manager_options["keep_last"]
        if args.save_total_limit is not None and args.save_total_limit != keep:
            raise ValueError(f"save_total_limit={args.save_total_limit} limits the Trainer's own checkpoint-N folders, which "
                             f"are not written: give ZarrCheckpointCallback(keep_last={args.save_total_limit}) instead")
        if self._restore is not None:
            if state.global_step != self._restore["step"]:
                raise CheckpointError(
                    f"resume() prepared step {self._restore['step']}, but the Trainer starts at step {state.global_step}: "
                    "pass its folder on, trainer.train(resume_from_checkpoint=callback.resume(trainer))"
                )
            kwargs["optimizer"].load_state_dict(self._restore["optimizer"])
            kwargs["lr_scheduler"].load_state_dict(self._restore["lr_scheduler"])
            scaler = _scaler(trainer)
            if scaler is not None and self._restore["scaler"] is not None:  # (where the Trainer's _load_scaler is)
                scaler.load_state_dict(self._restore["scaler"])
            self._restore = None

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._remove_folder()  # (after the step's gradient exchange: every rank has read its generators)

    def _remove_folder(self) -> None:
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            try:  # (and the folder of resume folders, once no other is in it)
                os.rmdir(os.path.dirname(self._folder))
            except OSError:
                pass
            self._folder = None

    # --- saving ---------------------------------------------------------------------------

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._remove_folder()
        self.manager.wait()
        if self._manager_options["keep_last"] == 1 and state.best_model_checkpoint is not None and Comm().rank == 0:
            # as the Trainer's own with save_total_limit=1: once training ends only the best is kept (with the steps
            # keep_every keeps); nothing is deleted unless the best is one of the steps
            steps = self.manager.steps()
            best = [s for s in steps if self.manager.path(s) == state.best_model_checkpoint]
            every = self._manager_options["keep_every"]
            for s in steps if best else ():
                if s != best[0] and not (every is not None and s % every == 0):
                    self.manager.delete(s)

    def _save(self, trainer: Any, trial: Any) -> None:
        """The Trainer's ``_save_checkpoint`` (every rank), through the manager: the state
        brought up to date as the Trainer's own does it, then saved as step ``global_step``."""
        state = trainer.state
        if trainer.hp_search_backend is None and trial is None:
            trainer.store_flos()  # (with DDP a collective, on every rank)
        kept = None
        if state.best_global_step or state.best_model_checkpoint:
            self.manager.wait(every_rank=True)  # (the best may be the step still being written: committed first)
            comm = Comm()
            named, kept = comm.broadcast(self._best(state) if comm.rank == 0 else None)
            if named is not None:
                state.best_model_checkpoint = self.manager.path(named)
        if trainer.args.should_save:
            _record_callbacks(trainer)
        checkpoint = {
            "model": trainer.model.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "lr_scheduler": trainer.lr_scheduler.state_dict(),
            "rng": rng_states(),
            "trainer_state": dataclasses.asdict(state),
        }
        scaler = _scaler(trainer)
        if scaler is not None:
            checkpoint["scaler"] = scaler.state_dict()
        try:
            self.manager.save(state.global_step, checkpoint, async_save=self.async_save,  # (the limit counts the best,
                              protect_within_limit=() if kept is None else (kept,))  # as save_total_limit does)
        except CheckpointExistsError as e:  # (its own message names save()'s overwrite, which the callback has not)
            raise CheckpointExistsError(
                f"step {state.global_step} is already saved under {self.root}: a fresh train() into a root that holds a "
                "run's steps; resume it with trainer.train(resume_from_checkpoint=callback.resume(trainer)), or give "
                "ZarrCheckpointCallback another root"
            ) from e

    def _best(self, state: TrainerState) -> tuple[int | None, int | None]:
        """As the Trainer's own save: the best step when it has a checkpoint (this save's, or a
        committed one) for ``best_model_checkpoint`` to name, and the step that names then,
        which retention keeps (a best step between saves leaves the earlier one named)."""
        held = set(self.manager.steps()) | {state.global_step}
        best = state.best_global_step if state.best_global_step in held else None
        named = best if best is not None else next(
            (s for s in sorted(held) if self.manager.path(s) == state.best_model_checkpoint), None)
        return best, named


def _scaler(trainer: Any) -> Any:
    """The Trainer's mixed-precision loss scaler (``torch.amp.GradScaler``), or None: the
    one its own ``_save_scaler`` saves."""
    return getattr(getattr(trainer, "accelerator", None), "scaler", None)


def _calling_trainer(callback: Any) -> Any:
    """The Trainer whose ``on_train_begin`` event is running ``callback`` (found among the
    calling frames: the events pass no Trainer), or None."""
    from transformers import Trainer

    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer) and callback in owner.callback_handler.callbacks:
            return owner
        frame = frame.f_back
    return None


def _record_callbacks(trainer: Any) -> None:
    """The state of every ``ExportableState`` callback (``EarlyStoppingCallback``'s patience,
    ``TrainerControl``) recorded in ``stateful_callbacks``, as the Trainer's own save records
    them; resuming restores those callbacks from there."""
    from transformers.trainer_callback import ExportableState

    for cb in [c for c in trainer.callback_handler.callbacks + [trainer.control] if isinstance(c, ExportableState)]:
        name = cb.__class__.__name__
        if isinstance(trainer.state.stateful_callbacks.get(name), list):
            trainer.state.stateful_callbacks[name].append(cb.state())
        else:
            trainer.state.stateful_callbacks[name] = cb.state()


def rng_states() -> dict[str, PerRank]:
    """This process's generator states (Python, NumPy, torch CPU, and CUDA when present),
    as the Trainer saves them, each its own per rank."""
    np_state = np.random.get_state(legacy=False)
    states = {
        "python": PerRank(random.getstate()),
        "numpy": PerRank({**np_state, "state": {**np_state["state"], "key": np_state["state"]["key"].tolist()}}),
        "torch": PerRank(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        states["cuda"] = PerRank(torch.stack(torch.cuda.get_rng_state_all()))
    return states


def _write_rng_file(folder: str, states: dict[str, Any], rank: int | None, *, distributed: bool) -> None:
    """What :func:`rng_states` returned, as the Trainer's own ``_save_rng_state`` writes it for
    its ``_load_rng_state`` (``torch.load(weights_only=True)``): ``rng_state.pth`` from a
    single-process run (``rank`` None), else ``rng_state_<rank>.pth``; CUDA's in the form the
    loading Trainer sets it (``distributed``: every device's, else the current device's)."""
    s = {k: v.value if isinstance(v, PerRank) else v for k, v in states.items()}
    out = {"python": s["python"], "numpy": s["numpy"], "cpu": s["torch"]}  # (numpy's set_state takes the dict form)
    if "cuda" in s:
        device = torch.cuda.current_device() if torch.cuda.is_available() else 0
        out["cuda"] = list(s["cuda"]) if distributed else s["cuda"][min(device, len(s["cuda"]) - 1)]
    name = "rng_state.pth" if rank is None else f"rng_state_{rank}.pth"
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}")
    torch.save(out, tmp)
    os.replace(tmp, os.path.join(folder, name))


def _write_resume_folder(folder: str, model: dict[str, torch.Tensor], trainer_state: dict[str, Any]) -> None:
    """``trainer_state.json`` and ``model.safetensors`` in ``folder`` (replacing what is
    there), written beside it and renamed into place."""
    tmp = f"{folder}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    seen: set[int] = set()
    tensors = {}
    for key, t in model.items():  # safetensors refuses tensors sharing memory (tied weights)
        tensors[key] = t.clone() if t.untyped_storage().data_ptr() in seen else t.contiguous()
        seen.add(t.untyped_storage().data_ptr())
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
        json.dump(trainer_state, f, indent=2, sort_keys=True)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
