"""ucp_zarr inside the trainers people use (the core never imports this package).

* :mod:`ucp_zarr.integrations.lightning`: ``ZarrCheckpointIO``, a PyTorch Lightning
  ``CheckpointIO`` plug-in (``Trainer(plugins=[ZarrCheckpointIO()])``);
* :mod:`ucp_zarr.integrations.transformers`: ``ZarrCheckpointCallback``, a Hugging Face
  ``TrainerCallback`` that saves through a :class:`~ucp_zarr.CheckpointManager` and resumes.

Each module imports its framework; importing this package imports neither.
"""
