"""One pass over a GGUF file's header: its metadata and its tensor table, read once per engine.

The gguf package's ``GGUFReader`` builds a numpy view for every element of every metadata
array: for a vocabulary of 49,152 tokens and as many merges that is millions of views, seconds
per parse, and transformers' config and tokenizer loaders each ran one more. Here the header is
walked with ``struct`` over a memory map instead (a fraction of a second); the result is plain
Python values, kept on the model config, and the tensors' bytes are mapped only when the
weights are read.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32  # what llama.cpp uses when general.alignment is absent
_STRING, _ARRAY = 8, 9
# GGUF metadata value type -> struct format of one fixed-size value
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# Plain (not block-quantised) tensor types: ggml type -> numpy dtype of one element. BF16 has no
# numpy dtype; like every block type it is read as bytes and left to gguf.dequantize.
_PLAIN_TENSOR_DTYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
                        28: np.float64}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: the slowest-moving dimension first (GGUF stores the reverse)
    ggml_type: int  # a gguf.GGMLQuantizationType value
    offset: int  # of its first byte in the file


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata (``{key: value}``; arrays as lists) and tensor table."""

    path: Path
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]

    @property
    def architecture(self) -> str:
        architecture = self.metadata.get("general.architecture")
        if not isinstance(architecture, str):
            raise ValueError(f"GGUF file {self.path} has no general.architecture metadata")
        return architecture

    @classmethod
    def read(cls, path: Path) -> "GGUFFile":
        """Parse ``path``'s header; a ValueError naming the file when it is not a readable GGUF."""
        path = Path(path)
        try:
            with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
                return _HeaderReader(view, path).read()
        except (struct.error, UnicodeDecodeError, OverflowError, ValueError) as error:
            raise ValueError(f"cannot read the GGUF file {path}: {type(error).__name__}: {error}") from error
        except OSError as error:
            raise ValueError(f"cannot read the GGUF file {path}: {error.strerror or error}") from error

    def tensor_arrays(self) -> list[tuple[GGUFTensorInfo, np.ndarray]]:
        """Each tensor's data as a read-only view of the memory-mapped file, shaped as
        ``gguf.dequantize`` takes it: elements for plain types, bytes per row for block types."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        blob = np.memmap(self.path, dtype=np.uint8, mode="r")
        arrays = []
        for info in self.tensors:
            quant_type = GGMLQuantizationType(info.ggml_type)
            block_size, block_bytes = GGML_QUANT_SIZES[quant_type]
            num_bytes = int(np.prod(info.shape, dtype=np.int64)) * block_bytes // block_size
            raw = blob[info.offset:info.offset + num_bytes]
            if len(raw) != num_bytes:
                raise ValueError(f"GGUF file {self.path} is truncated: tensor {info.name} ends past the file's end")
            dtype = _PLAIN_TENSOR_DTYPES.get(info.ggml_type)
            if dtype is None:
                arrays.append((info, raw.reshape(quant_shape_to_byte_shape(info.shape, quant_type))))
            else:
                arrays.append((info, raw.view(dtype).reshape(info.shape)))
        return arrays


class _HeaderReader:
    def __init__(self, view: mmap.mmap, path: Path):
        self.view, self.path, self.position = view, path, 0

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.view, self.position)
        self.position += struct.calcsize("<" + fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("Q")
        start, self.position = self.position, self.position + length
        if self.position > len(self.view):
            raise ValueError("a string runs past the end of the file")
        return self.view[start:self.position].decode("utf-8")

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            element_type, count = self._unpack("IQ")
            if element_type == _STRING:
                return [self._string() for _ in range(count)]
            if element_type in _SCALAR_FORMATS:
                fmt = "<" + _SCALAR_FORMATS[element_type]
                values = np.frombuffer(self.view, dtype=np.dtype(fmt), count=count, offset=self.position)
                self.position += values.nbytes
                return values.tolist()
            if element_type == _ARRAY:  # nested arrays: rare, read element by element
                return [self._value(_ARRAY) for _ in range(count)]
            raise ValueError(f"unknown GGUF array element type {element_type}")
        if value_type in _SCALAR_FORMATS:
            return self._unpack(_SCALAR_FORMATS[value_type])[0]
        raise ValueError(f"unknown GGUF metadata value type {value_type}")

    def read(self) -> GGUFFile:
        if self.view[:4] != _MAGIC:
            raise ValueError("it does not start with the GGUF magic bytes")
        self.position = 4
        version, num_tensors, num_metadata = self._unpack("IQQ")
        if version not in _SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (only {_SUPPORTED_VERSIONS})")
        metadata: dict[str, Any] = {}
        for _ in range(num_metadata):
            key = self._string()
            (value_type,) = self._unpack("I")
            metadata[key] = self._value(value_type)
        entries = []
        for _ in range(num_tensors):
            name = self._string()
            (num_dims,) = self._unpack("I")
            dims = self._unpack(f"{num_dims}Q")
            ggml_type, relative_offset = self._unpack("IQ")
            entries.append((name, tuple(reversed(dims)), ggml_type, relative_offset))
        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0:
            raise ValueError(f"general.alignment must be a positive integer, got {alignment!r}")
        data_start = -(-self.position // alignment) * alignment
        names = [name for name, *_ in entries]
        if len(set(names)) != len(names):
            raise ValueError("it names a tensor twice")
        tensors = tuple(GGUFTensorInfo(name, shape, ggml_type, data_start + offset)
                        for name, shape, ggml_type, offset in entries)
        return GGUFFile(self.path, metadata, tensors)
