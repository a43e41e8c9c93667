"""How each torch dtype is stored as a Zarr v3 data type, bit-exactly.

Dtypes that Zarr v3 (and numpy) know are stored natively. The others are stored as the
unsigned integer of the same width holding the raw bits, and the array's ``torch_dtype``
attribute says how to reinterpret them:

* ``bfloat16`` -> ``uint16``: ``torch.from_numpy(a).view(torch.bfloat16)`` or
  ``a.view(ml_dtypes.bfloat16)``
* ``float8_*`` -> ``uint8``: ``torch.from_numpy(a).view(torch.float8_e4m3fn)`` (etc.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import DtypeMismatchError, FormatError


@dataclass(frozen=True)
class StoredDtype:
    """A torch dtype and the Zarr data type that holds it."""

    torch_dtype: torch.dtype
    zarr_dtype: str
    bits: bool
    """True when the Zarr array holds the raw bits (reinterpret with ``view``)."""

    @property
    def name(self) -> str:
        return str(self.torch_dtype).removeprefix("torch.")

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def storage_torch_dtype(self) -> torch.dtype:
        """The torch dtype whose numpy view matches the Zarr data type."""
        return _TORCH_OF_ZARR[self.zarr_dtype]

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
_TORCH_OF_ZARR = {z: getattr(torch, z) for z in _NATIVE.values()}

_BY_NAME: dict[str, StoredDtype] = {}
for _name, _zarr in list(_NATIVE.items()) + list(_BITS.items()):
    if hasattr(torch, _name):
        _BY_NAME[_name] = StoredDtype(getattr(torch, _name), _zarr, _name in _BITS)


def stored_dtype(dtype: torch.dtype, *, key: str = "") -> StoredDtype:
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


def supported_dtypes() -> list[torch.dtype]:
    return [s.torch_dtype for s in _BY_NAME.values()]
