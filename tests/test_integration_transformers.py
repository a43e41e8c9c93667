"""The Hugging Face Trainer saves through ZarrCheckpointCallback (no checkpoint-N folders, the
manager's retention) and resumes from the newest step with the losses of an uninterrupted
run: mid-epoch (the Trainer skips the batches already seen) and at an epoch boundary, on one
process and on two (DDP, gloo, torchrun). GPT-2 with dropout, so the generators must be
restored where the Trainer restores its own. A step's Hugging Face export loads with
from_pretrained."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import _transformers_job as job
import pytest
import torch
from _dist import free_port
from _doc_blocks import exec_page
from _jobs import run_job
from transformers import GPT2LMHeadModel

import ucp_zarr

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    return job.uninterrupted(tmp_path_factory.mktemp("full"))


@pytest.mark.parametrize("save_steps, stop_at", [(3, 5), (1, 4)], ids=["mid-epoch", "epoch-boundary"])
def test_resume_gives_the_losses_of_the_uninterrupted_run(tmp_path: Path, full: dict[int, float], save_steps: int, stop_at: int) -> None:
    first, second, kept = job.interrupted_and_resumed(tmp_path, save_steps=save_steps, stop_at=stop_at)
    assert kept == list(range(save_steps, stop_at + 1, save_steps))[-2:]  # keep_last=2
    assert not list((tmp_path / "out1").glob("checkpoint-*"))  # the Trainer wrote no folder of its own
    assert first == {s: full[s] for s in range(1, stop_at + 1)}
    # the log history restored up to the step resumed from, then the resumed steps' losses, bit for bit
    assert second == full
    assert not (tmp_path / "out2" / "ucp_zarr-resume").exists()  # removed once training started (its folder too)


def test_two_process_ddp_resume_gives_the_losses_of_the_uninterrupted_run(tmp_path: Path) -> None:
    run_job([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
             str(HERE / "_transformers_job.py"), str(tmp_path)], tmp_path)
    for rank in range(2):
        r = json.loads((tmp_path / f"losses_{rank}.json").read_text())
        full = {int(s): v for s, v in r["full"].items()}
        assert r["kept"] == [3] and len(full) == job.STEPS
        assert {int(s): v for s, v in r["first"].items()} == {s: full[s] for s in range(1, 6)}
        assert {int(s): v for s, v in r["second"].items()} == full


def test_the_hugging_face_export_of_a_step_loads_with_from_pretrained(tmp_path: Path) -> None:
    trainer, callback = job.make_trainer(tmp_path / "ckpt", tmp_path / "out", seed=0, save_steps=2, stop_at=2)
    trainer.train()
    trainer.model.config.save_pretrained(tmp_path / "hf")  # (an export keeps the files already there)
    ucp_zarr.export(callback.manager.path(2), tmp_path / "hf", to="hf")
    loaded, info = GPT2LMHeadModel.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    trained = trainer.model.state_dict()  # (the model at step 2: training stopped there)
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())


def test_the_docs_example_runs(tmp_path: Path) -> None:
    page = exec_page("transformers.md", tmp_path)
    assert page["callback"].manager.steps() == [6, 8]


def test_a_save_records_the_trainer_state_as_the_trainers_own_save_does(tmp_path: Path) -> None:
    """At a save step where no log is due, the saved ``TrainerState`` holds the state of every
    ``ExportableState`` callback, as the Trainer's own ``_save_checkpoint`` records it, so a
    resume restores it: a stateful callback resumes at its saved count. Before: callbacks
    resumed from their state at the start of training."""
    from transformers import GPT2Config, Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import ExportableState

    from ucp_zarr.integrations.transformers import ZarrCheckpointCallback

    class Count(TrainerCallback, ExportableState):
        def __init__(self, count: int = 0) -> None:
            self.count = count

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.count += 1

        def state(self) -> dict[str, Any]:
            return {"args": {"count": self.count}, "attributes": {}}

    def run(name: str, stop_at: int | None, ours: bool = True) -> tuple[Trainer, Count]:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8,
                                           bos_token_id=0, eos_token_id=0))
        data = [{"input_ids": t, "labels": t} for t in torch.randint(0, 32, (16, 8), generator=torch.Generator().manual_seed(1))]
        args = TrainingArguments(str(tmp_path / f"out_{name}"), max_steps=6, per_device_train_batch_size=4, save_steps=2,
                                 logging_steps=3, report_to=[], use_cpu=True, disable_tqdm=True,
                                 restore_callback_states_from_checkpoint=True)
        count, zarr = Count(), ZarrCheckpointCallback(tmp_path / name / "ckpt")
        callbacks = ([zarr] if ours else []) + [count] + ([job.StopAt(stop_at)] if stop_at else [])
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
        trainer.train(resume_from_checkpoint=zarr.resume(trainer) if ours else None)
        return trainer, next(c for c in trainer.callback_handler.callbacks if isinstance(c, Count))  # (restored: another)

    run("cut", 4)
    saved = ucp_zarr.read_state_dict(tmp_path / "cut" / "ckpt" / "step_00000004", keys=["trainer_state"])["trainer_state"]
    assert saved["stateful_callbacks"]["Count"]["args"]["count"] == 4
    run("own", 4, ours=False)  # the Trainer's own save of step 4: total_flos up to step 4 (the last log was at 3)
    own = json.loads((tmp_path / "out_own" / "checkpoint-4" / "trainer_state.json").read_text())
    assert saved["total_flos"] == own["total_flos"] > 0
    _, count = run("cut", None)
    assert count.count == 6  # (4 restored, then steps 5 and 6)


RESUMES = {
    # the Trainer steps ReduceLROnPlateau after the evaluation's callbacks (lr halves at step 4)
    "plateau": (dict(max_steps=8, save_steps=4, eval_strategy="steps", eval_steps=2, metric_for_best_model="score",
                     greater_is_better=False, lr_scheduler_type="reduce_lr_on_plateau",
                     lr_scheduler_kwargs={"patience": 0, "factor": 0.5}), 4, {2: 4.0, 4: 5.0, 6: 5.0, 8: 5.0}, False),
    # a dict of eval datasets: one on_evaluate each, the save after both
    "two eval datasets": (dict(max_steps=8, save_steps=4, eval_strategy="steps", eval_steps=4), 4, None, True),
    # the best metric is decided after the evaluation's callbacks; early stopping resumes from it
    "best metric": (dict(max_steps=8, save_steps=2, eval_strategy="steps", eval_steps=1, metric_for_best_model="score",
                         greater_is_better=False, restore_callback_states_from_checkpoint=True), 2,
                    {1: 4.0, 2: 5.0, 3: 4.5, 4: 4.5, 5: 4.5, 6: 4.5}, False),  # (a patience count of 1 at the cut)
    # the best step between saves: the earlier one stays named and kept
    "best between saves": (dict(max_steps=8, save_steps=2, eval_strategy="steps", eval_steps=1, metric_for_best_model="score",
                                greater_is_better=False), 4, {1: 5.0, 2: 4.0, 3: 3.0, 4: 4.5, 5: 4.5, 6: 4.5}, False),
    # no batch skipped: the Trainer restores its generators at the start of the epoch
    "ignore_data_skip": (dict(max_steps=10, save_steps=4, ignore_data_skip=True), 4, None, False),
}


@pytest.mark.parametrize("case", list(RESUMES))
def test_a_resume_is_the_trainers_own_resume(tmp_path: Path, case: str) -> None:
    """Resumes where the Trainer does more after an evaluation's callbacks than before (the
    plateau scheduler's step, the second eval dataset, the best metric and early stopping) or
    restores its generators early (``ignore_data_skip``): losses, learning rates, weights,
    optimizer, scheduler, generators and where training stops are those of the Trainer's own
    resume from its checkpoint. Before, the callback saved inside on_evaluate/on_log: the
    lr after resume was 0.01, not 0.005; the log lacked the second evaluation and dropout
    differed; the best metric was stale and early stopping ended at step 5, not 4; with
    ignore_data_skip the generators were restored after the DataLoader drew its seed."""
    from transformers import EarlyStoppingCallback

    import _hf_resume as H

    args, at, scores, two = RESUMES[case]
    extra = (lambda: [EarlyStoppingCallback(early_stopping_patience=2)]) if case == "best metric" else list
    runs = H.three_runs(tmp_path, args, at, extra=extra, scores=scores,
                        eval_data={"a": H.data(8, 5), "b": H.data(6, 9)} if two else None)
    own, ours = runs["own"], runs["ours"]
    assert {k for k in own if not H.same(own[k], ours[k])} == set(), (own["stop"], ours["stop"], own["lr"], ours["lr"])


def test_a_resume_restores_the_loss_scaler(tmp_path: Path) -> None:
    """fp16's loss scaler (the Trainer saves ``scaler.pt``): a resume continues with the saved
    scale, so the same steps are skipped for overflow as in the Trainer's own resume (before,
    the scale restarted at its initial value: other skipped steps, other losses)."""
    import _hf_resume as H

    runs = H.three_runs(tmp_path, dict(max_steps=10, save_steps=4, max_grad_norm=0), 4, scaler=True)
    full, own, ours = runs["full"], runs["own"], runs["ours"]
    assert full["scaler"]["scale"] < 2.0**(112 + 10)  # (it overflowed and backed off)
    assert (tmp_path / "full" / "checkpoint-4" / "scaler.pt").is_file()
    assert {k for k in own if not H.same(own[k], ours[k])} == set(), (own["losses"], ours["losses"], own["scaler"], ours["scaler"])


def test_a_resume_on_another_number_of_processes_is_the_trainers_own(tmp_path: Path) -> None:
    """Saved at step 4 on 2 DDP processes (mid-epoch), resumed on 3 (step 4 ends an epoch
    there) and on 1: losses, learning rates, weights, optimizer and every generator after
    training are those of the Trainer's own resume from its checkpoint-4 on as many
    processes. The Trainer restores a rank's generators only from the file its own save
    wrote for that rank and world size (rng_state_<rank>.pth, or rng_state.pth of a single
    process), where it decides; before, the callback restored them itself: a new rank 2 was
    rewound to its state at resume(), the point was taken from the saved epoch (mid-epoch on
    2, an epoch's end on 3), and one process took rank 0's, where the Trainer takes none."""
    import shutil

    import _hf_resume as H

    def launch(world: int, mode: str) -> None:
        runner = ["-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port", str(free_port())]
        run_job([sys.executable, *(runner if world > 1 else []), str(HERE / "_hf_resume.py"), mode, str(tmp_path), "4"],
                tmp_path)

    launch(2, "save")
    for world in (3, 1):
        shutil.copytree(tmp_path / "ckpt", tmp_path / f"ckpt_{world}")
        launch(world, "resume")
        for rank in range(world):
            got = torch.load(tmp_path / f"outcome_{world}_{rank}.pt", weights_only=True)
            own, ours = got["own"], got["ours"]
            assert {k for k in own if not H.same(own[k], ours[k])} == set(), (world, rank, own["losses"], ours["losses"])


def test_a_resume_from_an_object_store_is_the_trainers_own(tmp_path: Path, seaweed: object) -> None:
    """Steps saved to S3 (a real server on loopback) with the callback's storage_options:
    the resume reads them with those options too (before: without, and failed to reach the
    store) and continues as the Trainer's own resume does."""
    import uuid

    import _hf_resume as H
    from ucp_zarr.integrations.transformers import ZarrCheckpointCallback

    url, options = f"s3://objstore/hf-{uuid.uuid4().hex}", seaweed.storage_options()  # type: ignore[attr-defined]
    runs = H.three_runs(tmp_path, dict(max_steps=8, save_steps=4), 4,
                        zarr=lambda: ZarrCheckpointCallback(url, storage_options=options))
    own, ours = runs["own"], runs["ours"]
    assert {k for k in own if not H.same(own[k], ours[k])} == set(), (own["losses"], ours["losses"])


def _own_steps(out: Path) -> list[int]:
    """The steps of the Trainer's own checkpoint-N folders under ``out``."""
    return sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_the_best_step_is_named_and_kept_by_retention(tmp_path: Path, limit: int) -> None:
    """metric_for_best_model without load_best_model_at_end: the state names the best step's
    checkpoint (the Trainer names its checkpoint-N) and retention keeps the steps the Trainer's
    own rotation keeps with save_total_limit = keep_last (run beside it: the best counts
    within the limit, the newest always kept). Before: best_model_checkpoint stayed None and
    keep_last=2 deleted step 2, the best; then the best was kept beside keep_last steps (3
    for a limit of 2). save_total_limit, which applies to the Trainer's own folders, is
    refused unless it is the callback's keep_last."""
    import _hf_resume as H

    from ucp_zarr.integrations.transformers import ZarrCheckpointCallback

    args = dict(max_steps=8, save_steps=2, eval_strategy="steps", eval_steps=2, metric_for_best_model="score",
                greater_is_better=False)
    for name, extra, scores in [("first", {}, {2: 1.0, 4: 2.0, 6: 3.0, 8: 4.0}),
                                # the best evaluation between saves (step 3): step 2 stays named, as the Trainer's
                                # own keeps checkpoint-2, and kept (before: step 3 was protected, step 2 deleted)
                                ("between", {"eval_steps": 1}, {2: 4.0, 3: 1.0, 4: 5.0, 6: 5.0, 8: 5.0}),
                                ("newest", {}, {2: 4.0, 4: 3.0, 6: 2.0, 8: 1.0})]:
        own = H.trainer(tmp_path / f"own-{name}", args | extra | {"save_total_limit": limit}, seed=0, callbacks=[],
                        scores=scores)
        own.train()
        callback = ZarrCheckpointCallback(tmp_path / name, keep_last=limit)
        t = H.trainer(tmp_path / f"out-{name}", args | extra, seed=0, callbacks=[callback], scores=scores)
        t.train(resume_from_checkpoint=callback.resume(t))
        assert callback.manager.steps() == _own_steps(tmp_path / f"own-{name}"), name
        best = int(own.state.best_model_checkpoint.rsplit("-", 1)[1])
        assert t.state.best_model_checkpoint == callback.manager.path(best), name
    if limit != 2:
        return
    # a Trainer whose callback was removed saves its own checkpoint-N again
    kept = callback.manager.steps()
    t.remove_callback(ZarrCheckpointCallback)
    t.args.output_dir = str(tmp_path / "own")
    t.train()
    assert (tmp_path / "own" / "checkpoint-8").is_dir() and callback.manager.steps() == kept
    other = ZarrCheckpointCallback(tmp_path / "ckpt2", keep_last=2)
    t = H.trainer(tmp_path / "out2", args | {"save_total_limit": 3}, seed=0, callbacks=[other], scores={})
    with pytest.raises(ValueError, match=r"give ZarrCheckpointCallback\(keep_last=3\)"):
        t.train(resume_from_checkpoint=other.resume(t))



def test_the_best_step_of_async_saves_and_keep_every_survive_the_end_of_training(tmp_path: Path) -> None:
    """keep_last=1 with async saves: the best step (still being written when the next save
    named it) was not protected, and the end of training, deleting every step but the best
    as the Trainer does at save_total_limit=1, then deleted every step; with keep_every, the
    steps it keeps were deleted at the end. Now: the steps of the Trainer's own run, and the
    keep_every steps beside the best."""
    import _hf_resume as H

    from ucp_zarr.integrations.transformers import ZarrCheckpointCallback

    args = dict(max_steps=10, save_steps=2, eval_strategy="steps", eval_steps=1, metric_for_best_model="score",
                greater_is_better=False)
    scores = {2: 5.0, 3: 1.0, 4: 6.0, 5: 7.0, 6: 0.5, 7: 9.0, 8: 9.0, 10: 9.0}  # (the best: step 6, a save step)
    own = H.trainer(tmp_path / "own", args | {"save_total_limit": 1}, seed=0, callbacks=[], scores=scores)
    own.train()
    callback = ZarrCheckpointCallback(tmp_path / "async", keep_last=1, async_save=True)
    t = H.trainer(tmp_path / "out", args, seed=0, callbacks=[callback], scores=scores)
    t.train(resume_from_checkpoint=callback.resume(t))
    assert callback.manager.steps() == _own_steps(tmp_path / "own") == [6]
    every = ZarrCheckpointCallback(tmp_path / "every", keep_last=1, keep_every=4)
    t = H.trainer(tmp_path / "out2", args | {"max_steps": 8, "eval_steps": 2}, seed=0, callbacks=[every],
                  scores={2: 1.0, 4: 2.0, 6: 3.0, 8: 4.0})
    t.train(resume_from_checkpoint=every.resume(t))
    assert every.manager.steps() == [2, 4, 8]


def test_retention_within_the_limit_keeps_what_the_trainers_rotation_keeps(tmp_path: Path) -> None:
    """``steps_to_delete(..., within_limit=(best,))`` against transformers' own
    ``rotate_checkpoints`` on folders named like the Trainer's, over random runs: the same
    steps survive (the best counted within the limit, the newest always kept)."""
    import random

    from transformers.trainer_utils import rotate_checkpoints

    from ucp_zarr.ops.retention import steps_to_delete

    rng = random.Random(0)
    for case in range(300):
        steps = sorted(rng.sample(range(1, 60), rng.randint(1, 8)))
        limit, best = rng.randint(1, 5), rng.choice(steps + [None])
        out = tmp_path / str(case)
        for s in steps:
            (out / f"checkpoint-{s}").mkdir(parents=True)
        rotate_checkpoints(str(out), limit, None if best is None else str(out / f"checkpoint-{best}"))
        theirs = sorted(int(p.name.split("-")[1]) for p in out.iterdir())
        gone = steps_to_delete(steps, keep_last=limit, within_limit=() if best is None else (best,))
        assert sorted(set(steps) - set(gone)) == theirs, (steps, limit, best)


def test_a_fresh_train_into_a_run_names_the_callbacks_way_out(tmp_path: Path) -> None:
    """A second fresh train() into a root holding the run's steps is refused (a step is never
    saved over); the error named save()'s overwrite=True, which the callback does not take.
    Now it names resume() and another root."""
    import _hf_resume as H

    from ucp_zarr.integrations.transformers import ZarrCheckpointCallback

    args = dict(max_steps=2, save_steps=2)
    first = ZarrCheckpointCallback(tmp_path / "ckpt")
    H.trainer(tmp_path / "out", args, seed=0, callbacks=[first]).train()
    again = ZarrCheckpointCallback(tmp_path / "ckpt")
    with pytest.raises(ucp_zarr.CheckpointExistsError, match=r"step 2 is already saved under .*callback\.resume\(trainer\)"
                                                             r".*another root") as e:
        H.trainer(tmp_path / "out2", args, seed=0, callbacks=[again]).train()
    assert "overwrite" not in str(e.value)
