"""``is_lossless_cast`` checked against what torch's casts really do.

A value ``x`` of ``src`` is kept by a cast to ``dst`` when

* ``x.to(dst)`` is the same number as ``x`` (compared exactly, as Python numbers; a real
  number equals a complex one only if the imaginary part is 0), and
* ``x.to(dst).to(src)`` has the same bits as ``x`` (so ``-0.0`` must stay ``-0.0``).

The first condition is needed because a round trip alone misses wrap-around: uint8 255 ->
int8 -1 -> uint8 255 comes back, but the checkpoint would have been loaded as -1.

Any NaN equals any NaN: a NaN's payload and sign are not numeric values, and torch itself drops
them (float32 -> bfloat16 / float16 turn every NaN into one canonical NaN), so demanding them
would make even bfloat16 -> float32 "lossy". Types with a single NaN (the fnuz float8s,
float8_e8m0fnu) are unaffected: their NaN has one bit pattern anyway.

For every pair, a True answer must survive every hard value of ``src`` (all bit patterns of
the 8- and 16-bit types, extremes, specials and random bit patterns of the wider ones), and a
False answer must be backed by a witness: a value of ``src`` that does not come back.
"""

from __future__ import annotations

import functools
import itertools
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ucp_zarr.format.dtypes import is_lossless_cast, supported_dtypes

DTYPES = supported_dtypes()
PAIRS = [(s, d) for s in DTYPES for d in DTYPES]
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _bits(width: int, n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` random bit patterns in the signed integer type of ``width`` bytes."""
    lo = -(2 ** (8 * width - 1))
    return torch.randint(lo, -lo - 1, (n,), dtype=torch.int64, generator=generator).to(_INT_OF_SIZE[width])


@functools.cache
def hard_values(dtype: torch.dtype) -> torch.Tensor:
    """Values of ``dtype`` most likely to expose a lossy cast; all of them where that is cheap."""
    gen = torch.Generator().manual_seed(1234)
    if dtype == torch.bool:
        return torch.tensor([False, True])
    if dtype.is_complex:
        part = hard_values(dtype.to_real())
        # Every (special) real part with every (special) imaginary part, and random pairs.
        re, im = (t.reshape(-1) for t in torch.meshgrid(part[:40], part[:40], indexing="ij"))
        picks = torch.randint(0, len(part), (2, 200), generator=gen)
        re, im = torch.cat([re, part[picks[0]]]), torch.cat([im, part[picks[1]]])
        return torch.complex(re, im)
    width = dtype.itemsize
    if width <= 2:  # every bit pattern
        lo = -(2 ** (8 * width - 1))
        return torch.arange(lo, -lo, dtype=torch.int32).to(_INT_OF_SIZE[width]).view(dtype)
    random = _bits(width, 500, gen).view(dtype)
    if dtype.is_floating_point:  # float32, float64
        fi = torch.finfo(dtype)
        tiny = fi.smallest_normal * fi.eps  # the smallest subnormal
        special = [0.0, -0.0, fi.max, -fi.max, fi.smallest_normal, -fi.smallest_normal, tiny, -tiny]
        special += [1.0, 1.0 + fi.eps, -1.0 - fi.eps, 1.0 / 3.0, 2.0**24 + 2]
        special += [float("inf"), float("-inf"), float("nan")]
        return torch.cat([torch.tensor(special, dtype=dtype), random])
    ii = torch.iinfo(dtype)
    special = [ii.min, ii.max, 0, 1, ii.max - 1, 2**24 + 1, 2**53 + 1]
    if ii.min < 0:
        special += [-1, ii.min + 1, -(2**24) - 1, -(2**53) - 1]
    special = [v for v in special if ii.min <= v <= ii.max]
    # Unsigned values above the signed max go in as the signed integer with the same bits.
    special_bits = [v - 2 ** (8 * width) if v >= 2 ** (8 * width - 1) else v for v in special]
    return torch.cat([torch.tensor(special_bits, dtype=_INT_OF_SIZE[width]).view(dtype), random])


def _comparable(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bit patterns as a signed integer tensor, NaN mask) of a real or complex tensor."""
    if t.dtype.is_complex:
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        return t.to(torch.int8), torch.zeros_like(t)
    nan = t.to(torch.float64).isnan() if t.dtype.is_floating_point else torch.zeros(t.shape, dtype=torch.bool)
    return t.view(_INT_OF_SIZE[t.dtype.itemsize]), nan


def _same_number(a: bool | int | float | complex, b: bool | int | float | complex) -> bool:
    """Exact equality of Python numbers, NaN equal to NaN."""
    if isinstance(a, complex) or isinstance(b, complex):
        a_re, a_im = (a.real, a.imag) if isinstance(a, complex) else (a, 0.0)
        b_re, b_im = (b.real, b.imag) if isinstance(b, complex) else (b, 0.0)
        return _same_number(a_re, b_re) and _same_number(a_im, b_im)
    if a != a:  # NaN
        return b != b
    return a == b


def lost_values(values: torch.Tensor, dst: torch.dtype) -> torch.Tensor:
    """The values that change in ``.to(dst)`` or do not survive ``.to(dst).to(values.dtype)``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Casting complex values to real", UserWarning)
        there = values.to(dst)
        back = there.to(values.dtype)
    a_bits, a_nan = _comparable(values)
    b_bits, b_nan = _comparable(back)
    kept = (a_bits == b_bits) | (a_nan & b_nan)
    if values.dtype.is_complex:  # a complex value survives when both of its parts do
        kept = kept.all(dim=-1)
    kept &= _same_numbers(values, there)
    return values[~kept]


def _parts(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Real and imaginary parts as float64 (exact for every dtype but the 64-bit integers)."""
    if t.dtype.is_complex:
        return t.real.to(torch.float64), t.imag.to(torch.float64)
    return t.to(torch.float64), torch.zeros(t.shape, dtype=torch.float64)


def _same_numbers(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise :func:`_same_number` of two tensors of any dtypes."""
    if {a.dtype, b.dtype} & {torch.int64, torch.uint64}:  # float64 would round them
        return torch.tensor([_same_number(x, y) for x, y in zip(a.tolist(), b.tolist())], dtype=torch.bool)
    same = torch.ones(a.shape, dtype=torch.bool)
    for x, y in zip(_parts(a), _parts(b)):
        same &= (x == y) | (x.isnan() & y.isnan())
    return same


@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=[f"{_name(s)}->{_name(d)}" for s, d in PAIRS])
def test_rule_matches_reality(src: torch.dtype, dst: torch.dtype) -> None:
    values = hard_values(src)
    try:
        lost = lost_values(values, dst)
    except (RuntimeError, TypeError) as exc:  # none in torch 2.13; kept for other builds
        pytest.skip(f"torch cannot cast {_name(src)} -> {_name(dst)}: {exc}")
    if is_lossless_cast(src, dst):
        assert lost.numel() == 0, f"said lossless, but these {_name(src)} values do not come back: {lost[:8]}"
    else:
        assert lost.numel() > 0, f"said lossy, but every hard {_name(src)} value came back from {_name(dst)}"


@pytest.mark.parametrize(
    ("src", "dst", "expected"),
    [
        (torch.int8, torch.float32, True),
        (torch.uint16, torch.float32, True),
        (torch.int32, torch.float32, False),
        (torch.int32, torch.float64, True),
        (torch.int64, torch.float64, False),
        (torch.uint8, torch.int16, True),
        (torch.uint8, torch.int8, False),
        (torch.int8, torch.uint64, False),
        (torch.float32, torch.complex64, True),
        (torch.complex64, torch.float32, False),
        (torch.float32, torch.int64, False),
        (torch.float32, torch.bfloat16, False),
        (torch.bfloat16, torch.float32, True),
        (torch.float16, torch.bfloat16, False),
        (torch.bool, torch.float8_e4m3fn, True),
        (torch.int8, torch.bool, False),
    ],
)
def test_documented_examples(src: torch.dtype, dst: torch.dtype, expected: bool) -> None:
    assert is_lossless_cast(src, dst) is expected


def test_same_dtype_is_lossless() -> None:
    assert all(is_lossless_cast(d, d) for d in DTYPES)


LOSSLESS = [(s, d) for s, d in PAIRS if s != d and is_lossless_cast(s, d)]


@st.composite
def values_of(draw: st.DrawFn, dtype: torch.dtype) -> torch.Tensor:
    """A short tensor of arbitrary values of ``dtype``, drawn as raw bit patterns."""
    n = draw(st.integers(1, 16))
    if dtype == torch.bool:
        return torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    part = dtype.to_real() if dtype.is_complex else dtype
    width = part.itemsize
    count = 2 * n if dtype.is_complex else n
    half = 2 ** (8 * width - 1)
    bits = draw(st.lists(st.integers(-half, half - 1), min_size=count, max_size=count))
    t = torch.tensor(bits, dtype=_INT_OF_SIZE[width]).view(part)
    return torch.view_as_complex(t.reshape(n, 2)) if dtype.is_complex else t


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_lossless_pairs_round_trip_random_values(data: st.DataObject) -> None:
    src, dst = data.draw(st.sampled_from(LOSSLESS), label="pair")
    values = data.draw(values_of(src), label="values")
    lost = lost_values(values, dst)
    assert lost.numel() == 0, f"{_name(src)} -> {_name(dst)} loses {lost}"


def test_lossless_pairs_are_closed_under_composition() -> None:
    """A lossless a -> b and b -> c make a -> c lossless (a sanity check on the rule)."""
    ok = {(s, d) for s, d in PAIRS if is_lossless_cast(s, d)}
    for (a, b), c in itertools.product(ok, DTYPES):
        if (b, c) in ok:
            assert (a, c) in ok, (a, b, c)
