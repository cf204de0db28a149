"""`mossquant rebuild BUNDLE_OR_REF`: prove a bundle's bytes came from its pinned source and recipe.

Reads the manifest (source pins, resolved recipe, seed, environment), rebuilds into a scratch
folder with no stage cache, and compares every payload file; for differing safetensors, the
first differing tensors with their max abs difference. Exit 0 prints `identical`.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from .errors import PipelineError

DIFFERS_EXIT = 4


class RebuildDiffers(PipelineError):
    exit_code = DIFFERS_EXIT


def environment_drift(recorded: dict) -> list[str]:
    from .stages import library_versions, resolve_device

    now = {**library_versions(), "device": resolve_device("auto")}
    return [f"{k}: built with {recorded.get(k)}, now {now.get(k)}" for k in sorted(set(recorded) | set(now))
            if recorded.get(k) != now.get(k)]


def tensor_diffs(a: Path, b: Path, limit: int = 5) -> list[str]:
    from safetensors import safe_open

    out = []
    with safe_open(a, "pt") as fa, safe_open(b, "pt") as fb:
        ka, kb = set(fa.keys()), set(fb.keys())
        for name in sorted(ka ^ kb):
            out.append(f"{name}: only in {'the bundle' if name in ka else 'the rebuild'}")
        for name in sorted(ka & kb):
            x, y = fa.get_tensor(name), fb.get_tensor(name)
            if x.shape != y.shape or x.dtype != y.dtype:
                out.append(f"{name}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
            elif not torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                                 y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y):
                diff = (x.double() - y.double()).abs()
                out.append(f"{name}: max abs diff {diff.max().item():.6g} ({(diff > 0).sum().item()} elements)")
            if len(out) >= limit:
                break
    return out


def compare_bundles(original: Path, rebuilt: Path) -> list[str]:
    """Payload files compared by sha256 (from the manifests), then tensor by tensor."""
    from .loader import read_manifest

    a, b = read_manifest(original)["files"], read_manifest(rebuilt)["files"]
    lines = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            lines.append(f"{name}: only in {'the bundle' if name in a else 'the rebuild'}")
        elif a[name]["sha256"] != b[name]["sha256"]:
            lines.append(f"{name}: differs")
            if name.endswith(".safetensors"):
                lines += ["  " + d for d in tensor_diffs(original / name, rebuilt / name)]
    return lines


def rebuild(bundle: Path, model_path=None, scratch: Path | None = None, log=print) -> tuple[list[str], Path]:
    from .bundle import verify_bundle
    from .cli import build_from
    from .source import load_model_spec

    manifest = verify_bundle(bundle)
    for line in environment_drift(manifest.get("environment", {})):
        log(f"warning: environment differs: {line}")
    spec = load_model_spec(manifest["model"])
    pins = manifest["source"]
    spec.repo, spec.revision, spec.files = pins["repo"], pins["revision"], pins["files"]  # the recorded pins
    scratch = Path(scratch or tempfile.mkdtemp(prefix="mossquant-rebuild-"))
    ctx = build_from(bundle / "recipe.yaml", spec, model_path, use_cache=False,
                     cache_root=scratch / "cache", bundle_root=scratch / "bundle")
    return compare_bundles(bundle, ctx.bundle), ctx.bundle


def cmd_rebuild(args):
    from .registry.commands import newest_bundle

    target = args.target
    if args.profile:
        target = str(newest_bundle(f"{args.model}/{args.profile}"))
    if not target:
        raise PipelineError("rebuild: give a bundle folder, a registry reference, or --profile/--model")
    bundle = Path(target)
    if not bundle.is_dir():  # a registry reference: pull it first (every blob verified)
        from .registry import open_registry, pull, split_ref

        url, ref = split_ref(target)
        bundle = Path(tempfile.mkdtemp(prefix="mossquant-pulled-")) / "bundle"
        pull(open_registry(url), ref, bundle)
        print(f"pulled {target} into {bundle}", file=sys.stderr)
    diffs, rebuilt = rebuild(bundle, args.model_path, log=lambda m: print(m, file=sys.stderr))
    if diffs:
        print("\n".join(diffs))
        raise RebuildDiffers(f"rebuild of {bundle} differs (rebuilt copy kept at {rebuilt})")
    print("identical")


def _args(p):
    p.add_argument("target", nargs="?", help="bundle folder or registry reference (URL:TAG, URL@DIGEST, TAG)")
    p.add_argument("--profile", help="rebuild the newest bundle of this profile (with --model)")
    p.add_argument("--model", default="moss-tts")
    p.add_argument("--model-path", help="local snapshot of the pinned source")


from .cli import register  # noqa: E402

register("rebuild", "rebuild a bundle from its manifest and compare bit for bit", cmd_rebuild, _args)
