"""Pinned sources: a model YAML names repo, revision and the sha256 of every file.

Resolution order for the local snapshot: an explicit path, `$MOSSQUANT_MODEL_PATH_<NAME>`
(NAME upper-cased, '-' -> '_'), the model YAML's optional `path:`, the Hugging Face cache layout
(`$HF_HUB_CACHE` or `$HF_HOME/hub` or `~/.cache/huggingface/hub`, `models--org--name/snapshots/<revision>`),
and for built-in fixtures `artifacts/fixtures/<name>` (built on demand). Every pinned file is
hashed (streamed) before use; nothing is ever downloaded.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .checkpoint import canonical_json, sha256_file
from .errors import PipelineError

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
ARTIFACTS = Path(os.environ.get("MOSSQUANT_ARTIFACTS", ROOT / "artifacts"))
MODEL_KEYS = {"name", "kind", "repo", "revision", "fixture", "files", "description", "codec", "path"}


@dataclass
class ModelSpec:
    name: str
    kind: str  # "generator" | "codec"
    repo: str
    revision: str
    files: dict[str, str] = field(default_factory=dict)
    fixture: str | None = None
    description: str = ""
    codec: str | None = None  # a generator's companion codec model (for codec profiles)
    path: str | None = None  # optional local snapshot folder (absolute, or relative to the YAML's folder)
    yaml_path: Path | None = None

    def pins(self) -> dict:
        return {"repo": self.repo, "revision": self.revision, "files": dict(sorted(self.files.items()))}


def model_yaml(name: str) -> Path:
    return CONFIGS / "models" / f"{name}.yaml"


def known_models() -> list[str]:
    return sorted(p.stem for p in (CONFIGS / "models").glob("*.yaml"))


def load_model_spec(name: str) -> ModelSpec:
    path = model_yaml(name)
    if not path.exists():
        raise PipelineError(f"unknown model {name!r}: no {path.relative_to(ROOT)} (known: {', '.join(known_models())})")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise PipelineError(f"{path}: malformed YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise PipelineError(f"{path}: expected a mapping at the top level")
    unknown = set(data) - MODEL_KEYS
    if unknown:
        raise PipelineError(f"{path}: unknown key {sorted(unknown)[0]!r} (allowed: {', '.join(sorted(MODEL_KEYS))})")
    for key in ("repo", "revision", "kind"):
        if not isinstance(data.get(key), str):
            raise PipelineError(f"{path}: key {key!r} must be a string")
    if data["kind"] not in ("generator", "codec"):
        raise PipelineError(f"{path}: kind must be 'generator' or 'codec', got {data['kind']!r}")
    if data.get("path") is not None and not isinstance(data["path"], str):
        raise PipelineError(f"{path}: key 'path' must be a string (a local snapshot folder)")
    files = data.get("files") or {}
    if not isinstance(files, dict) or not all(isinstance(v, str) and len(v) == 64 for v in files.values()):
        raise PipelineError(f"{path}: files must map file names to 64-hex sha256 strings")
    return ModelSpec(name=data.get("name", name), kind=data["kind"], repo=data["repo"], revision=data["revision"],
                     files=files, fixture=data.get("fixture"), description=data.get("description", ""), codec=data.get("codec"),
                     path=data.get("path"), yaml_path=path)


def _hf_cache_candidates(spec: ModelSpec) -> list[Path]:
    roots = []
    if os.environ.get("HF_HUB_CACHE"):
        roots.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        roots.append(Path(os.environ["HF_HOME"]) / "hub")
    roots.append(Path.home() / ".cache" / "huggingface" / "hub")
    folder = "models--" + spec.repo.replace("/", "--")
    out = []
    for root in roots:
        snap = root / folder / "snapshots" / spec.revision
        ref = root / folder / "refs" / spec.revision
        if ref.exists():  # a branch or tag name: the ref file holds the commit
            snap = root / folder / "snapshots" / ref.read_text().strip()
        out.append(snap)
    return out


def env_var(name: str) -> str:
    return "MOSSQUANT_MODEL_PATH_" + name.upper().replace("-", "_")


def resolve_path(spec: ModelSpec, explicit: str | Path | None = None) -> Path:
    """The local snapshot folder for a model spec, or one line saying where we looked."""
    looked = []
    if explicit:
        return Path(explicit)
    if os.environ.get(env_var(spec.name)):
        return Path(os.environ[env_var(spec.name)])
    looked.append(f"${env_var(spec.name)}")
    if spec.path:
        local = Path(spec.path).expanduser()
        local = local if local.is_absolute() else (spec.yaml_path.parent if spec.yaml_path else CONFIGS / "models") / local
        if local.is_dir():
            return local
        looked.append(f"{local} (the YAML's path)")
    for cand in _hf_cache_candidates(spec):
        if cand.is_dir():
            return cand
        looked.append(str(cand))
    if spec.fixture:
        path = ARTIFACTS / "fixtures" / spec.name
        if not path.exists():
            build_fixture(spec, path)
        return path
    raise PipelineError(
        f"model {spec.name!r} ({spec.repo}@{spec.revision}) not found locally; looked in {', '.join(looked)}; "
        f"set {env_var(spec.name)}=/path/to/snapshot (or pass --model-path), or use MODEL=tiny for the built-in fixture"
    )


def build_fixture(spec: ModelSpec, path: Path) -> Path:
    from .fixtures import write_any_fixture

    return write_any_fixture(spec.fixture, path)


def verify(spec: ModelSpec, path: Path) -> dict[str, str]:
    """Hash every pinned file; refuse on a missing file, a mismatch or an unpinned source."""
    if not spec.files:
        raise PipelineError(
            f"{spec.yaml_path}: no file pins for {spec.repo}@{spec.revision}; "
            f"run `mossquant pin {spec.name} /path/to/snapshot` once to pin it"
        )
    if not path.is_dir():
        raise PipelineError(f"{path}: not a directory (model {spec.name})")
    from .progress import progress

    for fname, want in progress(sorted(spec.files.items()), desc=f"verify {spec.name}", unit="file"):
        f = path / fname
        if not f.is_file():
            raise PipelineError(f"{f}: missing (pinned in {spec.yaml_path.name})")
        got = sha256_file(f)
        if got != want:
            raise PipelineError(f"{f}: sha256 {got[:12]}… does not match the pin {want[:12]}… in {spec.yaml_path.name}")
    return dict(spec.files)


def snapshot_files(path: Path) -> list[str]:
    skip = {".gitattributes"}
    return sorted(
        str(p.relative_to(path)) for p in path.rglob("*")
        if p.is_file() and p.name not in skip and ".cache" not in p.parts and not p.name.startswith(".")
    )


def pin(name: str, path: Path) -> Path:
    """Compute the sha256 of every file in a local snapshot and write them into the model YAML."""
    spec = load_model_spec(name)
    path = Path(path)
    if not path.is_dir():
        raise PipelineError(f"{path}: not a directory")
    files = {f: sha256_file(path / f) for f in snapshot_files(path)}
    if not files:
        raise PipelineError(f"{path}: no files to pin")
    text = spec.yaml_path.read_text()
    data = yaml.safe_load(text)
    data["files"] = files
    head = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    tmp = spec.yaml_path.with_suffix(".yaml.tmp")
    tmp.write_text(head + yaml.safe_dump(data, sort_keys=False))
    os.replace(tmp, spec.yaml_path)
    return spec.yaml_path


def pins_digest(spec: ModelSpec) -> str:
    import hashlib

    return hashlib.sha256(canonical_json(spec.pins()).encode()).hexdigest()
