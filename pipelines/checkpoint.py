"""Sharded safetensors checkpoints (Hugging Face layout), read lazily, written atomically."""
from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import PipelineError

INDEX = "model.safetensors.index.json"


class Checkpoint:
    """Tensor-by-tensor access to a snapshot folder; nothing is read until asked for."""

    def __init__(self, root: Path):
        self.root = Path(root)
        index = self.root / INDEX
        if index.exists():
            try:
                self.weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise PipelineError(f"{index}: not a safetensors index ({e})") from None
        else:
            single = self.root / "model.safetensors"
            if not single.exists():
                raise PipelineError(f"{self.root}: no {INDEX} or model.safetensors")
            with safe_open(single, "pt") as f:
                self.weight_map = {k: single.name for k in f.keys()}
        self._handles: dict[str, object] = {}

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

    def _handle(self, fname: str):
        if fname not in self._handles:
            path = self.root / fname
            try:
                self._handles[fname] = safe_open(path, "pt")
            except FileNotFoundError:
                raise PipelineError(f"{path}: shard missing (named in {INDEX})") from None
            except Exception as e:  # safetensors raises its own error types for truncation
                raise PipelineError(f"{path}: unreadable safetensors shard ({e})") from None
        return self._handles[fname]

    def get(self, name: str, check_finite: bool = True) -> torch.Tensor:
        if name not in self.weight_map:
            raise PipelineError(f"{self.root}: tensor {name} not found")
        # safetensors hands out views of a private mmap that the cached handle reuses: an in-place
        # edit by a caller would change what the next get() of this tensor returns. Copy.
        t = self._handle(self.weight_map[name]).get_tensor(name).clone()
        if check_finite and t.is_floating_point() and not torch.isfinite(t.float()).all():
            raise PipelineError(f"{self.root / self.weight_map[name]}: tensor {name} contains NaN or Inf")
        return t

    def shape(self, name: str) -> list[int]:
        return list(self._handle(self.weight_map[name]).get_slice(name).get_shape())

    def num_params(self) -> int:
        return sum(math.prod(self.shape(k)) for k in self.weight_map)


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


def write_sharded(folder: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int, metadata=None) -> list[str]:
    """Write tensors as sorted shards (+ index when more than one). Returns the file names."""
    sizes = {k: v.numel() * v.element_size() for k, v in tensors.items()}
    plan = shard_plan(sizes, max_shard_bytes)
    names = shard_names(len(plan))
    weight_map = {}
    for fname, keys in zip(names, plan):
        save_file({k: tensors[k].contiguous() for k in keys}, str(folder / fname), metadata=metadata or {"format": "pt"})
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


def fsync_tree(folder: Path) -> None:
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
