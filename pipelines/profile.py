"""Profiles: `configs/profiles/<name>.yaml` lists stages and their parameters.

Every stage's parameters are a small dataclass; the quantize stage's `method` picks the
method's own config dataclass (declared in `quantizers`). Validation names the file, the key
and what is allowed. Stage order is the YAML order; each stage declares what it needs first.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .errors import PipelineError
from .source import CONFIGS, ROOT

PROFILE_KEYS = {"name", "description", "kind", "seed", "stages", "models", "rebuild"}


@dataclass
class RebuildTolerance:
    """When a rebuild whose bytes differ, made in another environment (CPU kernel, GPU, library),
    counts as `equivalent` (pipelines/rebuild.py). Each profile states where its numbers come from.

    The judged figures are the ones the profile's gate checks: each may move by
    `max_metric_rel_delta` of itself plus `gate_margin` of the gate's bound for it."""

    max_code_mismatch: float = 0.0  # fraction of a quantized tensor's integer codes that may differ
    max_metric_rel_delta: float = 0.0
    gate_margin: float = 0.0

    def validate(self):
        for k in ("max_code_mismatch", "max_metric_rel_delta", "gate_margin"):
            if not 0 <= getattr(self, k) <= 1:
                raise ValueError(f"{k}: must be in [0, 1], got {getattr(self, k)}")


@dataclass
class Profile:
    name: str
    kind: str  # "generator" | "codec"
    seed: int
    stages: dict[str, object]  # stage name -> validated params dataclass, in order
    description: str = ""
    rebuild: RebuildTolerance = field(default_factory=RebuildTolerance)
    path: Path | None = None
    raw: dict = field(default_factory=dict)

    def resolved(self) -> dict:
        """The fully resolved recipe (defaults filled in), as plain data."""
        return {
            "name": self.name,
            "kind": self.kind,
            "seed": self.seed,
            "stages": {k: _flat(v) for k, v in self.stages.items()},
            "rebuild": dataclasses.asdict(self.rebuild),
        }


def _flat(params) -> dict:
    """Stage params as a profile would write them (so a recipe.yaml is itself a valid profile)."""
    d = dataclasses.asdict(params)
    if isinstance(d.get("config"), dict) and "method" in d:
        d = {"method": d["method"], "device": d["device"], **d["config"], **({"tables": d["tables"]} if d.get("tables") else {})}
    return d


def parse_overrides(pairs: list[str]) -> dict:
    """`--set stage.key=value` (value as YAML: 64, true, null, [2, 3]) -> {stage: {key: value}}."""
    out: dict = {}
    for pair in pairs:
        target, eq, value = pair.partition("=")
        stage, dot, key = target.partition(".")
        if not eq or not dot or not stage or not key:
            raise PipelineError(f"--set {pair!r}: expected STAGE.KEY=VALUE (e.g. quantize.group_size=64)")
        try:
            out.setdefault(stage, {})[key] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise PipelineError(f"--set {pair!r}: the value is not valid YAML ({' '.join(str(e).split())})") from None
    return out


def _type_ok(value, tp) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin in (list, tuple):
        (inner, *_) = typing.get_args(tp) or (object,)
        return isinstance(value, (list, tuple)) and all(_type_ok(v, inner) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is typing.Any or tp is object:
        return True
    return isinstance(value, tp)


def build_params(cls, data: dict, where: str):
    """Instantiate a params dataclass from YAML data, naming the file/key on any error."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PipelineError(f"{where}: expected a mapping of parameters, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key, value in data.items():
        if key not in names:
            raise PipelineError(f"{where}: unknown key {key!r} (allowed: {', '.join(names)})")
        if not _type_ok(value, hints[key]):
            tname = getattr(hints[key], "__name__", str(hints[key]))
            raise PipelineError(f"{where}.{key}: expected {tname}, got {value!r}")
    try:
        obj = cls(**data)
    except TypeError as e:
        raise PipelineError(f"{where}: {e}") from None
    check = getattr(obj, "validate", None)
    if check:
        try:
            check()
        except ValueError as e:
            raise PipelineError(f"{where}.{e}") from None
    return obj


def profile_path(name: str) -> Path:
    return CONFIGS / "profiles" / f"{name}.yaml"


def known_profiles() -> list[str]:
    return sorted(p.stem for p in (CONFIGS / "profiles").glob("*.yaml"))


def load_profile(name_or_path: str, stage_table: dict, model: str | None = None, overrides: dict | None = None) -> Profile:
    """Load and validate a profile against `stage_table` (pipelines/pipeline.py's stage_table, which
    defines each stage's params); `models: {<model>: {<stage>: {...}}}` overrides per model, and
    `overrides` ({stage: {key: value}}, from `--set`) go on top, checked by the same schema."""

    path = Path(name_or_path) if name_or_path.endswith(".yaml") else profile_path(name_or_path)
    if not path.exists():
        raise PipelineError(f"unknown profile {name_or_path!r}: no {path} (known: {', '.join(known_profiles())})")
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise PipelineError(f"{rel}: malformed YAML ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise PipelineError(f"{rel}: expected a mapping at the top level")
    unknown = set(data) - PROFILE_KEYS
    if unknown:
        raise PipelineError(f"{rel}: unknown key {sorted(unknown)[0]!r} (allowed: {', '.join(sorted(PROFILE_KEYS))})")
    kind = data.get("kind", "generator")
    if kind not in ("generator", "codec"):
        raise PipelineError(f"{rel}: kind must be 'generator' or 'codec', got {kind!r}")
    seed = data.get("seed", 0)
    if not isinstance(seed, int):
        raise PipelineError(f"{rel}: seed must be an integer, got {seed!r}")
    stages_raw = data.get("stages")
    if not isinstance(stages_raw, dict) or not stages_raw:
        raise PipelineError(f"{rel}: 'stages' must be a non-empty mapping of stage name -> parameters")
    for stage in stages_raw:  # a misspelled stage is named before any override is checked against it
        if stage not in stage_table:
            close = difflib.get_close_matches(stage, list(stage_table), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise PipelineError(f"{rel}: stages.{stage}: unknown stage ({hint}allowed: {', '.join(stage_table)})")
    model_overrides = (data.get("models") or {}).get(model) or {}
    if not isinstance(model_overrides, dict):
        raise PipelineError(f"{rel}: models.{model} must be a mapping of stage -> parameters")
    for stage in model_overrides:
        if stage not in stages_raw:
            raise PipelineError(f"{rel}: models.{model}.{stage} overrides a stage the profile does not have")
    for stage in overrides or {}:
        if stage not in stages_raw:
            raise PipelineError(f"--set {stage}.…: the profile {rel} has no stage {stage!r} "
                                f"(its stages: {', '.join(stages_raw)})")
    built, seen = {}, []
    for stage, params in stages_raw.items():
        spec = stage_table[stage]
        merged = {**(params or {}), **(model_overrides.get(stage) or {}), **((overrides or {}).get(stage) or {})}
        where = f"{rel}: stages.{stage}"
        cls = spec.params_for(kind)
        built[stage] = spec.parse(merged, where) if spec.parse else build_params(cls, merged, where)
        for need in spec.needs:
            if need not in seen:
                raise PipelineError(f"{rel}: stage {stage!r} needs {need!r} before it")
        for read in spec.reads:
            if read in stages_raw and read not in seen:
                raise PipelineError(f"{rel}: stage {stage!r} reads {read!r}, which must come before it")
        seen.append(stage)
    rebuild = build_params(RebuildTolerance, data.get("rebuild"), f"{rel}: rebuild")
    return Profile(name=data.get("name", path.stem), kind=kind, seed=seed, stages=built,
                   description=data.get("description", ""), rebuild=rebuild, path=path, raw=data)
