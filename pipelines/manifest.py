"""A bundle's manifest.json: the one reader (schema-checked), the verifier (hashes and stray
files) and the newest bundle of a model/profile.

The manifest is reproducible (a rebuild must give it back), so it cannot say when it was made:
the build order lives beside the bundles, in `<model>/<profile>/index.json`, appended by export.
"""
from __future__ import annotations

import json
from pathlib import Path

from .atomic import atomic_file
from .checkpoint import canonical_json, sha256_file
from .errors import PipelineError

SCHEMA = "moss-quant/manifest/v1"
FILE = "manifest.json"
INDEX = "index.json"
# What every reader relies on (the report checks the figures it shows itself).
REQUIRED = {"schema": str, "model": str, "profile": str, "version": str, "status": str, "files": dict}


def read(path: Path) -> dict:
    """The manifest of bundle folder `path`, checked for the keys every reader relies on."""
    f = Path(path) / FILE
    try:
        m = json.loads(f.read_text())
    except FileNotFoundError:
        raise PipelineError(f"{f}: missing (not a moss-quant bundle)") from None
    except ValueError as e:
        raise PipelineError(f"{f}: invalid JSON ({e})") from None
    if not isinstance(m, dict):
        raise PipelineError(f"{f}: expected a JSON object")
    if m.get("schema") != SCHEMA:
        raise PipelineError(f"{f}: schema {m.get('schema')!r}, expected {SCHEMA!r}")
    for key, kind in REQUIRED.items():
        if not isinstance(m.get(key), kind):
            raise PipelineError(f"{f}: key {key!r} missing or not a {kind.__name__}")
    for name, info in m["files"].items():
        if not (isinstance(info, dict) and isinstance(info.get("sha256"), str) and isinstance(info.get("size"), int)):
            raise PipelineError(f"{f}: files.{name} must hold sha256 and size")
    return m


def verify(path: Path) -> dict:
    """Re-hash every file the manifest lists and refuse any file it does not list."""
    path = Path(path)
    m = read(path)
    present = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()} - {FILE}
    stray = sorted(present - set(m["files"]))
    if stray:  # cheap checks first
        raise PipelineError(f"{path / stray[0]}: not listed in {FILE} (a bundle holds only what its manifest names)")
    for name, info in sorted(m["files"].items()):
        f = path / name
        if not f.is_file():
            raise PipelineError(f"{f}: missing (listed in {FILE})")
        if f.stat().st_size != info["size"] or sha256_file(f) != info["sha256"]:
            raise PipelineError(f"{f}: content does not match {FILE} (size or sha256)")
    return m


def record(folder: Path, version: str) -> None:
    """Append `version` to the build order of `folder` (<model>/<profile>/), atomically."""
    index = folder / INDEX
    order = _order(folder)
    if version in order:
        order.remove(version)
    order.append(version)
    with atomic_file(index, replace=True) as tmp:
        tmp.write_text(canonical_json({"versions": order}, indent=2))


def _order(folder: Path) -> list[str]:
    try:
        return list(json.loads((folder / INDEX).read_text())["versions"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return []


def bundles(folder: Path) -> list[Path]:
    """The bundles under `folder` (<model>/<profile>/), oldest first, by the recorded build order."""
    folder = Path(folder)
    present = {p.name: p for p in folder.glob("v1-*") if (p / FILE).exists()}
    order = [v for v in _order(folder) if v in present]
    # bundles the index does not list were written before it (or by hand): older than any it records
    return [present[v] for v in sorted(set(present) - set(order)) + order]


def newest(folder: Path) -> Path | None:
    found = bundles(folder)
    return found[-1] if found else None
