"""The array document check (``ArrayMeta.from_zarr_json``): pure Python, strict to the type,
and a load never imports zarr-python (its metadata model costs ~0.3 ms per array)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import ucp_zarr
from ucp_zarr.errors import FormatError
from ucp_zarr.format.documents import ArrayMeta


@pytest.fixture(scope="module")
def doc(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("doc") / "ck"
    ucp_zarr.save({"w": torch.arange(24, dtype=torch.float32).reshape(4, 6)}, path)
    return json.loads((path / "w" / "w" / "zarr.json").read_bytes())


def test_written_document_parses(doc: dict) -> None:
    meta = ArrayMeta.from_zarr_json(doc, "w")
    assert meta.shape == (4, 6) and meta.key == "w" and meta.to_zarr_json() == doc


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.__setitem__("fill_value", 0.0),  # the same zero
        lambda d: d.__setitem__("storage_transformers", []),  # no transformers
    ],
)
def test_equivalent_spellings_accepted(doc: dict, edit) -> None:
    d = copy.deepcopy(doc)
    edit(d)
    assert ArrayMeta.from_zarr_json(d, "w").shape == (4, 6)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.__setitem__("shape", [4, 6.0]), "shape"),
        (lambda d: d.__setitem__("shape", [True, 6]), "shape"),
        (lambda d: d["chunk_grid"]["configuration"].__setitem__("chunk_shape", [4, -6]), "chunk_grid"),
        (lambda d: d["codecs"][0]["configuration"].__setitem__("chunk_shape", [0, 6]), "chunk_shape"),
        (lambda d: d["codecs"][0]["configuration"].__setitem__("chunk_shape", [4]), "dimensions"),
        (lambda d: d["codecs"][0]["configuration"]["codecs"][1].__setitem__("name", "gzip"), "codecs is"),
        (lambda d: d["codecs"][0]["configuration"].__setitem__("index_location", "start"), "codecs is"),
        (lambda d: d.__setitem__("fill_value", 1), "fill_value is 1"),
        (lambda d: d.__setitem__("fill_value", False), "fill_value is False"),
        (lambda d: d.__setitem__("data_type", "float64"), "data_type"),
        (lambda d: d.__setitem__("storage_transformers", [{"name": "x"}]), "storage_transformers"),
        (lambda d: d.__setitem__("extra", {"must_understand": False}), "extra is"),
        (lambda d: d.__setitem__("dimension_names", ["a"]), "dimension_names"),
        (lambda d: d.pop("chunk_key_encoding"), "chunk_key_encoding is absent"),
        (lambda d: d["chunk_key_encoding"]["configuration"].__setitem__("separator", "."), "chunk_key_encoding"),
        (lambda d: d.__setitem__("codecs", []), "sharding_indexed codec alone"),
    ],
)
def test_anything_else_refused(doc: dict, edit, message: str) -> None:
    d = copy.deepcopy(doc)
    edit(d)
    with pytest.raises(FormatError, match=message):
        ArrayMeta.from_zarr_json(d, "w")


def test_load_does_not_import_zarr(tmp_path) -> None:
    ucp_zarr.save({"w": torch.ones(3, 5), "b": torch.zeros(2, dtype=torch.bfloat16)}, tmp_path / "ck")
    code = textwrap.dedent(f"""
        import sys, torch, ucp_zarr
        sd = {{"w": torch.zeros(3, 5), "b": torch.ones(2, dtype=torch.bfloat16)}}
        ucp_zarr.load(sd, {str(tmp_path / "ck")!r})
        assert sd["w"].eq(1).all() and sd["b"].eq(0).all()
        print(sorted(m for m in sys.modules if m == "zarr" or m.startswith("zarr.")))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


_EDITS = [
    lambda d: None,  # the written document
    lambda d: d["attributes"].__setitem__("note", "x"),  # other attributes: the same array
    lambda d: d.__setitem__("fill_value", 0.0),
    lambda d: d.__setitem__("shape", [4, 6.0]),
    lambda d: d["attributes"]["ucp_zarr"].__setitem__("key", "v"),
    lambda d: d["codecs"][0]["configuration"].__setitem__("chunk_shape", [2, 6]),
    lambda d: d.__setitem__("dimension_names", ["x", "y"]),
    lambda d: d.__setitem__("zarr_format", 2),
]


@pytest.mark.parametrize("edit", _EDITS)
def test_from_committed_is_the_committed_documents_parse_or_none(doc: dict, edit) -> None:
    """``from_committed`` (a load's one-serialisation parse of the root's consolidated copy)
    gives what ``from_zarr_json`` gives for the committed document, or None (the reader then
    checks and parses the document the long way): never another array."""
    from ucp_zarr.format.documents import dump_document
    from ucp_zarr.format.integrity import document_digest

    committed = document_digest(dump_document(doc))
    d = copy.deepcopy(doc)
    edit(d)
    meta = ArrayMeta.from_committed(d, "w", committed)
    assert meta is None or meta == ArrayMeta.from_zarr_json(doc, "w")
    if json.dumps(d) == json.dumps(doc) or d["attributes"].get("note"):
        assert meta == ArrayMeta.from_zarr_json(doc, "w")  # (what it describes is the committed array)


def test_load_serialises_each_array_document_once(tmp_path, monkeypatch) -> None:
    """A load parses each array document from the root's consolidated copy with one JSON
    serialisation (the digest check and the field check in one), not three."""
    import ucp_zarr.format.documents as documents

    sd = {f"t{i}": torch.full((3, 5), float(i)) for i in range(6)}
    ucp_zarr.save(sd, tmp_path / "ck")
    calls = {"dump": 0, "compare": 0}
    dump, compare = documents.dump_document, documents._zarr_text

    def counted(name, fn):
        def wrapper(*args):
            calls[name] += 1
            return fn(*args)
        return wrapper

    monkeypatch.setattr(documents, "dump_document", counted("dump", dump))
    monkeypatch.setattr(documents, "_zarr_text", counted("compare", compare))
    out = ucp_zarr.load({k: torch.zeros(3, 5) for k in sd}, tmp_path / "ck")
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    assert calls == {"dump": len(sd), "compare": 0}


def test_the_commit_records_consolidated_copy_is_each_document_as_written(tmp_path) -> None:
    """The commit record splices each document's bytes into its consolidated metadata
    (:func:`~ucp_zarr.format.documents.dump_consolidated`): parsed, each node is the document
    written at its path (a group's with its own empty inline listing), in path order, and
    the record is exactly what dumping its parsed form gives (one compact JSON document)."""
    from pathlib import Path

    from ucp_zarr.format.documents import dump_document

    g = torch.Generator().manual_seed(0)
    state = {"model": {"layers": [{"w": torch.randn(8, 4, generator=g), "b": torch.randn(4, generator=g)}] * 2,
                       "head": torch.randn(3, 8, generator=g).to(torch.bfloat16)},
             "optim": {"state": {0: {"exp_avg": torch.randn(8, 4, generator=g)}}}, "step": 7}
    ucp_zarr.save(state, tmp_path / "ck")
    raw = (tmp_path / "ck" / "zarr.json").read_bytes()
    root = json.loads(raw)
    assert dump_document(root) == raw
    nodes = root["consolidated_metadata"]["metadata"]
    assert root["consolidated_metadata"]["kind"] == "inline" and list(nodes) == sorted(nodes)
    written = {str(p.parent.relative_to(tmp_path / "ck")): json.loads(p.read_bytes())
               for p in Path(tmp_path / "ck").rglob("zarr.json") if p.parent != tmp_path / "ck"}
    assert nodes.keys() == written.keys()
    for node, doc in written.items():
        if doc["node_type"] == "group":
            doc = doc | {"consolidated_metadata": {"kind": "inline", "must_understand": False, "metadata": {}}}
        assert nodes[node] == doc, node
    zarr = pytest.importorskip("zarr")
    group = zarr.open_consolidated(str(tmp_path / "ck"), mode="r")
    assert set(group.keys()) >= {n for n in nodes if "/" not in n}
