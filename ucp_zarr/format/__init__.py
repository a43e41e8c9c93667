"""The format (pure, no I/O): the metadata documents, the stored codec, digests and signatures, dtypes, state-dict keys and safe paths."""
