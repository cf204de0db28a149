"""The library's entry points: `build`, `rebuild`, `load`, and what they need (the profile plan,
the newest bundle). The CLI, bench and the tests call these; nothing imports the CLI."""
from __future__ import annotations

import tempfile
from pathlib import Path

from . import manifest
from .errors import PipelineError
from .models import moss_audio_tokenizer, moss_tts_delay
from .pipeline import STAGES
from .profile import load_profile
from .source import ARTIFACTS, ROOT, load_model_spec, resolve_path, verify
from .stages import RunContext, default_cache_root, resolve_device, run_stages

DEFINITIONS = {"generator": moss_tts_delay.DEFINITION, "codec": moss_audio_tokenizer.DEFINITION}


def plan(profile: str | Path, model: str | None = None, overrides: dict | None = None):
    """The resolved, validated profile (per-model and `--set` overrides applied)."""
    return load_profile(str(profile), STAGES, model, overrides)


def model_for(profile_name: str, model: str):
    """The model spec a profile runs on: `MODEL=tiny PROFILE=codec-fp8` means tiny's companion codec."""
    spec = load_model_spec(model)
    if spec.kind == "generator" and spec.codec and plan(profile_name, model).kind == "codec":
        return load_model_spec(spec.codec)
    return spec


def build(profile_name: str, model: str, model_path=None, use_cache=True, cache_root=None, bundle_root=None,
          overrides: dict | None = None) -> RunContext:
    """Resolve, verify and run every stage; returns the RunContext (ctx.bundle is the folder)."""
    return build_from(profile_name, model_for(profile_name, model), model_path, use_cache, cache_root, bundle_root,
                      overrides)


def build_from(profile: str | Path, spec, model_path=None, use_cache=True, cache_root=None, bundle_root=None,
               overrides: dict | None = None) -> RunContext:
    prof = plan(profile, spec.name, overrides)
    if prof.kind != spec.kind:
        raise PipelineError(f"profile {prof.name!r} is for {prof.kind} models, but model {spec.name!r} is a {spec.kind}")
    path = resolve_path(spec, model_path)
    verify(spec, path)
    check_plan(prof, spec, path)  # everything refusable is refused before a stage runs
    ctx = RunContext(spec=spec, snapshot=path, profile=prof, definition=DEFINITIONS[spec.kind],
                     device=resolve_device("auto"), cache_root=Path(cache_root) if cache_root else default_cache_root(),
                     bundle_root=Path(bundle_root) if bundle_root else None)
    return run_stages(ctx, STAGES, use_cache=use_cache)


def check_plan(prof, spec, path: Path) -> None:
    """The source's config.json must hold what the model definition needs, and every group size in
    the profile must divide the widths it will be applied to."""
    from .checkpoint import Checkpoint

    where = path / "config.json"
    config = Checkpoint(path).config()
    if spec.kind == "codec":
        moss_audio_tokenizer.CodecConfig.from_dict(config, where=str(where))
        return
    shapes = moss_tts_delay.block_linear_shapes(moss_tts_delay.MossTTSDelayConfig.from_dict(config, where=str(where)))
    rel = prof.path.relative_to(ROOT) if prof.path.is_relative_to(ROOT) else prof.path
    for stage, params in prof.stages.items():
        for obj in (params, getattr(params, "config", None)):
            g = getattr(obj, "group_size", None)
            if not isinstance(g, int):
                continue
            for linear, (_, width) in shapes.items():
                if width % g:
                    raise PipelineError(f"{rel}: stages.{stage}.group_size: {g} does not divide the input width {width} "
                                        f"of {linear} ({spec.name}'s config.json)")


def newest(model: str, profile: str, root: Path | None = None) -> Path:
    """The newest bundle of MODEL/PROFILE (a generator's codec profile: its companion codec's), by the
    build order export records."""
    root = Path(root) if root else ARTIFACTS
    found = manifest.newest(root / model_for(profile, model).name / profile) if model and profile else None
    if found is None:
        raise PipelineError(f"{model}/{profile}: no bundle under artifacts/{model}/{profile}/ "
                            "(expected MODEL/PROFILE with a built bundle; run make quantize first)")
    return found


def load(bundle: Path, **kwargs):
    """A bundle as a runnable module (the generator, or the decode-only codec), files verified."""
    from .loader import load_bundle

    return load_bundle(Path(bundle), **kwargs)


def rebuild(bundle: Path, model_path=None, scratch: Path | None = None, log=print, keep: bool = False):
    """Rebuild `bundle` from its manifest's pins and its recipe in `scratch` (a new temporary folder
    by default), with no stage cache, and judge it (pipelines/rebuild.py). Returns the verdict and
    the rebuilt bundle when it is kept (`keep`, or it differs); otherwise nothing is left behind."""
    import shutil

    from .environment import differences, fingerprint
    from .rebuild import DIFFERS, NONDETERMINISTIC, judge

    m = manifest.verify(bundle)
    spec = load_model_spec(m["model"])
    pins = m["source"]
    spec.repo, spec.revision, spec.files = pins["repo"], pins["revision"], pins["files"]  # the recorded pins
    recorded = m.get("environment") or {}
    for line in differences(recorded, fingerprint(recorded.get("device", "cpu"))):
        log(f"environment differs: {line}")
    scratch = Path(scratch) if scratch else Path(tempfile.mkdtemp(prefix="mossquant-rebuild-"))
    kept = None
    try:
        ctx = build_from(Path(bundle) / "recipe.yaml", spec, model_path, use_cache=False,
                         cache_root=scratch / "cache", bundle_root=scratch / "bundle")
        verdict = judge(Path(bundle), ctx.bundle)
        if keep or verdict.verdict in (DIFFERS, NONDETERMINISTIC):
            kept = ctx.bundle
        return verdict, kept
    finally:
        shutil.rmtree(scratch / "cache", ignore_errors=True)
        if kept is None:
            shutil.rmtree(scratch, ignore_errors=True)
