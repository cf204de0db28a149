"""`mossquant`: the command line over pipelines.api (and the registry, report and backbone export).
Errors print one line and exit non-zero. Nothing imports this module."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Off a terminal (CI, `make demo > log`), libraries' progress bars are noise: tqdm reads this when
# it is first imported, so it is set before anything imports it. Our own bars check the terminal.
if not sys.stderr.isatty():
    os.environ.setdefault("TQDM_DISABLE", "1")

from . import api  # noqa: E402
from .errors import GateRejected, PipelineError  # noqa: E402
from .profile import parse_overrides  # noqa: E402


def _err(msg: str) -> None:
    print(msg, file=sys.stderr)


def cmd_fixture(args):
    from .fixtures import write_any_fixture
    from .source import ARTIFACTS

    print(write_any_fixture(args.name, Path(args.out) if args.out else ARTIFACTS / "fixtures" / args.name, seed=args.seed))


def cmd_pin(args):
    from .source import pin

    print(pin(args.model, Path(args.path)))


def cmd_plan(args):
    import yaml

    prof = api.plan(args.profile, args.model, parse_overrides(args.set))
    print(yaml.safe_dump(prof.resolved(), sort_keys=False).rstrip())


def cmd_quantize(args):
    ctx = api.build(args.profile, args.model, args.model_path, use_cache=not args.no_cache,
                    overrides=parse_overrides(args.set))
    gate = ctx.results.get("gate", {})
    if gate.get("status") == "rejected":
        failed = [f"{c['metric']}={c['value']} (limit {c['op']} {c['threshold']})" for c in gate["checks"] if not c["passed"]]
        _err(f"{ctx.profile.name} on {ctx.spec.name}: rejected by the quality gate: {'; '.join(failed)}")
        print(f"bundle: {ctx.bundle}")
        raise SystemExit(GateRejected.exit_code)
    print(f"bundle: {ctx.bundle}")


def cmd_load(args):
    import torch

    from . import manifest

    model = api.load(Path(args.bundle))
    m = manifest.read(Path(args.bundle))
    n = sum(p.numel() for p in model.parameters())
    print(f"loaded {m['model']}/{m['profile']}/{m['version']} ({m['status']}): {n} parameters, "
          f"{m['bits_per_weight']['effective']} effective bits per weight")
    if hasattr(model, "config") and hasattr(model.config, "n_vq"):
        with torch.no_grad():
            out = model(torch.zeros(1, 4, 1 + model.config.n_vq, dtype=torch.long))
        print(f"forward ok: {len(out)} heads, text logits {tuple(out[0].shape)}")
    elif hasattr(model, "decode"):  # codec: 4 frames of code 0 on every codebook
        q = model.config.quantizer
        wav = model.decode(torch.zeros(q.num_quantizers, 1, 4, dtype=torch.long))
        print(f"decode ok: 4 frames -> {wav.shape[-1]} samples at {model.config.sampling_rate} Hz, {model.decoder_dtype}")


def cmd_verify(args):
    from . import manifest

    m = manifest.verify(Path(args.bundle))
    print(f"ok: {len(m['files'])} files match the manifest ({m['version']}, {m['status']})")


def _bundle_arg(args) -> Path:
    return api.newest(*args.bundle.split("/", 1)) if args.newest else Path(args.bundle)


def cmd_push(args):
    from .registry.client import open_registry, push

    bundle = _bundle_arg(args)
    reg = open_registry(args.registry)
    r = push(reg, bundle, force=args.force)
    print(f"pushed {bundle} to {reg.url} as {', '.join(r.tags)}: {r.digest} "
          f"({len(r.uploaded)} blobs uploaded, {len(r.skipped)} already there)")


def cmd_pull(args):
    from .registry.client import open_registry, pull, split_ref

    url, ref = split_ref(args.ref)
    digest = pull(open_registry(url), ref, Path(args.dir))
    print(f"pulled {url}@{digest} into {args.dir} (every file verified)")


def cmd_ls(args):
    from .registry.client import list_tags, open_registry

    for tag, digest in list_tags(open_registry(args.registry)).items():
        print(f"{tag}\t{digest}")


def cmd_rebuild(args):
    import shutil
    import tempfile

    target = str(api.newest(args.model, args.profile)) if args.profile else args.target
    if not target:
        raise PipelineError("rebuild: give a bundle folder, a registry reference, or --profile/--model")
    bundle, pulled = Path(target), None
    if not bundle.is_dir():  # a registry reference: pull it first (every blob verified)
        from .registry.client import open_registry, pull, split_ref

        url, ref = split_ref(target)
        pulled = Path(tempfile.mkdtemp(prefix="mossquant-pulled-"))
        bundle = pulled / "bundle"
        pull(open_registry(url), ref, bundle)
        _err(f"pulled {target}")
    try:
        verdict, kept = api.rebuild(bundle, args.model_path, log=_err)
    finally:
        if pulled:
            shutil.rmtree(pulled, ignore_errors=True)
    print("\n".join(verdict.lines))
    if kept:
        _err(f"rebuilt copy kept at {kept}")
    if verdict.exit_code:
        raise SystemExit(verdict.exit_code)


def cmd_report(args):
    from .report import write_report

    print(f"report: {write_report(args.model, Path(args.root) if args.root else None)}")


def cmd_export_backbone(args):
    from . import manifest
    from .backbone_export import export_backbone

    manifest.verify(Path(args.bundle))
    print(f"backbone: {export_backbone(args.bundle, args.dest)}")


def cmd_export_gguf(args):
    from . import manifest
    from .atomic import atomic_file
    from .gguf_export import GGUFParams, write_gguf
    from .loader import bundle_view
    from .profile import build_params
    from .source import load_model_spec

    bundle, dest = Path(args.bundle), Path(args.dest)
    if dest.exists():
        raise PipelineError(f"{dest}: already exists; choose a new file")
    params = build_params(GGUFParams, {"linear": args.linear, "embeddings": args.embeddings, "heads": args.heads},
                          "export-gguf")
    m = manifest.verify(bundle)
    view, config = bundle_view(bundle)
    spec = load_model_spec(m["model"])
    snapshot = None
    if config.get("model_type") == "moss_tts_delay":  # the tokenizer comes from the pinned snapshot
        from .source import resolve_path

        snapshot = resolve_path(spec, args.model_path)
    prov = {"source": f"{m['source']['repo']}@{m['source']['revision']}", "profile": m["profile"], "bundle": m["version"]}
    with atomic_file(dest) as tmp:
        record = write_gguf(view, config, snapshot, bool(spec.fixture), params, tmp, prov)
    inexact = f", {len(record['inexact'])} tensors not bit-exact ({', '.join(record['inexact'][:3])}…)" if record["inexact"] else ""
    print(f"gguf: {dest} ({record['effective_bpw']} bits per weight{inexact})")


def _model(p):
    p.add_argument("--model", default="moss-tts", help="model YAML under configs/models (default: the real moss-tts)")
    p.add_argument("--model-path", help="local snapshot folder (overrides the model YAML's path, the env and the HF cache)")


def _set(p):
    p.add_argument("--set", action="append", default=[], metavar="STAGE.KEY=VALUE",
                   help="override one stage parameter (checked like the YAML), e.g. --set quantize.group_size=64")


def parser() -> argparse.ArgumentParser:
    from .registry.client import DEFAULT_URL

    p = argparse.ArgumentParser(prog="mossquant", description="Offline quantization pipeline for MOSS-TTS")
    sub = p.add_subparsers(dest="cmd", required=True)

    def add(name, fn, help, *args):
        sp = sub.add_parser(name, help=help)
        for a in args:
            a(sp)
        sp.set_defaults(fn=fn)
        return sp

    sp = add("fixture", cmd_fixture, "write a deterministic fixture checkpoint")
    sp.add_argument("name", help="tiny | full-shape | codec-tiny | codec-full-shape")
    sp.add_argument("--out")
    sp.add_argument("--seed", type=int, default=0)
    sp = add("pin", cmd_pin, "hash every file of a local snapshot into the model YAML")
    sp.add_argument("model")
    sp.add_argument("path")
    sp = add("plan", cmd_plan, "print the resolved stage plan of a profile", _set)
    sp.add_argument("profile")
    sp.add_argument("--model", default=None, help="apply the profile's per-model overrides")
    sp = add("quantize", cmd_quantize, "build a profile's bundle (prints `bundle: <path>` last)", _model, _set)
    sp.add_argument("profile")
    sp.add_argument("--no-cache", action="store_true", help="ignore the stage cache")
    add("load", cmd_load, "load a bundle through the project's loader and run one forward pass").add_argument("bundle")
    add("verify", cmd_verify, "re-hash a bundle's files against its manifest").add_argument("bundle")
    sp = add("push", cmd_push, "push a bundle as an OCI artifact (tags: version id, MODEL-PROFILE)")
    sp.add_argument("bundle", help="bundle folder (or MODEL/PROFILE with --newest)")
    sp.add_argument("registry", nargs="?", default=DEFAULT_URL,
                    help=f"oci-layout:PATH or oci://HOST:PORT/REPO (default {DEFAULT_URL})")
    sp.add_argument("--newest", action="store_true", help="BUNDLE is MODEL/PROFILE: push its newest bundle")
    sp.add_argument("--force", action="store_true", help="push even if the quality gate rejected the bundle")
    sp = add("pull", cmd_pull, "pull a bundle, verifying every blob, into a new folder")
    sp.add_argument("ref", help="URL:TAG, URL@sha256:DIGEST, or a bare TAG in the default layout")
    sp.add_argument("dir", help="destination folder (must not exist, or be empty)")
    sp = add("ls", cmd_ls, "list a registry's tags and their manifest digests")
    sp.add_argument("registry", nargs="?", default=DEFAULT_URL, help=f"registry URL (default {DEFAULT_URL})")
    sp = add("rebuild", cmd_rebuild, "rebuild a bundle from its manifest and say what matches: identical (0), "
             "differs (4), equivalent (5), determinism bug (6)")
    sp.add_argument("target", nargs="?", help="bundle folder or registry reference (URL:TAG, URL@DIGEST, TAG)")
    sp.add_argument("--profile", help="rebuild the newest bundle of this profile (with --model)")
    sp.add_argument("--model", default="moss-tts")
    sp.add_argument("--model-path", help="local snapshot of the pinned source")
    sp = add("report", cmd_report, "write artifacts/MODEL/REPORT.md: every bundle's bits per weight, fidelity and "
             "gate verdict, with plots")
    sp.add_argument("model", help="model name: every bundle under artifacts/MODEL/<profile>/ (e.g. tiny, codec-tiny)")
    sp.add_argument("--root", help="artifacts folder (default: $MOSSQUANT_ARTIFACTS or ./artifacts)")
    sp = add("export-backbone", cmd_export_backbone, "write a bundle's Qwen3 backbone as a Qwen3ForCausalLM folder "
             "(transformers-loadable)")
    sp.add_argument("bundle", help="a generator bundle folder")
    sp.add_argument("dest", help="new folder for the Qwen3ForCausalLM backbone")
    sp = add("export-gguf", cmd_export_gguf, "write a generator bundle as one moss-tts-delay GGUF (llama.cpp), "
             "its integers carried into ggml blocks")
    sp.add_argument("bundle", help="a generator bundle folder")
    sp.add_argument("dest", help="the new .gguf file")
    sp.add_argument("--linear", default="exact", help="block Linears: exact (default), Q4_0, Q4_1, Q5_0 or Q8_0")
    sp.add_argument("--embeddings", default="BF16", help="embedding tables: BF16 (default, exact), F16 or Q8_0")
    sp.add_argument("--heads", default="BF16", help="output heads: BF16 (default, exact), F16 or Q8_0")
    sp.add_argument("--model-path", help="local snapshot of the pinned source (its tokenizer.json)")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        args.fn(args)
    except PipelineError as e:
        _err(f"error: {e}")
        raise SystemExit(e.exit_code)
    except KeyboardInterrupt:
        _err("error: interrupted; re-run to resume (finished stages are cached, the quantize stage's finished blocks kept)")
        raise SystemExit(130)
