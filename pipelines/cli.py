"""`mossquant`: fixtures, pins, plans, builds, loading. Errors print one line and exit non-zero."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Off a terminal (CI, `make demo > log`), libraries' progress bars are noise: tqdm reads this when
# it is first imported, so it is set before anything imports it. Our own bars check the terminal.
if not sys.stderr.isatty():
    os.environ.setdefault("TQDM_DISABLE", "1")

from .errors import PipelineError
from .source import ROOT

COMMANDS = {}


def command(name, help):
    def deco(fn):
        COMMANDS[name] = (fn, help)
        return fn

    return deco


def add_model_args(p):
    p.add_argument("--model", default="moss-tts", help="model YAML under configs/models (default: the real moss-tts)")
    p.add_argument("--model-path", help="local snapshot folder (overrides env and HF cache)")


@command("fixture", "write a deterministic fixture checkpoint")
def cmd_fixture(args):
    from .fixtures import write_any_fixture
    from .source import ARTIFACTS

    out = Path(args.out) if args.out else ARTIFACTS / "fixtures" / args.name
    print(write_any_fixture(args.name, out, seed=args.seed))


def _fixture_args(p):
    p.add_argument("name", help="tiny | full-shape | codec-tiny")
    p.add_argument("--out")
    p.add_argument("--seed", type=int, default=0)


@command("pin", "hash every file of a local snapshot into the model YAML")
def cmd_pin(args):
    from .source import pin

    print(pin(args.model, Path(args.path)))


def _pin_args(p):
    p.add_argument("model")
    p.add_argument("path")


@command("plan", "print the resolved stage plan of a profile")
def cmd_plan(args):
    import yaml

    from .profile import load_profile

    prof = load_profile(args.profile, args.model)
    print(yaml.safe_dump(prof.resolved(), sort_keys=False).rstrip())


def _plan_args(p):
    p.add_argument("profile")
    p.add_argument("--model", default=None, help="apply the profile's per-model overrides")


def model_for(profile_name: str, model: str):
    """The model spec a profile runs on: `MODEL=tiny PROFILE=codec-fp8` means tiny's companion codec."""
    from .profile import load_profile
    from .source import load_model_spec

    spec = load_model_spec(model)
    if spec.kind == "generator" and spec.codec and load_profile(profile_name, model).kind == "codec":
        return load_model_spec(spec.codec)
    return spec


def build(profile_name: str, model: str, model_path=None, use_cache=True, cache_root=None, bundle_root=None):
    """Resolve, verify and run every stage; returns the RunContext (ctx.bundle is the folder)."""
    return build_from(profile_name, model_for(profile_name, model), model_path, use_cache, cache_root, bundle_root)


def build_from(profile: str | Path, spec, model_path=None, use_cache=True, cache_root=None, bundle_root=None):
    from .profile import load_profile
    from .source import resolve_path, verify
    from .stages import RunContext, default_cache_root, resolve_device, run_stages

    prof = load_profile(str(profile), spec.name)
    if prof.kind != spec.kind:
        raise PipelineError(f"profile {prof.name!r} is for {prof.kind} models, but model {spec.name!r} is a {spec.kind}")
    path = resolve_path(spec, model_path)
    verify(spec, path)
    check_plan(prof, spec, path)  # everything refusable is refused before a stage runs
    ctx = RunContext(spec=spec, snapshot=path, profile=prof, device=resolve_device("auto"),
                     cache_root=Path(cache_root) if cache_root else default_cache_root())
    ctx.bundle_root = Path(bundle_root) if bundle_root else None
    return run_stages(ctx, use_cache=use_cache)


def check_plan(prof, spec, path: Path) -> None:
    """The source's config.json must hold what the model definition needs, and every group size in
    the profile must divide the widths it will be applied to."""
    from .checkpoint import Checkpoint

    where = path / "config.json"
    config = Checkpoint(path).config()
    if spec.kind == "codec":
        from .models.moss_audio_tokenizer import CodecConfig

        CodecConfig.from_dict(config, where=str(where))
        return
    from .models.moss_tts_delay import MossTTSDelayConfig, block_linear_shapes

    shapes = block_linear_shapes(MossTTSDelayConfig.from_dict(config, where=str(where)))
    rel = prof.path.relative_to(ROOT) if prof.path.is_relative_to(ROOT) else prof.path
    for stage, params in prof.stages.items():
        for key_path, obj in ((f"stages.{stage}", params), (f"stages.{stage}", getattr(params, "config", None))):
            g = getattr(obj, "group_size", None)
            if not isinstance(g, int):
                continue
            for linear, (_, width) in shapes.items():
                if width % g:
                    raise PipelineError(f"{rel}: {key_path}.group_size: {g} does not divide the input width {width} of "
                                        f"{linear} ({spec.name}'s config.json)")


@command("quantize", "build a profile's bundle (prints `bundle: <path>` last)")
def cmd_quantize(args):
    from .errors import GateRejected

    ctx = build(args.profile, args.model, args.model_path, use_cache=not args.no_cache)
    gate = ctx.results.get("gate", {})
    if gate.get("status") == "rejected":
        failed = [f"{c['metric']}={c['value']} (limit {c['op']} {c['threshold']})" for c in gate["checks"] if not c["passed"]]
        print(f"{ctx.profile.name} on {ctx.spec.name}: rejected by the quality gate: {'; '.join(failed)}", file=sys.stderr)
        print(f"bundle: {ctx.bundle}")
        raise SystemExit(GateRejected.exit_code)
    print(f"bundle: {ctx.bundle}")


def _quantize_args(p):
    p.add_argument("profile")
    add_model_args(p)
    p.add_argument("--no-cache", action="store_true", help="ignore the stage cache")


@command("load", "load a bundle through the project's loader and run one forward pass")
def cmd_load(args):
    import torch

    from .loader import load_bundle, read_manifest

    model = load_bundle(Path(args.bundle))
    m = read_manifest(Path(args.bundle))
    n = sum(p.numel() for p in model.parameters())
    print(f"loaded {m['model']}/{m['profile']}/{m['version']} ({m['status']}): {n} parameters, "
          f"{m['bits_per_weight']['effective']} effective bits per weight")
    if hasattr(model, "config") and hasattr(model.config, "n_vq"):
        ids = torch.zeros(1, 4, 1 + model.config.n_vq, dtype=torch.long)
        with torch.no_grad():
            out = model(ids)
        print(f"forward ok: {len(out)} heads, text logits {tuple(out[0].shape)}")
    elif hasattr(model, "decode"):  # codec: 4 frames of code 0 on every codebook
        q = model.config.quantizer
        wav = model.decode(torch.zeros(q.num_quantizers, 1, 4, dtype=torch.long))
        print(f"decode ok: 4 frames -> {wav.shape[-1]} samples at {model.config.sampling_rate} Hz, {model.decoder_dtype}")


def _load_args(p):
    p.add_argument("bundle")


@command("verify", "re-hash a bundle's files against its manifest")
def cmd_verify(args):
    from .bundle import verify_bundle

    m = verify_bundle(Path(args.bundle))
    print(f"ok: {len(m['files'])} files match the manifest ({m['version']}, {m['status']})")


def _verify_args(p):
    p.add_argument("bundle")


ARGS = {"fixture": _fixture_args, "pin": _pin_args, "plan": _plan_args, "quantize": _quantize_args,
        "load": _load_args, "verify": _verify_args}


def register(name, help, fn, add_args):
    """Other modules (registry, rebuild, report) add their subcommands here."""
    COMMANDS[name] = (fn, help)
    ARGS[name] = add_args


def parser() -> argparse.ArgumentParser:
    from . import cli_extensions  # noqa: F401  (registers optional subcommands)

    p = argparse.ArgumentParser(prog="mossquant", description="Offline quantization pipeline for MOSS-TTS")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, (fn, help) in COMMANDS.items():
        sp = sub.add_parser(name, help=help)
        ARGS[name](sp)
        sp.set_defaults(fn=fn)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        args.fn(args)
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code)
    except KeyboardInterrupt:
        print("error: interrupted; nothing partial was kept (re-run to resume from the stage cache)", file=sys.stderr)
        raise SystemExit(130)


if __name__ == "__main__":  # `python -m pipelines.cli`: run the imported module, where extensions register
    from pipelines.cli import main as _main

    _main()
