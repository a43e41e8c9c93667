"""Examples built on ucp_zarr (outside the library core): the elastic-resume demo."""
