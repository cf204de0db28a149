"""Stage registry, runner and the content-addressed stage cache (DVC-style).

A stage's cache key hashes its resolved parameters, the keys of the stages it needs, the
source pins, the profile seed and the code version (every .py of pipelines/ and quantizers/
plus the versions of the numeric libraries). A finished stage lives in
`artifacts/.cache/<stage>/<key>/` (written to a temporary folder, renamed when complete), so
a re-run skips it and an interrupted run resumes at the first unfinished stage.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

from .atomic import atomic_folder
from .checkpoint import canonical_json
from .environment import fingerprint, library_versions
from .errors import PipelineError
from .source import ARTIFACTS, ROOT, ModelSpec, pins_digest


@dataclass(frozen=True)
class StageSpec:
    params: type | None  # params dataclass (None when `parse` builds them)
    run: str  # "module:function" resolved lazily: run(ctx, params, out_dir) -> dict
    needs: tuple[str, ...] = ()
    parse: Callable | None = None  # custom parser(data, where) for stages with sub-schemas
    cached: bool = True


def _parse_quantize(data, where):
    from .methods import parse_quantize

    return parse_quantize(data, where)


def _p(path: str):
    mod, name = path.split(":")
    return getattr(importlib.import_module(f"pipelines.{mod}"), name)


# Stage name -> spec. Profiles list a subset of these, in order.
STAGES: dict[str, StageSpec] = {}


def register(name: str, spec: StageSpec) -> None:
    STAGES[name] = spec


@dataclass
class RunContext:
    spec: ModelSpec
    snapshot: Path
    profile: object
    device: str
    cache_root: Path
    results: dict[str, dict] = field(default_factory=dict)  # stage -> result.json
    dirs: dict[str, Path] = field(default_factory=dict)  # stage -> its output folder
    keys: dict[str, str] = field(default_factory=dict)  # stage -> cache key
    stats: dict[str, dict] = field(default_factory=dict)  # stage -> wall time and memory peaks (benchmarks)
    environments: dict[str, dict] = field(default_factory=dict)  # stage -> the fingerprint it ran under
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)

    @property
    def seed(self) -> int:
        return self.profile.seed

    def checkpoint(self):
        from .checkpoint import Checkpoint

        if not hasattr(self, "_ckpt"):
            self._ckpt = Checkpoint(self.snapshot)
        return self._ckpt


@lru_cache(maxsize=1)
def code_version() -> str:
    h = hashlib.sha256()
    for pkg in ("pipelines", "quantizers"):
        for p in sorted((ROOT / pkg).rglob("*.py")):
            h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes())
    h.update(canonical_json(library_versions()).encode())
    return h.hexdigest()


def stage_key(ctx: RunContext, name: str, params) -> str:
    payload = {
        "stage": name,
        "params": dataclasses.asdict(params),
        "after": dict(ctx.keys),  # every earlier stage: a changed upstream invalidates all that follows
        "source": pins_digest(ctx.spec),
        "seed": ctx.seed,
        "device": ctx.device,
        "code": code_version(),
    }
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()


def resolve_device(requested: str) -> str:
    import torch

    if requested in ("auto", None):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise PipelineError(f"device {requested!r} requested but CUDA is not available")
    return requested


ENVIRONMENT = "environment.json"


def run_stages(ctx: RunContext, use_cache: bool = True) -> RunContext:
    """Run every stage of the profile in order, skipping those already in the cache."""
    for name, params in ctx.profile.stages.items():
        spec = STAGES[name]
        key = stage_key(ctx, name, params)
        started = _stats_start()
        ctx.keys[name] = key
        final = ctx.cache_root / name / key
        cached = use_cache and spec.cached and (final / "result.json").exists()
        if cached:
            ctx.log(f"stage {name}: cached ({key[:12]})")
        else:
            ctx.log(f"stage {name}: running ({key[:12]})")
            with atomic_folder(final) as tmp:
                result = _p(spec.run)(ctx, params, tmp)
                (tmp / "result.json").write_text(canonical_json(result, indent=2))
                env = fingerprint(result.get("device", ctx.device) if isinstance(result, dict) else ctx.device)
                (tmp / ENVIRONMENT).write_text(canonical_json(env, indent=2))
        ctx.dirs[name] = final
        ctx.results[name] = json.loads((final / "result.json").read_text())
        env_file = final / ENVIRONMENT
        ctx.environments[name] = json.loads(env_file.read_text()) if env_file.exists() else fingerprint(ctx.device)
        ctx.stats[name] = _stats_end(started)
        if not cached:
            ctx.log(f"stage {name}: done in {ctx.stats[name]['wall_s']:.1f} s")
    return ctx


def _peak_rss_gib() -> float:
    """Peak resident set since the last reset: Linux's VmHWM, else getrusage (never reset, and
    on Linux it also carries a forked parent's RSS across exec: only a fallback)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _stats_start() -> float:
    import time

    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:  # reset VmHWM so the figure is this stage's own peak
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return time.perf_counter()


def _stats_end(started: float) -> dict:
    """Wall time, the allocator's peaks on the device, and the peak RSS, all since _stats_start."""
    import time

    import torch

    out = {"wall_s": round(time.perf_counter() - started, 3), "peak_rss_gib": round(_peak_rss_gib(), 3)}
    if torch.cuda.is_available():
        out["gpu_peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        out["gpu_peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
    return out


def default_cache_root() -> Path:
    return ARTIFACTS / ".cache"


def _register_builtin() -> None:
    from .calibration import CalibrateParams
    from .evaluate import EvaluateParams
    from .gate import GateParams
    from .bundle import ExportParams

    register("calibrate", StageSpec(CalibrateParams, "calibration:run_calibrate"))
    register("quantize", StageSpec(None, "methods:run_quantize", needs=(), parse=_parse_quantize))
    register("evaluate", StageSpec(EvaluateParams, "evaluate:run_evaluate", needs=("quantize",)))
    register("gate", StageSpec(GateParams, "gate:run_gate"))
    from .codec import ValidateParams  # codec decode parity against the FP32 source (issue 7)

    register("validate", StageSpec(ValidateParams, "codec:run_validate", needs=("quantize",)))
    register("export", StageSpec(ExportParams, "bundle:run_export", needs=("quantize",), cached=False))
    from .methods import sensitivity  # noqa: F401  (registers the measure stage, issue 6)


_register_builtin()
