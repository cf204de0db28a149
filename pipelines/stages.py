"""The stage runner and its content-addressed cache (DVC-style). It imports no stage: the stage
table is data handed to it (pipelines/pipeline.py).

A stage declares what it reads (`needs`: stages that must run before it; `reads`: stages whose
output it uses when the profile has them) and its params. Its cache key hashes only what can
change its output: its resolved params, the keys of the stages it reads, the source pins, the
seed, the device kind, and the code it runs (its module's import closure in pipelines/ and
quantizers/, with the numeric libraries' versions). Editing the report does not invalidate a
cached 36-block quantize stage. A finished stage lives in `artifacts/.cache/<stage>/<key>/`,
written to a temporary folder and renamed, so a re-run skips it and an interrupted run resumes at
the first unfinished stage. Within a stage, the engine may keep per-block progress in
`<stage>/<key>.partial/` (`ctx.partial`, pipelines/resume.py): a re-run resumes at the first
unfinished block, and the folder is removed once the stage is published.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

from .atomic import atomic_folder
from .checkpoint import canonical_json
from .environment import fingerprint, library_versions
from .errors import PipelineError
from .import_graph import closure, code_digest, module_graph
from .progress import host_rss_gib
from .source import ARTIFACTS, ROOT, ModelSpec, pins_digest

ENVIRONMENT = "environment.json"


@dataclass(frozen=True)
class StageSpec:
    run: Callable | dict  # run(ctx, params, out_dir) -> result dict, or {model kind: run}
    params: type | dict | None = None  # params dataclass, or {model kind: dataclass}; None when `parse` builds them
    parse: Callable | None = None  # parser(data, where) for stages with sub-schemas (quantize: the method's config)
    needs: tuple[str, ...] = ()  # stages that must come before it
    reads: tuple[str, ...] = ()  # stages whose output it uses when the profile has them
    cached: bool = True

    def params_for(self, kind: str):
        return self.params.get(kind) if isinstance(self.params, dict) else self.params

    def run_for(self, kind: str) -> Callable:
        return self.run[kind] if isinstance(self.run, dict) else self.run


@dataclass
class RunContext:
    spec: ModelSpec
    snapshot: Path
    profile: object
    definition: object  # the architecture definition (pipelines/models)
    device: str
    cache_root: Path
    results: dict[str, dict] = field(default_factory=dict)  # stage -> result.json
    dirs: dict[str, Path] = field(default_factory=dict)  # stage -> its output folder
    keys: dict[str, str] = field(default_factory=dict)  # stage -> cache key
    stats: dict[str, dict] = field(default_factory=dict)  # stage -> wall time and memory peaks (benchmarks)
    environments: dict[str, dict] = field(default_factory=dict)  # stage -> the fingerprint it ran under
    bundle_root: Path | None = None
    bundle: Path | None = None
    partial: Path | None = None  # the running stage's block checkpoints (None: the run keeps none)
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
def _graph():
    return module_graph(ROOT)


@lru_cache(maxsize=None)
def stage_code(module: str) -> str:
    """The code a stage runs: its module's import closure, and the numeric libraries' versions (a
    stage function from outside the project, a test's stand-in say, contributes its project imports only)."""
    graph = _graph()
    return _code_hash(m for m in closure(graph, module) if m in graph)


@lru_cache(maxsize=1)
def code_version() -> str:
    """The whole project's code (recorded in manifests: `rebuild` says when it changed)."""
    return _code_hash(_graph())


def _code_hash(modules) -> str:
    h = hashlib.sha256(code_digest(ROOT, sorted(modules)).encode())
    h.update(canonical_json(library_versions()).encode())
    return h.hexdigest()


def stage_key(ctx: RunContext, name: str, spec: StageSpec, params) -> str:
    upstream = {s: ctx.keys[s] for s in (*spec.needs, *spec.reads) if s in ctx.keys}
    payload = {
        "stage": name,
        "params": dataclasses.asdict(params),
        "reads": upstream,  # a changed upstream output invalidates what reads it, and only that
        "source": pins_digest(ctx.spec),
        "seed": ctx.seed,
        "device": ctx.device,
        "code": stage_code(spec.run_for(ctx.spec.kind).__module__),
    }
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()


def resolve_device(requested: str) -> str:
    import torch

    if requested in ("auto", None):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise PipelineError(f"device {requested!r} requested but CUDA is not available")
    return requested


def run_stages(ctx: RunContext, stages: dict[str, StageSpec], use_cache: bool = True) -> RunContext:
    """Run every stage of the profile in order, skipping those already in the cache."""
    for name, params in ctx.profile.stages.items():
        spec = stages[name]
        key = stage_key(ctx, name, spec, params)
        started = _stats_start()
        ctx.keys[name] = key
        final = ctx.cache_root / name / key
        partial = final.with_name(f"{key}.partial")
        cached = use_cache and spec.cached and (final / "result.json").exists()
        if cached:
            ctx.log(f"stage {name}: cached ({key[:12]})")
        else:
            ctx.log(f"stage {name}: running ({key[:12]})")
            ctx.partial = partial if use_cache and spec.cached else None
            try:
                with atomic_folder(final) as tmp:
                    result = spec.run_for(ctx.spec.kind)(ctx, params, tmp)
                    (tmp / "result.json").write_text(canonical_json(result, indent=2))
                    env = fingerprint(result.get("device", ctx.device) if isinstance(result, dict) else ctx.device)
                    (tmp / ENVIRONMENT).write_text(canonical_json(env, indent=2))
            finally:
                ctx.partial = None
        shutil.rmtree(partial, ignore_errors=True)  # the stage is published: its block checkpoints are spent
        ctx.dirs[name] = final
        ctx.results[name] = json.loads((final / "result.json").read_text())
        env_file = final / ENVIRONMENT
        ctx.environments[name] = json.loads(env_file.read_text()) if env_file.exists() else fingerprint(ctx.device)
        ctx.stats[name] = _stats_end(started) | ({"cached": True} if cached else {})
        if not cached:
            st = ctx.stats[name]  # the peaks too, so a run cut off later still told them
            gpu = f", GPU allocated {st['gpu_peak_allocated_gib']:.2f} GiB" if "gpu_peak_allocated_gib" in st else ""
            ctx.log(f"stage {name}: done in {st['wall_s']:.1f} s (peak host RSS {st['peak_rss_gib']:.2f} GiB{gpu})")
    return ctx


def _peak_rss_gib() -> float:
    """Peak resident set since the last reset: Linux's VmHWM, else getrusage (never reset, and
    on Linux it also carries a forked parent's RSS across exec: only a fallback)."""
    peak = host_rss_gib("VmHWM")
    if peak is not None:
        return peak
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
