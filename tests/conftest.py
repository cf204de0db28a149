"""Offline always: no library may reach a hub from the tests."""
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_path():
    """The pinned tiny fixture (built on demand under artifacts/fixtures, verified against its pins)."""
    from pipelines.source import load_model_spec, resolve_path, verify

    spec = load_model_spec("tiny")
    path = resolve_path(spec)
    verify(spec, path)
    return path


@pytest.fixture(scope="session")
def shipped(tmp_path_factory):
    """shipped(profile): that shipped profile built once per session on the tiny fixture, in its own bundle
    root; one stage cache for all (stages with equal keys, the sensitivity profiles' shared calibrate
    and measure, run once)."""
    from pipelines.api import build

    built, cache = {}, tmp_path_factory.mktemp("shipped-cache")

    def get(profile: str):
        if profile not in built:
            root = tmp_path_factory.mktemp(profile)
            built[profile] = build(profile, "tiny", cache_root=cache, bundle_root=root / "bundles")
        return built[profile]

    return get


@pytest.fixture(scope="session")
def rtn4_build(shipped):
    return shipped("rtn4")
