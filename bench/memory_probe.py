"""Per-stage wall time and peak host RSS of one profile at the real widths, on any machine (CPU too).

    python bench/memory_probe.py rtn4 --layers 1 --overrides '{"evaluate": {"nsamples": 1, "seqlen": 64}}'
    python bench/memory_probe.py codec-fp8            # the full codec (codec-full-shape)

Builds (once, under --work) the full-shape generator fixture with --layers blocks, or the full codec
for a codec profile, pins it in memory, and runs the profile through the pipeline with the given
per-stage overrides (small calibration keeps a CPU run short). Prints the stage stats as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> None:
    import yaml

    from bench.run import pinned
    from pipelines.api import build_from, plan
    from pipelines.codec_fixtures import write_codec_fixture
    from pipelines.fixtures import write_fixture
    from pipelines.profile import profile_path
    from pipelines.source import load_model_spec

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile")
    p.add_argument("--layers", type=int, default=1, help="decoder blocks of the full-shape generator")
    p.add_argument("--overrides", default="{}", help='JSON {stage: {key: value}} applied for the full-shape model')
    p.add_argument("--work", default="/tmp/moss-probe", help="fixtures (reused) and scratch")
    args = p.parse_args(argv)

    codec = plan(args.profile).kind == "codec"
    model = "codec-full-shape" if codec else "full-shape"
    work = Path(args.work)
    fixture = work / (model if codec else f"{model}-L{args.layers}")
    if not fixture.exists():
        write_codec_fixture(model, fixture) if codec else write_fixture(model, fixture, layers=args.layers)
    raw = yaml.safe_load(profile_path(args.profile).read_text())
    raw.setdefault("models", {})[model] = json.loads(args.overrides)
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        prof = Path(tmp) / f"{args.profile}.yaml"
        prof.write_text(yaml.safe_dump(raw, sort_keys=False))
        ctx = build_from(str(prof), pinned(load_model_spec(model), fixture), model_path=fixture, use_cache=False,
                         cache_root=Path(tmp) / "cache", bundle_root=Path(tmp) / "bundles")
    print(json.dumps(ctx.stats, indent=1))


if __name__ == "__main__":
    main()
