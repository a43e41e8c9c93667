"""The universal checkpoint language: :class:`~ucp_zarr.Rules`, their schema checks and :func:`~ucp_zarr.place`."""
