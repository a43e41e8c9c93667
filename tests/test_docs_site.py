"""The documentation site builds with warnings as errors (what `make docs` and CI run), and
its rules reference cannot go stale: every rule kind and field of ucp_zarr/rules/ (params.py, language.py) is
described, every JSON example is a valid rules document, and its example runs."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from _doc_blocks import DOCS, python_blocks, run_page

from ucp_zarr.rules.language import Rules
from ucp_zarr.rules.params import PRECEDENCE, ParamRule, Renumber

ROOT = DOCS.parent
REFERENCE = (DOCS / "rules-reference.md").read_text()


def test_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    env = os.environ | {"NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    site = tmp_path / "site"
    page = lambda name: (site / name / "index.html").read_text()  # noqa: E731
    assert "14. Rules: plain local tensors" in page("format")  # schema/FORMAT.md itself, included
    assert "Distributed: save on N ranks" in page("layouts")  # the README's section
    api = page("api")
    for name in ("ucp_zarr.save", "ucp_zarr.load", "ucp_zarr.CheckpointManager", "ucp_zarr.Rules",
                 "ucp_zarr.integrations.lightning.ZarrCheckpointIO", "ucp_zarr.integrations.transformers.ZarrCheckpointCallback"):
        assert f'id="{name}"' in api, name
    assert ":class:" not in api  # reST roles of the docstrings render as code


def _json_examples() -> list[dict]:
    return [json.loads(b) for b in re.findall(r"^```json\n(.*?)^```", REFERENCE, re.S | re.M)]


def test_every_rules_example_is_a_valid_rules_document() -> None:
    examples = _json_examples()
    assert len(examples) >= 12
    for doc in examples:
        rules = Rules.from_dict(doc)
        assert Rules.from_dict(rules.to_dict()) == rules


def test_the_rules_reference_describes_every_kind_and_field() -> None:
    used_kinds = {r["kind"] for doc in _json_examples() for r in doc.get("params", [])}
    assert ", ".join(f"`{k}`" for k in PRECEDENCE) in " ".join(REFERENCE.split()), "the order of precedence differs"
    for kind in PRECEDENCE:
        assert f"### `{kind}`" in REFERENCE, f"rule kind {kind!r} has no section"
        assert kind in used_kinds, f"rule kind {kind!r} has no example"
    for field in dataclasses.fields(ParamRule):
        assert re.search(rf"^\| `{field.name}` \|", REFERENCE, re.M), f"ParamRule.{field.name} is not in the fields table"
    members = set(Rules(vocab_patterns=("x",), vocab_size=1, rename=(("a", "b"),), pipeline=Renumber("(\\d)", 1),
                        pipeline_replicated=("y",), experts=Renumber("(\\d)", 1)).to_dict())
    for member in members:
        assert re.search(rf"^\| `{member}` \|", REFERENCE, re.M), f"rules member {member!r} is not in the document table"
    used_members = {m for doc in _json_examples() for m in doc}
    assert members <= used_members | {"format"} | {"default", "strict"}, members - used_members


def test_the_rules_reference_example_runs(tmp_path: Path) -> None:
    assert python_blocks("rules-reference.md")
    run_page("rules-reference.md", tmp_path)


def test_the_faq_runs(tmp_path: Path) -> None:
    """Its answers are checked: a fresh-optimizer resume, a folder from_pretrained loads,
    what strict=False reports, bf16 through xarray and dask."""
    run_page("faq.md", tmp_path)
