"""How each torch dtype is stored as a Zarr v3 data type, bit-exactly.

Dtypes that Zarr v3 (and numpy) know are stored natively. The others are stored as the
unsigned integer of the same width holding the raw bits, and the array's ``torch_dtype``
attribute says how to reinterpret them:

* ``bfloat16`` -> ``uint16``: ``torch.from_numpy(a).view(torch.bfloat16)`` or
  ``a.view(ml_dtypes.bfloat16)``
* ``float8_*`` -> ``uint8``: ``torch.from_numpy(a).view(torch.float8_e4m3fn)`` (etc.)

Loading into a tensor of another dtype casts automatically only when the cast is lossless
(:func:`is_lossless_cast`: every value of the source is kept exactly); a lossy cast
(float to integer, wider float to narrower, int64 to float32, complex to real, anything to
bool, ...) needs an explicit opt-in.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import DtypeMismatchError, FormatError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class StoredDtype:
    """A torch dtype (by name) and the Zarr data type that holds it.

    Torch-free: only :attr:`torch_dtype` and :attr:`storage_torch_dtype` import torch."""

    name: str
    """The torch dtype's name, as in the ``torch_dtype`` attribute (``"bfloat16"``)."""
    zarr_dtype: str
    bits: bool
    """True when the Zarr array holds the raw bits (reinterpret with ``view``)."""

    @property
    def torch_dtype(self) -> "torch.dtype":
        import torch

        return getattr(torch, self.name)

    @property
    def numpy_dtype(self) -> np.dtype:
        """The numpy dtype of the stored values (the raw bits' for bf16/fp8)."""
        return np.dtype(self.zarr_dtype)

    @property
    def itemsize(self) -> int:
        return self.numpy_dtype.itemsize

    @property
    def storage_torch_dtype(self) -> "torch.dtype":
        """The torch dtype whose numpy view matches the Zarr data type."""
        import torch

        return getattr(torch, self.zarr_dtype)

    @property
    def fill_value(self) -> bool | int | list[float]:
        """Zarr v3's spelling of zero for this data type."""
        if self.zarr_dtype == "bool":
            return False
        if self.zarr_dtype.startswith("complex"):
            return [0.0, 0.0]
        return 0


_NATIVE = {
    "float64": "float64",
    "float32": "float32",
    "float16": "float16",
    "int64": "int64",
    "int32": "int32",
    "int16": "int16",
    "int8": "int8",
    "uint64": "uint64",
    "uint32": "uint32",
    "uint16": "uint16",
    "uint8": "uint8",
    "bool": "bool",
    "complex64": "complex64",
    "complex128": "complex128",
}
_BITS = {"bfloat16": "uint16"} | {
    name: "uint8"
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
}
_BY_NAME: dict[str, StoredDtype] = {
    name: StoredDtype(name, zarr, name in _BITS) for name, zarr in list(_NATIVE.items()) + list(_BITS.items())
}


def stored_dtype(dtype: "torch.dtype", *, key: str = "") -> StoredDtype:
    """The storage of a torch dtype; ``key`` names the tensor in the error."""
    name = str(dtype).removeprefix("torch.")
    try:
        return _BY_NAME[name]
    except KeyError:
        where = f" (tensor {key!r})" if key else ""
        raise DtypeMismatchError(f"ucp_zarr cannot store dtype {dtype}{where}") from None


def stored_dtype_by_name(name: str) -> StoredDtype:
    """The storage of a dtype named as in the ``torch_dtype`` attribute (``"bfloat16"``)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise FormatError(f"unknown torch_dtype {name!r} in checkpoint metadata") from None


def supported_dtypes() -> list["torch.dtype"]:
    import torch

    return [getattr(torch, name) for name in _BY_NAME if hasattr(torch, name)]


@dataclass(frozen=True)
class _FloatFormat:
    """What :func:`is_lossless_cast` needs to know about a floating-point dtype."""

    mantissa_bits: int
    max: float
    tiny: float
    """The smallest positive value (a subnormal where the type has them)."""
    signed: bool
    zero: bool
    negative_zero: bool
    inf: bool
    nan: bool


def _through(values: list[float], dtype: "torch.dtype") -> "torch.Tensor":
    import torch

    return torch.tensor(values, dtype=torch.float64).to(dtype).to(torch.float64)


@functools.cache
def _float_format(dtype: "torch.dtype") -> _FloatFormat:
    import torch

    fi = torch.finfo(dtype)
    eps = fi.eps
    # torch (2.13 included) reports eps = 2**-3 for float8_e5m2fnuz, which has 2 mantissa
    # bits like float8_e5m2: take the smallest power of two >= finfo.eps that is a real gap.
    while _through([1.0 + eps], dtype).item() != 1.0 + eps:
        eps *= 2
    mantissa_bits = -int(math.log2(eps))
    # Which special values exist: what torch's own conversion makes of them.
    zero, neg_zero, inf, nan = _through([0.0, -0.0, math.inf, math.nan], dtype).tolist()
    return _FloatFormat(
        mantissa_bits=mantissa_bits,
        max=fi.max,
        tiny=fi.smallest_normal * 2.0**-mantissa_bits,
        signed=fi.min < 0,
        zero=zero == 0.0,
        negative_zero=neg_zero == 0.0 and math.copysign(1.0, neg_zero) < 0,
        inf=math.isinf(inf),
        nan=math.isnan(nan),
    )


def is_lossless_cast(src: "torch.dtype", dst: "torch.dtype") -> bool:
    """True when every value of ``src`` converts to ``dst`` and back exactly.

    That is, ``x.to(dst)`` is the same number as ``x`` and ``x.to(dst).to(src)`` has the bits
    of ``x``, for every value including inf, nan, -0.0, subnormals and the extremes (NaN
    payloads and the sign of NaN are not values: torch's float32 -> float16 / bfloat16 casts
    drop them). A round trip alone is not enough: uint8 255 -> int8 -1 -> uint8 255.
    The rule, from ``torch.finfo`` / ``torch.iinfo`` and which special values a float has:

    * same dtype: lossless. To ``bool`` from anything else: lossy.
    * complex -> complex: as the component types; complex -> real: lossy; real -> complex:
      as real -> the component type (``float32`` for ``complex64``).
    * bool -> any number that has 0 (all but ``float8_e8m0fnu``): lossless.
    * int -> int: lossless when ``dst``'s [min, max] contains ``src``'s (so unsigned ->
      signed needs a strictly wider type; signed -> unsigned is lossy).
    * int -> float: every integer of ``src`` must be exact: ``max(|min|, max) <= 2**(m+1)``
      with m = mantissa bits of ``dst`` (int16 -> float32 yes, int32 -> float32 no,
      int32 -> float64 yes, int64 -> float64 no), ``dst`` signed if ``src`` is, has 0.
    * float -> int: lossy.
    * float -> float: ``dst`` has at least as many mantissa bits (``-log2(eps)``), a max at
      least as large, a smallest positive value (smallest normal * eps) at most as large, a
      sign if ``src`` has one, and each of 0, -0.0, inf, nan that ``src`` has. So
      float8_e4m3fn / e5m2 -> float16 / bfloat16 / float32 / float64 are lossless, while
      float8_e5m2 -> float8_e5m2fnuz (no inf, no -0.0) and float8_e8m0fnu -> float16 (range) are
      lossy.
    """
    import torch

    if src == dst:
        return True
    if dst == torch.bool:
        return False
    if src.is_complex:
        return dst.is_complex and is_lossless_cast(src.to_real(), dst.to_real())
    if dst.is_complex:
        return is_lossless_cast(src, dst.to_real())
    if src == torch.bool:
        return not dst.is_floating_point or _float_format(dst).zero
    if src.is_floating_point:
        if not dst.is_floating_point:
            return False
        s, d = _float_format(src), _float_format(dst)
        return (
            d.mantissa_bits >= s.mantissa_bits
            and d.max >= s.max
            and d.tiny <= s.tiny
            and d.signed >= s.signed
            and d.zero >= s.zero
            and d.negative_zero >= s.negative_zero
            and d.inf >= s.inf
            and d.nan >= s.nan
        )
    si = torch.iinfo(src)
    if dst.is_floating_point:
        d = _float_format(dst)
        largest = max(si.max, -si.min)
        exact = min(2 ** (d.mantissa_bits + 1), d.max)  # every integer up to here is exact
        return d.zero and (d.signed or si.min == 0) and largest <= exact
    di = torch.iinfo(dst)
    return di.min <= si.min and si.max <= di.max
