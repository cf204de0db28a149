"""`mossquant push / pull / ls`: registered into pipelines.cli by pipelines.cli_extensions."""
from __future__ import annotations

from pathlib import Path

from ..cli import register
from ..errors import PipelineError
from . import DEFAULT_URL, list_tags, open_registry, pull, push, split_ref


def newest_bundle(model_profile: str) -> Path:
    """The newest bundle of MODEL/PROFILE (a generator's codec profile: its companion codec's)."""
    from ..bundle import bundles_of
    from ..cli import model_for

    model, _, profile = model_profile.partition("/")
    found = bundles_of(model_for(profile, model).name, profile) if model and profile else []
    if not found:
        raise PipelineError(f"{model_profile}: no bundle under artifacts/{model_profile}/ "
                            "(expected MODEL/PROFILE with a built bundle; run make quantize first)")
    return found[-1]


def cmd_push(args):
    bundle = newest_bundle(args.bundle) if args.newest else Path(args.bundle)
    reg = open_registry(args.registry)
    r = push(reg, bundle, force=args.force)
    print(f"pushed {bundle} to {reg.url} as {', '.join(r.tags)}: {r.digest} "
          f"({len(r.uploaded)} blobs uploaded, {len(r.skipped)} already there)")


def _push_args(p):
    p.add_argument("bundle", help="bundle folder (or MODEL/PROFILE with --newest)")
    p.add_argument("registry", nargs="?", default=DEFAULT_URL,
                   help=f"oci-layout:PATH or oci://HOST:PORT/REPO (default {DEFAULT_URL})")
    p.add_argument("--newest", action="store_true", help="BUNDLE is MODEL/PROFILE: push its newest bundle")
    p.add_argument("--force", action="store_true", help="push even if the quality gate rejected the bundle")


def cmd_pull(args):
    url, ref = split_ref(args.ref)
    digest = pull(open_registry(url), ref, Path(args.dir))
    print(f"pulled {url}@{digest} into {args.dir} (every file verified)")


def _pull_args(p):
    p.add_argument("ref", help="URL:TAG, URL@sha256:DIGEST, or a bare TAG in the default layout")
    p.add_argument("dir", help="destination folder (must not exist, or be empty)")


def cmd_ls(args):
    for tag, digest in list_tags(open_registry(args.registry)).items():
        print(f"{tag}\t{digest}")


def _ls_args(p):
    p.add_argument("registry", nargs="?", default=DEFAULT_URL, help=f"registry URL (default {DEFAULT_URL})")


register("push", "push a bundle as an OCI artifact (tags: version id, MODEL-PROFILE)", cmd_push, _push_args)
register("pull", "pull a bundle, verifying every blob, into a new folder", cmd_pull, _pull_args)
register("ls", "list a registry's tags and their manifest digests", cmd_ls, _ls_args)
