"""Reader and writer of the safetensors format, in plain numpy (no torch, no JAX).

Why our own: the ``safetensors`` package's numpy backend cannot hand out ``F8_E8M0`` tensors
(the ue8m0 block scales of the DeepSeek-V4.1 checkpoint). Here every dtype of the checkpoint
maps to a numpy dtype:

=========  =====================================================================
file       numpy
=========  =====================================================================
BF16       ``ml_dtypes.bfloat16``
F16, F32,  ``float16``, ``float32``, ``float64``
F64
F8_E4M3    ``ml_dtypes.float8_e4m3fn``
F8_E5M2    ``ml_dtypes.float8_e5m2``
F8_E8M0    **``uint8``** -- the raw biased exponent byte (value ``2**(e-127)``, see
           ``quant_formats.e8m0_to_float``). ``write_safetensors`` writes a uint8 (or
           ``ml_dtypes.float8_e8m0fnu``) array as F8_E8M0 when ``dtypes[name] == "F8_E8M0"``.
I8 .. I64  ``int8`` .. ``int64`` (fp4 e2m1 pairs are stored as I8, see ``quant_formats``)
U8 .. U64  ``uint8`` .. ``uint64``
BOOL       ``bool``
=========  =====================================================================

File layout: 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``
(offsets relative to the end of the header), then the raw little-endian tensor bytes.

Reading is zero-copy: ``SafetensorsFile.get`` returns a read-only view of a ``np.memmap`` of the
file, so opening a shard and reading one tensor touches only that tensor's pages.

Writing: ``write_safetensors`` (one file from a dict), ``write_sharded`` (several
``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``) and
``write_sharded_lazy`` (the same, but tensors are produced one at a time by a callback from a
list of (name, dtype, shape) -- memory stays at one tensor).
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any, Callable, Iterator, Mapping, Sequence

import ml_dtypes
import numpy as np

__all__ = [
    "DTYPE_TO_NUMPY",
    "SafetensorsFile",
    "CheckpointReader",
    "open_checkpoint_dir",
    "write_safetensors",
    "write_sharded",
    "write_sharded_lazy",
    "safetensors_dtype_of",
    "dtype_itemsize",
    "tensor_nbytes",
    "INDEX_FILE",
]

INDEX_FILE = "model.safetensors.index.json"

# file dtype string -> numpy dtype that ``get`` returns
DTYPE_TO_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(np.uint8),  # raw exponent byte
}

# numpy dtype -> default file dtype string
_NUMPY_TO_DTYPE: dict[np.dtype, str] = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint16): "U16",
    np.dtype(np.int16): "I16",
    np.dtype(np.uint32): "U32",
    np.dtype(np.int32): "I32",
    np.dtype(np.uint64): "U64",
    np.dtype(np.int64): "I64",
    np.dtype(np.float16): "F16",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(ml_dtypes.float8_e5m2): "F8_E5M2",
    np.dtype(ml_dtypes.float8_e8m0fnu): "F8_E8M0",
}

# Explicit ``dtypes`` overrides that reinterpret the array's bytes (same itemsize, raw bytes):
# file dtype -> numpy dtypes accepted for it besides its own.
_ALLOWED_OVERRIDES: dict[str, tuple[np.dtype, ...]] = {
    "F8_E8M0": (np.dtype(np.uint8), np.dtype(ml_dtypes.float8_e8m0fnu)),
    "I8": (np.dtype(np.uint8),),
    "U8": (np.dtype(np.int8),),
}


def dtype_itemsize(dtype: str) -> int:
    if dtype not in DTYPE_TO_NUMPY:
        raise ValueError(f"unknown safetensors dtype {dtype!r}; known: {sorted(DTYPE_TO_NUMPY)}")
    return DTYPE_TO_NUMPY[dtype].itemsize


def tensor_nbytes(dtype: str, shape: Sequence[int]) -> int:
    return dtype_itemsize(dtype) * math.prod(int(s) for s in shape)


def safetensors_dtype_of(arr: np.ndarray, override: str | None = None, name: str = "?") -> str:
    """The file dtype string for ``arr`` (``override`` if given and compatible)."""
    dt = np.dtype(arr.dtype).newbyteorder("=") if arr.dtype.byteorder == ">" else np.dtype(arr.dtype)
    if override is not None:
        if override not in DTYPE_TO_NUMPY:
            raise ValueError(f"tensor {name!r}: unknown safetensors dtype {override!r}")
        own = _NUMPY_TO_DTYPE.get(dt)
        if own == override or dt in _ALLOWED_OVERRIDES.get(override, ()):
            return override
        raise ValueError(
            f"tensor {name!r}: numpy dtype {dt} cannot be written as {override} "
            f"(allowed: {own} or a raw reinterpretation among {_ALLOWED_OVERRIDES.get(override, ())})"
        )
    if dt not in _NUMPY_TO_DTYPE:
        raise ValueError(f"tensor {name!r}: numpy dtype {dt} has no safetensors equivalent")
    return _NUMPY_TO_DTYPE[dt]


# =============================================================================== reading


class SafetensorsFile:
    """One ``.safetensors`` file, memory-mapped read-only.

    ``keys()`` lists the tensor names in file order, ``spec(name)`` gives ``(dtype_str, shape)``
    without touching data, ``get(name)`` a zero-copy read-only numpy view. A corrupt header or a
    file shorter than its header promises raises ``ValueError`` naming the file.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            file_size = os.path.getsize(self.path)
        except OSError as e:
            raise ValueError(f"{self.path}: cannot open safetensors file ({e})") from None
        if file_size < 8:
            raise ValueError(f"{self.path}: truncated safetensors file ({file_size} bytes, no header length)")
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > file_size - 8:
                raise ValueError(
                    f"{self.path}: corrupt safetensors header: header length {n} exceeds the file "
                    f"size {file_size} (truncated file?)"
                )
            raw = f.read(n)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{self.path}: corrupt safetensors header (not valid JSON: {e})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        self._data_start = 8 + n
        data_size = file_size - self._data_start
        meta = header.pop("__metadata__", None)
        if meta is not None and not isinstance(meta, dict):
            raise ValueError(f"{self.path}: corrupt safetensors header (__metadata__ is not an object)")
        self.metadata: dict[str, str] = dict(meta or {})
        self._specs: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            try:
                dtype = info["dtype"]
                shape = tuple(int(s) for s in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (TypeError, KeyError, ValueError) as e:
                raise ValueError(f"{self.path}: corrupt safetensors header entry for {name!r} ({e!r})") from None
            if dtype not in DTYPE_TO_NUMPY:
                raise ValueError(f"{self.path}: tensor {name!r} has unknown dtype {dtype!r}")
            if any(s < 0 for s in shape):
                raise ValueError(f"{self.path}: tensor {name!r} has a negative dimension {list(shape)}")
            want = tensor_nbytes(dtype, shape)
            if begin < 0 or end - begin != want:
                raise ValueError(
                    f"{self.path}: corrupt safetensors header: tensor {name!r} {dtype} {list(shape)} "
                    f"needs {want} bytes but data_offsets are [{begin}, {end}]"
                )
            if end > data_size:
                raise ValueError(
                    f"{self.path}: truncated safetensors file: tensor {name!r} ends at data byte {end} "
                    f"but the file holds only {data_size} data bytes"
                )
            self._specs[name] = (dtype, shape, begin, end)
        self._mmap: np.memmap | None = None

    # -- mapping-like API
    def keys(self) -> list[str]:
        return list(self._specs)

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __len__(self) -> int:
        return len(self._specs)

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def spec(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(file dtype string, shape) of a tensor, without reading its data."""
        try:
            dtype, shape, _, _ = self._specs[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None
        return dtype, shape

    def nbytes(self, name: str) -> int:
        _, _, b, e = self._specs[name]
        return e - b

    def _map(self) -> np.memmap:
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mmap

    def get(self, name: str) -> np.ndarray:
        """The tensor as a zero-copy, read-only numpy array (F8_E8M0 -> raw uint8 exponents)."""
        try:
            dtype, shape, begin, end = self._specs[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None
        npdt = DTYPE_TO_NUMPY[dtype]
        if begin == end:
            return np.zeros(shape, dtype=npdt)
        raw = self._map()[self._data_start + begin : self._data_start + end]
        return raw.view(npdt).reshape(shape).view(np.ndarray)

    def get_slice(self, name: str, index: Any) -> np.ndarray:
        """``get(name)[index]`` (basic slicing stays a view of the mapped file)."""
        return self.get(name)[index]

    def close(self) -> None:
        """Drop our reference to the map (arrays already handed out keep it alive)."""
        self._mmap = None

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsFile({self.path!r}, {len(self)} tensors)"


class CheckpointReader:
    """All tensors of a checkpoint directory (one or more shards), by name."""

    def __init__(self, directory: str | os.PathLike, files: Mapping[str, SafetensorsFile],
                 where: Mapping[str, str]):
        self.directory = os.fspath(directory)
        self._files = dict(files)  # file name -> SafetensorsFile
        self._where = dict(where)  # tensor name -> file name

    @property
    def files(self) -> list[str]:
        return list(self._files)

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __len__(self) -> int:
        return len(self._where)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def file_of(self, name: str) -> str:
        try:
            return os.path.join(self.directory, self._where[name])
        except KeyError:
            raise KeyError(f"{self.directory}: checkpoint has no tensor named {name!r}") from None

    def _file(self, name: str) -> SafetensorsFile:
        try:
            return self._files[self._where[name]]
        except KeyError:
            raise KeyError(f"{self.directory}: checkpoint has no tensor named {name!r}") from None

    def spec(self, name: str) -> tuple[str, tuple[int, ...]]:
        return self._file(name).spec(name)

    def get(self, name: str) -> np.ndarray:
        return self._file(name).get(name)

    def get_slice(self, name: str, index: Any) -> np.ndarray:
        return self._file(name).get_slice(name, index)

    @property
    def metadata(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for f in self._files.values():
            out.update(f.metadata)
        return out

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({self.directory!r}, {len(self._files)} files, {len(self)} tensors)"


def open_checkpoint_dir(directory: str | os.PathLike) -> CheckpointReader:
    """Open every shard of a checkpoint directory.

    With ``model.safetensors.index.json`` the shards are those its ``weight_map`` names, and
    every tensor must sit in the file the index says (and no shard may hold a tensor the index
    does not list). Without an index every ``*.safetensors`` file of the directory is a shard.
    A tensor name found in two shards raises ``ValueError`` naming the tensor and both files.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise ValueError(f"checkpoint directory not found: {directory}")
    index_path = os.path.join(directory, INDEX_FILE)
    weight_map: dict[str, str] | None = None
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                idx = json.load(f)
            weight_map = dict(idx["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{index_path}: corrupt index file ({e!r})") from None
        names = sorted(set(weight_map.values()))
        for n in names:
            if not os.path.isfile(os.path.join(directory, n)):
                raise ValueError(f"{index_path}: weight_map names shard {n!r}, which does not exist")
    else:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
        if not names:
            raise ValueError(f"{directory}: no *.safetensors files")
    files = {n: SafetensorsFile(os.path.join(directory, n)) for n in names}
    where: dict[str, str] = {}
    for n, sf in files.items():
        for key in sf.keys():
            if key in where:
                raise ValueError(
                    f"{directory}: tensor {key!r} appears in two shards: {where[key]!r} and {n!r}"
                )
            where[key] = n
    if weight_map is not None:
        for key, n in weight_map.items():
            if where.get(key) != n:
                found = where.get(key)
                raise ValueError(
                    f"{index_path}: weight_map puts tensor {key!r} in {n!r}, but "
                    + (f"it is in {found!r}" if found else "no shard holds it")
                )
        extra = [k for k in where if k not in weight_map]
        if extra:
            raise ValueError(
                f"{index_path}: shard {where[extra[0]]!r} holds tensor {extra[0]!r}, which the "
                f"index does not list ({len(extra)} such tensors)"
            )
        # keep the index's order
        where = {k: weight_map[k] for k in weight_map}
    return CheckpointReader(directory, files, where)


# =============================================================================== writing


def _header_bytes(entries: Sequence[tuple[str, str, tuple[int, ...]]],
                  metadata: Mapping[str, str] | None) -> bytes:
    header: dict[str, Any] = {}
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ValueError(f"safetensors metadata must map str -> str, got {k!r}: {v!r}")
        header["__metadata__"] = dict(metadata)
    off = 0
    for name, dtype, shape in entries:
        if name == "__metadata__":
            raise ValueError("'__metadata__' is reserved and cannot be a tensor name")
        nb = tensor_nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": [int(s) for s in shape], "data_offsets": [off, off + nb]}
        off += nb
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # align the data to 8 bytes, as the official writer does
    return raw


def _as_le_bytes(arr: np.ndarray) -> np.ndarray:
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    arr = np.ascontiguousarray(arr)
    return arr.reshape(-1).view(np.uint8)


def _write_file(path: str, entries: Sequence[tuple[str, str, tuple[int, ...]]],
                produce: Callable[[str], np.ndarray], metadata: Mapping[str, str] | None,
                on_tensor: Callable[[str], None] | None = None) -> None:
    header = _header_bytes(entries, metadata)
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for name, dtype, shape in entries:
                arr = np.asarray(produce(name))
                if tuple(arr.shape) != tuple(shape):
                    raise ValueError(f"tensor {name!r}: produced shape {list(arr.shape)}, declared {list(shape)}")
                got = safetensors_dtype_of(arr, dtype, name)
                assert got == dtype
                u8 = _as_le_bytes(arr)
                if u8.size:
                    f.write(memoryview(u8))
                if on_tensor is not None:
                    on_tensor(name)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                      dtypes: Mapping[str, str] | None = None,
                      metadata: Mapping[str, str] | None = None) -> str:
    """Write one ``.safetensors`` file (tensors in the dict's order).

    ``dtypes[name]`` overrides the file dtype: ``"F8_E8M0"`` for a uint8 array of raw ue8m0
    exponents, ``"I8"``/``"U8"`` to reinterpret int8/uint8 bytes. Other numpy dtypes map
    directly (bfloat16 -> BF16, float8_e4m3fn -> F8_E4M3, int8 -> I8, ...).
    """
    path = os.fspath(path)
    dtypes = dict(dtypes or {})
    entries = []
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        entries.append((name, safetensors_dtype_of(arr, dtypes.get(name), name), tuple(arr.shape)))
    _write_file(path, entries, lambda n: tensors[n], metadata)
    return path


def shard_file_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def plan_shards(entries: Sequence[tuple[str, str, tuple[int, ...]]], max_shard_bytes: int
                ) -> list[list[tuple[str, str, tuple[int, ...]]]]:
    """Greedy packing in order: a new shard starts when the next tensor would overflow."""
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    shards: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]
    size = 0
    for e in entries:
        nb = tensor_nbytes(e[1], e[2])
        if shards[-1] and size + nb > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += nb
    return shards


def write_sharded_lazy(directory: str | os.PathLike,
                       entries: Sequence[tuple[str, str, Sequence[int]]],
                       produce: Callable[[str], np.ndarray],
                       max_shard_bytes: int = 2**30,
                       metadata: Mapping[str, str] | None = None,
                       on_tensor: Callable[[str], None] | None = None) -> list[str]:
    """Write ``model-0000i-of-0000n.safetensors`` shards + ``model.safetensors.index.json``.

    ``entries`` = [(name, file dtype, shape)] in file order; ``produce(name)`` is called once per
    tensor, in that order, and must return an array of that shape whose dtype maps to the file
    dtype. Returns the shard paths.
    """
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    ents = [(n, d, tuple(int(s) for s in sh)) for n, d, sh in entries]
    names = [e[0] for e in ents]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"tensor {dup!r} listed twice")
    shards = plan_shards(ents, max_shard_bytes)
    n = len(shards)
    weight_map: dict[str, str] = {}
    paths = []
    total = 0
    for i, shard in enumerate(shards, start=1):
        fname = shard_file_name(i, n)
        path = os.path.join(directory, fname)
        _write_file(path, shard, produce, metadata, on_tensor)
        paths.append(path)
        for name, dtype, shape in shard:
            weight_map[name] = fname
            total += tensor_nbytes(dtype, shape)
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return paths


def write_sharded(directory: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                  max_shard_bytes: int = 2**30, dtypes: Mapping[str, str] | None = None,
                  metadata: Mapping[str, str] | None = None) -> list[str]:
    """``write_safetensors`` split into shards of at most ``max_shard_bytes`` data bytes each
    (a single larger tensor gets a shard of its own), plus the index. Returns the shard paths."""
    dtypes = dict(dtypes or {})
    entries = []
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        entries.append((name, safetensors_dtype_of(arr, dtypes.get(name), name), tuple(arr.shape)))
    return write_sharded_lazy(directory, entries, lambda n: tensors[n], max_shard_bytes, metadata)
