"""Sharded safetensors checkpoints (Hugging Face layout), read lazily, written atomically."""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .errors import PipelineError

INDEX = "model.safetensors.index.json"
# safetensors dtype codes -> torch (what the pipeline reads: fixtures, upstream checkpoints, bundles)
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
CODES = {t: code for code, t in DTYPES.items()}
# safetensors' serializer writes tensors by dtype, its enum's order descending, then by name: written
# in that order a streamed file has the bytes `save_file` gives (tests/test_checkpoint_write.py)
ENUM_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "F16", "BF16", "I32", "F32", "F64", "I64")


@dataclass(frozen=True)
class Lazy:
    """A tensor to write, read only when its turn comes: a file holds one tensor in memory at a time."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]

    @staticmethod
    def of(t: torch.Tensor) -> "Lazy":
        return Lazy(t.dtype, tuple(t.shape), lambda: t)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


READ_CHUNK = 1 << 30  # one read() call returns at most ~2 GiB on Linux


class Checkpoint:
    """Tensor-by-tensor access to a snapshot folder; nothing is read until asked for."""

    def __init__(self, root: Path, single: str = "model.safetensors"):
        self.root = Path(root)
        self._headers: dict[str, tuple[dict, int]] = {}
        index = self.root / INDEX
        if index.exists():
            try:
                self.weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise PipelineError(f"{index}: not a safetensors index ({e})") from None
        else:
            single = self.root / single
            if not single.exists():
                raise PipelineError(f"{self.root}: no {INDEX} or {single.name}")
            self.weight_map = {k: single.name for k in self._header(single.name)[0]}

    def config(self) -> dict:
        path = self.root / "config.json"
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            raise PipelineError(f"{path}: missing") from None
        except ValueError as e:
            raise PipelineError(f"{path}: invalid JSON ({e})") from None

    def keys(self) -> list[str]:
        return sorted(self.weight_map)

    def _header(self, fname: str) -> tuple[dict, int]:
        if fname not in self._headers:
            try:
                self._headers[fname] = safetensors_header(self.root / fname)
            except FileNotFoundError:
                raise PipelineError(f"{self.root / fname}: shard missing (named in {INDEX})") from None
        return self._headers[fname]

    def lazy(self, name: str) -> Lazy:
        info = self._header(self.weight_map[name])[0][name]
        return Lazy(DTYPES[info["dtype"]], tuple(info["shape"]), lambda: self.get(name, check_finite=False))

    def get(self, name: str, check_finite: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor, read into fresh memory or into `out` (contiguous, of its dtype and shape: a
        page-locked buffer, say)."""
        if name not in self.weight_map:
            raise PipelineError(f"{self.root}: tensor {name} not found")
        t = self._read(self.weight_map[name], name, out)
        if check_finite and t.is_floating_point() and not all_finite(t):
            raise PipelineError(f"{self.root / self.weight_map[name]}: tensor {name} contains NaN or Inf")
        return t

    def _read(self, fname: str, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor's bytes read into fresh memory (or `out`). Not safetensors' get_tensor: its tensors are
        views of a private mmap that the cached handle reuses (an in-place edit by a caller would
        change the next read), and the mapped pages count as resident on top of any copy."""
        (header, base), path = self._header(fname), self.root / fname
        if name not in header:
            raise PipelineError(f"{path}: tensor {name} not found (the index names this shard)")
        info = header[name]
        start, end = info["data_offsets"]
        if info["dtype"] not in DTYPES:
            raise PipelineError(f"{path}: tensor {name} has dtype {info['dtype']} (expected one of {', '.join(DTYPES)})")
        dtype, shape = DTYPES[info["dtype"]], info["shape"]
        if out is not None and (out.dtype != dtype or list(out.shape) != shape or not out.is_contiguous()):
            raise ValueError(f"{path}: tensor {name} is {dtype} {shape}, read into {out.dtype} {list(out.shape)}")
        buf = torch.empty(end - start, dtype=torch.uint8) if out is None else out.reshape(-1).view(torch.uint8)
        view, done = memoryview(buf.numpy()), 0
        with open(path, "rb") as f:
            f.seek(base + start)
            while done < len(view):
                got = f.readinto(view[done: done + READ_CHUNK])
                if not got:
                    raise PipelineError(f"{path}: truncated inside tensor {name}")
                done += got
        return buf.view(dtype).reshape(shape)

    def shape(self, name: str) -> list[int]:
        return list(self._header(self.weight_map[name])[0][name]["shape"])

    def num_params(self) -> int:
        return sum(math.prod(self.shape(k)) for k in self.weight_map)


def safetensors_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's tensor entries ({name: dtype, shape, data_offsets}) and where its data
    starts, checked against the file size. FileNotFoundError passes through."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > size - 8:
                raise ValueError(f"header length {n} does not fit in {size} bytes")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        header.pop("__metadata__", None)
        end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, MemoryError, OverflowError) as e:
        raise PipelineError(f"{path}: unreadable safetensors shard (bad header: {e!r})") from None
    if size < 8 + n + end:
        raise PipelineError(f"{path}: unreadable safetensors shard (truncated: {size} bytes, the header needs {8 + n + end})")
    return header, 8 + n


def all_finite(t: torch.Tensor, chunk: int = 1 << 24) -> bool:
    """No NaN/Inf: one min/max reduction, no copy (aminmax propagates a NaN, and an infinity is the
    min or the max); isfinite on float copies was most of a block's load on a CPU (BENCHMARKS.md).
    float8 has no aminmax kernel: float copies, in chunks."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return True
    if t.dtype.itemsize == 1:
        return all(bool(torch.isfinite(c.float()).all()) for c in flat.split(chunk))
    lo, hi = torch.aminmax(flat)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def shard_plan(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Names (sorted) split into consecutive shards of at most max_shard_bytes."""
    shards, cur, cur_bytes = [], [], 0
    for name in sorted(sizes):
        if cur and cur_bytes + sizes[name] > max_shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(name)
        cur_bytes += sizes[name]
    if cur:
        shards.append(cur)
    return shards


def shard_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_safetensors(path: Path, tensors: dict[str, "Lazy | torch.Tensor"], metadata: dict | None = None) -> None:
    """A safetensors file written tensor by tensor (the bytes `save_file` would write, without
    holding the whole file, twice, in memory as it does)."""
    entries = {k: v if isinstance(v, Lazy) else Lazy.of(v) for k, v in tensors.items()}
    order = sorted(entries, key=lambda k: (-ENUM_ORDER.index(CODES[entries[k].dtype]), k))
    # metadata keys sorted: safetensors' own order is a Rust HashMap's, random per process
    header, offset = ({"__metadata__": dict(sorted(metadata.items()))} if metadata else {}), 0
    for k in order:
        e = entries[k]
        header[k] = {"dtype": CODES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for k in order:
            t, e = entries[k].read(), entries[k]
            if t.dtype != e.dtype or tuple(t.shape) != e.shape:
                raise PipelineError(f"{path}: tensor {k} came as {t.dtype} {list(t.shape)}, "
                                    f"expected {e.dtype} {list(e.shape)}")
            f.write(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
            del t


def write_sharded(folder: Path, tensors: dict[str, "Lazy | torch.Tensor"], max_shard_bytes: int, metadata=None) -> list[str]:
    """Write tensors as sorted shards (+ index when more than one), one tensor in memory at a time.
    Returns the file names."""
    tensors = {k: v if isinstance(v, Lazy) else Lazy.of(v) for k, v in tensors.items()}
    sizes = {k: v.nbytes for k, v in tensors.items()}
    plan = shard_plan(sizes, max_shard_bytes)
    names = shard_names(len(plan))
    weight_map = {}
    for fname, keys in zip(names, plan):
        write_safetensors(folder / fname, {k: tensors[k] for k in keys}, metadata or {"format": "pt"})
        weight_map.update({k: fname for k in keys})
    if len(names) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / INDEX).write_text(canonical_json(index, indent=2))
        names.append(INDEX)
    return names


def canonical_json(obj, indent=None) -> str:
    """Sorted keys, fixed separators: the same object always gives the same bytes."""
    if indent is None:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return json.dumps(obj, sort_keys=True, indent=indent, ensure_ascii=False) + "\n"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Streamed: never holds the whole file in memory."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
