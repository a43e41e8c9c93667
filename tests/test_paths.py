"""Paths built from input data never leave their folder (issue 18, section 3).

The pure helper (:mod:`ucp_zarr.format.safe_paths`) is fuzzed with hostile names and checked
against independent oracles: ``posixpath`` and ``ntpath`` (Windows) resolving the joined
path, after Unicode look-alikes are read as what they imitate. Then end to end: real
checkpoints and foreign inputs with hostile names (a ds-universal export, a universal
folder's pickles, DeepSpeed's ``latest``, a safetensors index, a DCP ``.metadata``, a
destination holding a symbolic link, hostile tensor keys saved as Zarr arrays), asserting
that the error names the key or file and that nothing appears outside the destination.
Each fuzz test prints how many inputs it tried and how many escaped (always 0)."""

from __future__ import annotations

import ntpath
import os
import pickle
import posixpath
import random
import re
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ucp_zarr
from ucp_zarr.cli import main as cli
from ucp_zarr.errors import FormatError, UnsafePathError
from ucp_zarr.format.documents import check_array_path, check_document_path
from ucp_zarr.format.safe_paths import check_no_links, inside, inside_relative, name_problem
from ucp_zarr.format.statedict import assign_array_paths
from ucp_zarr.io.factory import open_store
from ucp_zarr.protocol.writer import InMemory, write_checkpoint

# --- hostile names -----------------------------------------------------------------------------

PIECES = [
    "..", ".", "/", "\\", ":", "~", "~/", "C:", "c:\\", "\\\\?\\", "//", "\x00", "\n", "\r", "\t", "\x1b", "\x7f",
    "\x85", "\u2028", "\u2029", "\u202e", "\u200b", "\ufeff", "\u2024", "\u2025", "\u2026", "\uff0e", "\ufe52",
    "\uff0f", "\u2215", "\u2044", "\u29f8", "\uff3c", "\ufe68", "\u2216", "\u29f9", "\u00a5", "\u20a9", "\uff1a",
    "\ufe55", "\u2100", "\u2105", "\u0338", "\ud800", "%2e", "%2f", "a", "b", "\u00e9", "e\u0301", "\u00df",
    "\u65e5\u672c", " ", "zero", "fp32.pt", "CON", "nul",
]
hostile = st.lists(st.sampled_from(PIECES) | st.text(max_size=3), max_size=8).map("".join)
overlong = st.text(alphabet=st.sampled_from(["a", "\u00e9", "\u65e5", ".", "/"]), min_size=60, max_size=300)
names = st.one_of(hostile, st.text(max_size=20), overlong)
relatives = st.lists(names, min_size=1, max_size=4).map("/".join) | st.lists(names, max_size=4).map("\\".join)
key_lists = st.lists(st.one_of(names, st.lists(names, min_size=1, max_size=4).map(".".join)), min_size=1, max_size=6,
                     unique=True)


def random_name(rng: random.Random) -> str:
    """A hostile name drawn without hypothesis (about 50x faster: the bulk of the fuzzing)."""
    kind = rng.random()
    if kind < 0.45:
        return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 8)))
    if kind < 0.7:  # any code points, surrogates and controls included
        return "".join(chr(rng.choice([rng.randrange(0x110000), rng.randrange(0x80), rng.randrange(0x3000)]))
                       for _ in range(rng.randint(1, 6)))
    if kind < 0.9:  # mostly plain names, dots and tildes among them
        return "".join(rng.choice("ab~ \u00e9%-_.\u65e5") for _ in range(rng.randint(1, 8)))
    return "".join(rng.choice("a\u00e9\u65e5./") for _ in range(rng.randint(60, 300)))


def random_relative(rng: random.Random) -> str:
    return rng.choice("/\\").join(random_name(rng) for _ in range(rng.randint(1, 4)))


def random_keys(rng: random.Random) -> list[str]:
    return list({".".join(random_name(rng) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 6))})


SCALES = [pytest.param(1, id="bounded"), pytest.param(20, id="long", marks=pytest.mark.long)]
"""The fuzz tests run bounded by default (a few seconds each) and 20x longer with -m long."""

# what some system reads a look-alike as (independent of the module's table): NFKC, then
# the separators Windows' best-fit code pages map to
_READ_AS = str.maketrans("\u2215\u2044\u29f8\u2216\u29f9\u00a5\u20a9", "///\\\\\\\\")
POSIX_ROOT, NT_ROOT = "/r/root", "C:\\r\\root"


def _readings(rel: str) -> list[str]:
    folded = unicodedata.normalize("NFKC", rel).translate(_READ_AS)
    return [rel, folded]


def escapes(rel: str) -> bool:
    """Whether ``rel`` (joined below a folder) names anything but a file strictly inside
    it, on POSIX or on Windows, as written or with look-alikes read as what they imitate;
    or has a ``.``/``..`` part, a NUL or other control character, a part over 255 bytes."""
    for r in _readings(rel):
        posix = posixpath.normpath(posixpath.join(POSIX_ROOT, r))
        nt = ntpath.normpath(ntpath.join(NT_ROOT, r))
        if not posix.startswith(POSIX_ROOT + "/") or not nt.startswith(NT_ROOT + "\\"):
            return True
        parts = re.split(r"[/\\]", r)
        if any(p in ("", ".", "..") or len(p.encode("utf-8", "surrogatepass")) > 255 for p in parts):
            return True
        if any(unicodedata.category(c) in ("Cc", "Zl", "Zp") or c == ":" for c in r):
            return True
    return False


def _fuzz(strategy: st.SearchStrategy, examples: int, draw: Any, bulk: int, check: Any, scale: int) -> Counter:
    """Run ``check(value, tally)`` on ``examples`` values of the hypothesis ``strategy``
    (which shrinks a failure to a minimal name), then on ``bulk`` values of ``draw(rng)``
    (seeded), the bulk ``scale`` times over (hypothesis at most 3 times: it slows as it
    runs longer); returns the tally."""
    tally: Counter = Counter()

    @settings(max_examples=examples * min(scale, 3), deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(value: Any) -> None:
        tally["tried"] += 1
        check(value, tally)

    run()
    rng = random.Random(18)
    for _ in range(bulk * scale):
        tally["tried"] += 1
        check(draw(rng), tally)
    return tally


def _report(what: str, tally: Counter) -> None:
    print(f"\n{what}: {tally['tried']} inputs tried, {tally['accepted']} accepted, {tally['escapes']} escapes")
    assert tally["escapes"] == 0


# --- the pure helper -----------------------------------------------------------------------------


def _joined(join: Any, value: Any, tally: Counter) -> Path | None:
    """``join(root, value, what)``, or None when it refuses (naming the value, what it is
    and the folder); counts the values accepted and those of them that escape."""
    root = Path(POSIX_ROOT)
    try:
        path = join(root, value, "index names the file")
    except UnsafePathError as e:
        assert all(s in str(e) for s in ("index names the file", repr(value)[:100], str(root)))
        return None
    tally["accepted"] += 1
    tally["escapes"] += escapes(value)
    assert not escapes(value), value
    return path


@pytest.mark.parametrize("scale", SCALES)
def test_a_name_is_one_plain_file_name_inside_its_folder(scale: int) -> None:
    def check(name: Any, tally: Counter) -> None:
        path = _joined(inside, name, tally)
        assert path is None or (path.parent == Path(POSIX_ROOT) and path.name == name)

    tally = _fuzz(names, 300, random_name, 10_000, check, scale)
    _report("file names", tally)
    assert tally["accepted"] > 1000 * scale


@pytest.mark.parametrize("scale", SCALES)
def test_a_relative_path_stays_inside_its_folder(scale: int) -> None:
    def check(rel: str, tally: Counter) -> None:
        path = _joined(inside_relative, rel, tally)
        assert path is None or path.relative_to(POSIX_ROOT).parts == tuple(rel.split("/"))

    tally = _fuzz(relatives, 200, random_relative, 5_000, check, scale)
    _report("relative paths", tally)
    assert tally["accepted"] > 100 * scale


@pytest.mark.parametrize("name", [
    "..", ".", "", "/", "/etc/passwd", "a/b", "a\\b", "..\\..\\x", "C:", "C:x", "c:\\x", "\\\\server\\share", "a\x00b",
    "a\nb", "\x7f", "\u2028", "\u2024", "\u2025", "\uff0e\uff0e", "\uff0f", "a\u2215b", "a\u2044b", "a\uff3cb",
    "\u00a5", "\u2100", "\ufe68", "a" * 256, "\u00e9" * 128, "\ud800", 3, None, b"x",
])
def test_hostile_names_are_refused(name: Any) -> None:
    with pytest.raises(UnsafePathError, match=re.escape(repr(name)[:60])):
        inside(Path("/r"), name, "parameter")


@pytest.mark.parametrize("name", [
    "model.layers.0.self_attn.q_proj.weight", "global_step10_universal", "model-00001-of-00002.safetensors",
    "__0_0.distcp", "fp32.pt", "exp_avg.pt", "~", "~root", "...", "a b", "\u00e9t\u00e9", "\u65e5\u672c\u8a9e",
    "%2e%2e", "-rf", "a" * 255, "\u00e9" * 127, "CON", "aux.weight",
])
def test_plain_names_are_accepted(name: str) -> None:
    assert name_problem(name) is None
    assert inside(Path("/r"), name, "parameter") == Path("/r", name)


def test_nothing_is_written_through_a_link(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir(), outside.mkdir()
    (root / "zero").symlink_to(outside)
    (root / "dangling").symlink_to(tmp_path / "nowhere")
    (root / "real").mkdir()
    (root / "real" / "file.pt").symlink_to(outside / "file.pt")
    for parts in (["zero"], ["zero", "w"], ["dangling"], ["real", "file.pt"]):
        with pytest.raises(UnsafePathError, match="is a symbolic link"):
            check_no_links(root, root.joinpath(*parts), "the file")
    with pytest.raises(UnsafePathError, match="zero is a symbolic link"):
        inside(root, "zero", "parameter", write=True)
    assert inside(root, "zero", "parameter") == root / "zero"  # reading follows a source's own links
    assert inside(root / "real", "other.pt", "state", write=True) == root / "real" / "other.pt"
    assert not any(outside.iterdir())


# --- tensor keys -> Zarr array paths (escaped, never refused) -------------------------------------


@pytest.mark.parametrize("scale", SCALES)
def test_any_key_gets_an_array_path_inside_the_checkpoint(scale: int) -> None:
    def check(ks: list[str], tally: Counter) -> None:
        ks = [k for k in ks if k.encode("utf-8", "replace").decode() == k]  # save refuses surrogates
        paths = assign_array_paths(ks)
        assert len(set(paths.values())) == len(ks)
        for k, p in paths.items():
            tally["accepted"] += 1
            check_array_path(p, k)
            bad = escapes(p) or any(name_problem(part) for part in p.split("/")) or p.split("/")[0] == "zarr.json"
            tally["escapes"] += bad
            assert not bad, (k, p)

    tally = _fuzz(key_lists, 50, random_keys, 1_000, check, scale)
    _report("tensor keys (array paths)", tally)


@pytest.mark.parametrize("scale", SCALES)
def test_an_index_path_read_from_a_commit_record_stays_inside(scale: int) -> None:
    """The reader's side: the paths a (hostile) root document may hold are checked by the
    format's rules before anything is read there."""
    def check(rel: str, tally: Counter) -> None:
        for checker, path in ((check_array_path, rel), (check_document_path, f"{rel}/zarr.json")):
            try:
                checker(path, "root")
            except FormatError:
                continue
            tally["accepted"] += 1
            tally["escapes"] += escapes(path)
            assert not escapes(path), path

    tally = _fuzz(relatives, 100, random_relative, 5_000, check, scale)
    _report("index paths of a root document", tally)


HOSTILE_KEYS = ["a/../b", "../../../../x", "/etc/passwd", ".", "..", "...", "~", "~/x", "C:\\x", "x\x00y", "\n",
                "\uff0e\uff0e", "\u2215", "a\u2215..\u2215b", "zarr.json", ".ucp_zarr_owner", "__x", "a" * 400]


def _files(root: Path) -> set[Path]:
    return {Path(d, n) for d, dirs, files in os.walk(root) for n in dirs + files}


def test_hostile_keys_are_stored_inside_the_checkpoint(tmp_path: Path) -> None:
    ck = tmp_path / "a" / "b" / "c" / "ck"
    state = {"model": {k: torch.arange(3.0) + i for i, k in enumerate(HOSTILE_KEYS)},
             "optim": {"state": {k: {"exp_avg": torch.ones(2) * i} for i, k in enumerate(HOSTILE_KEYS)}}}
    ucp_zarr.save(state, ck)
    assert all(p == ck or ck in p.parents for p in _files(tmp_path) if p not in (tmp_path / "a", ck.parent.parent, ck.parent))
    assert not any(p.name in ("x", "passwd", "b") or p.is_symlink() for p in _files(ck))
    back = {"model": {k: torch.zeros(3) for k in HOSTILE_KEYS},
            "optim": {"state": {k: {"exp_avg": torch.zeros(2)} for k in HOSTILE_KEYS}}}
    ucp_zarr.load(back, ck)
    for i, k in enumerate(HOSTILE_KEYS):
        assert torch.equal(back["model"][k], torch.arange(3.0) + i) and torch.equal(back["optim"]["state"][k]["exp_avg"],
                                                                                     torch.ones(2) * i)


# --- exports --------------------------------------------------------------------------------------

REFUSED = ["../../../../pwned", "..", ".", "/tmp/abs", "a/b", "..\\..\\pwned", "C:pwned", "a\x00b", "a\nb",
           "\uff0e\uff0e", "\u2024\u2024/pwned", "\uff0f..", "x\u2215..\u2215y", "\u00a5..", "a" * 300]


def _ds_checkpoint(path: Path, name: str, values: dict[str, Any] | None = None,
                   state: dict[str, torch.Tensor] | None = None) -> None:
    """A checkpoint as the DeepSpeed importer makes one: ``model.<name>``, its optimizer
    state, ``optim.param_groups`` listing it by name."""
    tensors = {f"model.{name}": InMemory(torch.arange(4.0))}
    tensors |= {f"optim.state.{name}.{k}": InMemory(t) for k, t in (state or {"exp_avg": torch.ones(4)}).items()}
    write_checkpoint(open_store(path), tensors, {"optim.param_groups": [{"params": [name], "lr": 0.1}], **(values or {})})


def _refuses(tmp_path: Path, match: str, run: Any) -> None:
    """``run()`` raises UnsafePathError matching ``match``, and creates nothing."""
    before = _files(tmp_path)
    with pytest.raises(UnsafePathError, match=match):
        run()
    assert _files(tmp_path) == before


def test_ds_universal_export_refuses_hostile_parameter_names(tmp_path: Path) -> None:
    """Issue 18: ``model.../../../../pwned`` made the export write ``pwned/fp32.pt`` outside its destination."""
    deep = tmp_path / "a" / "b" / "c" / "d"
    for i, name in enumerate(REFUSED):
        _ds_checkpoint(deep / f"ck{i}", name)
        _refuses(tmp_path, re.escape(repr(name)[:60]),
                 lambda: ucp_zarr.export(deep / f"ck{i}", deep / f"out{i}", to="ds-universal"))
    assert not any(p.name == "pwned" or p.name == "fp32.pt" for p in _files(tmp_path))


def test_ds_universal_export_refuses_hostile_state_keys_and_tags(tmp_path: Path) -> None:
    deep = tmp_path / "a" / "b"
    _ds_checkpoint(deep / "ck", "w", state={"exp_avg": torch.ones(4), "../../../pwned": torch.ones(4)})
    _refuses(tmp_path, re.escape("'optim.state.w.../../../pwned'"),
             lambda: ucp_zarr.export(deep / "ck", deep / "out", to="ds-universal"))
    _ds_checkpoint(deep / "ck2", "w", values={"deepspeed.global_steps": "/../../pwned"})
    _refuses(tmp_path, re.escape("ck2: the folder of its step 'global_step/../../pwned_universal'"),
             lambda: ucp_zarr.export(deep / "ck2", deep / "out", to="ds-universal"))
    _refuses(tmp_path, "the tag's folder '../x_universal'",
             lambda: ucp_zarr.export(deep / "ck2", deep / "out", to="ds-universal", tag="../x"))


def test_the_cli_names_the_refused_parameter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _ds_checkpoint(tmp_path / "ck", "../pwned")
    assert cli(["export", str(tmp_path / "ck"), str(tmp_path / "out"), "--to", "ds-universal"]) == 2
    assert "'../pwned' is refused as a file name: it holds '/'" in capsys.readouterr().err
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["~", "...", "a b", "\u00e9t\u00e9.w", "%2e%2e", "-rf", "CON"])
def test_odd_but_plain_names_export_inside_and_import_back(tmp_path: Path, name: str) -> None:
    _ds_checkpoint(tmp_path / "ck", name)
    ucp_zarr.export(tmp_path / "ck", tmp_path / "out", to="ds-universal")
    assert (tmp_path / "out" / "global_step0_universal" / "zero" / name / "fp32.pt").is_file()
    assert {p for p in _files(tmp_path) if tmp_path / "ck" not in p.parents} - _files(tmp_path / "out") == {
        tmp_path / "ck", tmp_path / "out"}
    ucp_zarr.convert(tmp_path / "out", tmp_path / "back", source="ds-universal")
    back = ucp_zarr.open(tmp_path / "back")
    assert torch.equal(back.read(f"model.{name}"), torch.arange(4.0))
    assert torch.equal(back.read(f"optim.state.{name}.exp_avg"), torch.ones(4))


# --- importers -------------------------------------------------------------------------------------


def _exported(tmp_path: Path) -> Path:
    """A real universal folder (our export, which DeepSpeed loads), of one parameter ``w``."""
    _ds_checkpoint(tmp_path / "ck", "w")
    return ucp_zarr.export(tmp_path / "ck", tmp_path / "src" / "u", to="ds-universal")


def _repickle(file: Path, change: Any) -> None:
    obj = torch.load(file, weights_only=False)
    change(obj)
    torch.save(obj, file)


def test_universal_import_refuses_hostile_names_from_its_pickles(tmp_path: Path) -> None:
    """The importer opened ``zero/<name>`` with ``name`` from the pickle: it read a planted
    ``outside/fp32.pt`` as the parameter's master."""
    src = _exported(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    torch.save({"param": torch.full((4,), 7.0), "cat_dim": 0}, outside / "fp32.pt")
    model_file = src / "global_step0_universal" / "mp_rank_00_model_states.pt"
    for name in ["../../../../outside", str(outside), "..", "\uff0e\uff0e", "a\x00"]:
        _repickle(model_file, lambda m: m.__setitem__("param_shapes", [{name: torch.Size([4])}]))
        _refuses(tmp_path, re.escape(f"mp_rank_00_model_states.pt: param_shapes names the parameter {name!r}"),
                 lambda: ucp_zarr.convert(src, tmp_path / "ck2", source="ds-universal"))
    for tag in ["../outside", "/tmp", "..", "a\\..\\b", "\u2025"]:
        (src / "latest_universal").write_text(tag)
        _refuses(tmp_path, re.escape(f"latest_universal: the tag {tag!r}"),
                 lambda: ucp_zarr.convert(src, tmp_path / "ck2", source="ds-universal"))


def test_deepspeed_latest_naming_a_folder_outside_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "ds"
    src.mkdir()
    for tag in ["../outside", "/etc", "..", ".", "..\\x", "C:x", "\uff0e\uff0e", "x\ny"]:
        (src / "latest").write_text(tag + "\n")
        _refuses(tmp_path, re.escape(f"latest: the tag {tag.strip()!r}"),
                 lambda: ucp_zarr.convert(src, tmp_path / "ck", source="deepspeed"))


def test_safetensors_index_naming_files_outside_is_refused(tmp_path: Path) -> None:
    """The index's weight_map could name any file: ``../outside.safetensors`` and absolute
    paths were read."""
    import json

    from safetensors.torch import save_file

    outside = tmp_path / "outside.safetensors"
    save_file({"w": torch.full((3,), 7.0)}, outside)
    src = tmp_path / "src"
    src.mkdir()
    index = src / "model.safetensors.index.json"
    hostile = ["../outside.safetensors", str(outside), "sub/../../outside.safetensors", "..\\outside.safetensors",
               "C:\\outside.safetensors", "a\x00b", "\uff0e\uff0e/outside.safetensors", "\u2025/outside.safetensors",
               "", ".", "x" * 300, "./model.safetensors"]
    for f in hostile:
        index.write_text(json.dumps({"weight_map": {"w": f}}))
        _refuses(tmp_path, re.escape(f"model.safetensors.index.json: the weight_map of 'w' names the file {f!r}"[:160]),
                 lambda: ucp_zarr.convert(index, tmp_path / "ck"))
    (src / "sub").mkdir()
    save_file({"w": torch.arange(3.0)}, src / "sub" / "model.safetensors")  # inside: fine
    index.write_text(json.dumps({"weight_map": {"w": "sub/model.safetensors"}}))
    ucp_zarr.convert(index, tmp_path / "ck")
    assert torch.equal(ucp_zarr.open(tmp_path / "ck").read("w"), torch.arange(3.0))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_metadata_naming_files_outside_is_refused(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    dcp.save({"w": torch.arange(6.0), "n": 3}, checkpoint_id=src)
    (tmp_path / "outside.distcp").write_bytes((src / "__0_0.distcp").read_bytes())
    raw = (src / ".metadata").read_bytes()
    for rel in ["../outside.distcp", str(tmp_path / "outside.distcp"), "..\\outside.distcp", "C:outside.distcp",
                "a/../../outside.distcp", "\uff0e\uff0e/outside.distcp", "__0_0.distcp\x00", "./__0_0.distcp", ""]:
        md = pickle.loads(raw)
        for info in md.storage_data.values():
            info.relative_path = rel
        (src / ".metadata").write_bytes(pickle.dumps(md))
        _refuses(tmp_path, re.escape(f".metadata: the entry of 'n' names the file {rel!r}"),
                 lambda: ucp_zarr.convert(src, tmp_path / "ck"))


# --- destinations ------------------------------------------------------------------------------------


def test_convert_refuses_a_destination_holding_a_link(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.arange(3.0)}, tmp_path / "m.safetensors")
    dst, outside = tmp_path / "dst", tmp_path / "outside"
    dst.mkdir(), outside.mkdir()
    (dst / "w").symlink_to(outside)  # where the array of key 'w' would be written
    with pytest.raises(UnsafePathError, match=re.escape(f"{dst} holds symbolic links ({dst / 'w'})")):
        ucp_zarr.convert(tmp_path / "m.safetensors", dst, overwrite=True)
    assert not any(outside.iterdir())
