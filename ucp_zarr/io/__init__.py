"""I/O: the store protocol, one module per backend (local and fsspec in :mod:`.store`, object stores in :mod:`.obstore`), and array I/O."""
