"""Reading a GGUF file's header: metadata and tensor directory, with one-line errors.

Shared by the engine-core (config), the workers (weights) and the frontends (tokenizer), so a
bad file reads the same everywhere: every failure is a ``GGUFFileError`` naming the file and the
reason. The format's constants (value types, quant types and their block sizes) come from the
``gguf`` package (llama.cpp's own); the header is parsed here because ``gguf.GGUFReader`` builds
numpy views per array element and takes seconds of CPU on a 49k-token vocabulary, in each of the
three processes that open the file. Tensor data stays memory-mapped. No torch here.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # v1 counted in 32 bits; llama.cpp itself no longer writes it
_DEFAULT_ALIGNMENT = 32
# The storage types the worker dequantizes (evenflow/worker/gguf_weights.py); any other is refused at start.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


class GGUFFileError(ValueError):
    """A GGUF file that cannot be served; the message names the file and the reason."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor directory."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch (row-major) order: ggml's ne reversed
    offset: int  # absolute, in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's header; ``tensor_bytes`` maps a tensor's blocks from the file."""

    path: Path
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def tensor_bytes(self, info: GGUFTensorInfo) -> np.ndarray:
        """The stored bytes as uint8 (rows..., bytes per row): ``gguf.quants.dequantize`` reads this."""
        data = np.memmap(self.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
        return data.reshape(*info.shape[:-1], -1) if info.shape else data


def is_gguf_path(model: str | Path) -> bool:
    """Whether ``--model`` names a GGUF file (by its suffix, or by its magic for a file without one)."""
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        return True
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


class _Cursor:
    """Sequential little-endian reads over the mapped header."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise EOFError
        text = self.buf[self.pos:self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            item_type, n = GGUFValueType(self.scalar("<I")), self.scalar("<Q")
            if item_type in _SCALARS:  # one frombuffer, not n unpacks
                dtype = np.dtype(_SCALARS[item_type].replace("?", "u1"))
                if self.pos + n * dtype.itemsize > len(self.buf):
                    raise EOFError
                items = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)
                self.pos += n * dtype.itemsize
                return items.astype(bool).tolist() if item_type == GGUFValueType.BOOL else items.tolist()
            return [self.value(item_type) for _ in range(n)]
        return self.scalar(_SCALARS[vtype])


def open_gguf(path: str | Path) -> GGUFFile:
    """Parse the header of ``path``; GGUFFileError (file and reason) for anything unreadable."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise GGUFFileError(f"{path}: no such GGUF file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise GGUFFileError(f"{path}: not a GGUF file (no GGUF magic at its start)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                metadata, tensors = _parse(path, _Cursor(buf), size)
            except (EOFError, struct.error):
                raise GGUFFileError(f"{path}: truncated: the header ends before its last field") from None
            except (ValueError, KeyError) as e:
                raise GGUFFileError(f"{path}: corrupt header ({e})") from None
    return GGUFFile(path, metadata, tensors)


def _parse(path: Path, cur: _Cursor, size: int) -> tuple[dict[str, Any], list[GGUFTensorInfo]]:
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in _VERSIONS:
        raise GGUFFileError(f"{path}: GGUF version {version} is not supported (only {_VERSIONS}, little-endian)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    raw: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
        raw.append((name, tuple(reversed(dims)), cur.scalar("<I"), cur.scalar("<Q")))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, shape, type_id, offset in raw:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFFileError(f"{path}: tensor {name!r} has unknown ggml type id {type_id}") from None
        tensors.append(GGUFTensorInfo(name, qtype, shape, data_start + offset, _nbytes(path, name, shape, qtype)))
    for t in tensors:
        if t.offset + t.nbytes > size:
            raise GGUFFileError(f"{path}: truncated: tensor {t.name!r} ends at byte {t.offset + t.nbytes} but the "
                                f"file has {size} bytes")
    return metadata, tensors


def _nbytes(path: Path, name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    block, type_size = GGML_QUANT_SIZES[qtype]
    elements = int(np.prod(shape)) if shape else 1
    if shape and shape[-1] % block:
        raise GGUFFileError(f"{path}: tensor {name!r} has rows of {shape[-1]}, not a multiple of the "
                            f"{qtype.name} block ({block})")
    return elements // block * type_size


def check_tensor_types(gguf_file: GGUFFile) -> None:
    """Refuse a file holding a storage type the worker cannot dequantize, naming the type."""
    for t in gguf_file.tensors:
        if t.qtype.name not in SUPPORTED_TENSOR_TYPES:
            raise GGUFFileError(f"{gguf_file.path}: tensor {t.name!r} is stored as {t.qtype.name}, which evenflow "
                                f"does not load (supported: {', '.join(SUPPORTED_TENSOR_TYPES)})")
