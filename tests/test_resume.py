"""The quantize stage resumes within itself, block by block: a build SIGKILLed between blocks and run
again continues at the first unfinished block, and its bundle has the bytes of an uninterrupted build."""
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors import safe_open

from pipelines.resume import STREAMS, block_file
from pipelines.source import ROOT

# Shrunk for 2 CPU cores: auto-round at 4 iterations (the profile's tiny setting is 20).
PROFILES = {"awq4": [], "autoround-q3": ["--set", "quantize.iters=4"]}
N_BLOCKS = 4  # the tiny fixture's decoder blocks


def _cmd(profile):
    return [sys.executable, "-m", "pipelines", "quantize", profile, "--model", "tiny", *PROFILES[profile]]


def _env(root: Path, tiny_path: Path) -> dict:
    return dict(os.environ, MOSSQUANT_ARTIFACTS=str(root), MOSSQUANT_MODEL_PATH_TINY=str(tiny_path),
                PYTHONPATH=str(ROOT))


def _build(profile, root: Path, tiny_path: Path) -> tuple[dict, str]:
    """Build to the end: (sha256 of every bundle file and of the quantize stage's output, stderr)."""
    r = subprocess.run(_cmd(profile), env=_env(root, tiny_path), capture_output=True, text=True, cwd=ROOT)
    assert r.returncode in (0, 3), r.stderr[-2000:]  # 3: built and rejected by its gate (not what resuming is about)
    bundle = Path(r.stdout.strip().splitlines()[-1].removeprefix("bundle: "))
    (stage,) = [p for p in (root / ".cache" / "quantize").iterdir() if (p / "result.json").exists()]
    files = {f"bundle/{p.relative_to(bundle)}": p for p in bundle.rglob("*") if p.is_file()}
    files.update({f"quantize/{name}": stage / name for name in ("tensors.safetensors", "quant.json")})
    return {name: hashlib.sha256(p.read_bytes()).hexdigest() for name, p in sorted(files.items())}, r.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_path):
    """reference(profile): the digests of an uninterrupted build (once per profile)."""
    built = {}

    def get(profile):
        if profile not in built:
            built[profile] = _build(profile, tmp_path_factory.mktemp(f"ref-{profile}") / "artifacts", tiny_path)[0]
        return built[profile]

    return get


def _kill_between_blocks(profile, root: Path, tiny_path: Path) -> tuple[Path, int]:
    """Start a build and SIGKILL it as soon as a block is checkpointed: (the partial folder, the
    last block it holds)."""
    cache = root / ".cache" / "quantize"
    p = subprocess.Popen(_cmd(profile), env=_env(root, tiny_path), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and p.poll() is None and not list(cache.glob(f"*.partial/{STREAMS}")):
            time.sleep(0.02)
        assert p.poll() is None, "the build ended before a block was checkpointed"
        p.send_signal(signal.SIGKILL)  # nothing in the process runs: no cleanup, no flush
    finally:
        p.kill()
        p.wait()
    (partial,) = cache.glob("*.partial")
    assert not (cache / partial.name.removesuffix(".partial") / "result.json").exists()  # killed inside the stage
    with safe_open(str(partial / STREAMS), "pt") as f:
        last = int(f.metadata()["block"])
    assert last < N_BLOCKS - 1, f"killed after the last block ({last}): nothing left to resume"
    return partial, last


def _leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".partial") or ".tmp-" in p.name]


@pytest.mark.parametrize("profile", PROFILES)
def test_a_build_killed_between_blocks_resumes_there_with_identical_bytes(profile, tmp_path, tiny_path, reference):
    root = tmp_path / "artifacts"
    partial, last = _kill_between_blocks(profile, root, tiny_path)
    digests, err = _build(profile, root, tiny_path)
    assert f"resuming quantize at block {last + 1}/{N_BLOCKS} (" in err and str(partial) in err, err[-2000:]
    if profile == "awq4":  # awq logs every block it runs: the restored ones were not run again
        ran = [i for i in range(N_BLOCKS) if f"awq block {i}:" in err]
        assert ran == list(range(last + 1, N_BLOCKS)), err[-2000:]
    assert digests == reference(profile)
    assert _leftovers(root) == []


def test_an_unreadable_partial_is_discarded_with_one_line_and_the_stage_restarts(tmp_path, tiny_path, reference):
    root = tmp_path / "artifacts"
    partial, _ = _kill_between_blocks("awq4", root, tiny_path)
    block0 = partial / block_file(0)
    block0.write_bytes(block0.read_bytes()[: block0.stat().st_size // 2])  # a truncated checkpoint
    digests, err = _build("awq4", root, tiny_path)
    line = f"{block0}: unreadable safetensors ("
    assert line in err and "partial discarded, quantize restarts at block 0" in err, err[-2000:]
    assert "resuming quantize" not in err and "awq block 0:" in err
    assert digests == reference("awq4")
    assert _leftovers(root) == []


def _vm_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no /proc/self/status VmRSS here")


def test_a_checkpointed_blocks_packed_weights_leave_memory_for_their_file(tmp_path):
    """After block i is saved, the hook's packed parts are readers of its file with the same bytes,
    and writing the stage's output from them does not leave them resident: 36 blocks of packed
    weights (2.6 GB at 3 bits) are never in memory together. Views of a map of the file would be:
    every page the write touches stays resident while the hook holds the view."""
    import torch

    from pipelines.checkpoint import Lazy, write_safetensors
    from pipelines.methods.weights import packed_state, spill_packed
    from pipelines.resume import BlockCheckpoint
    from quantizers.formats import PackedWeight

    gen = torch.Generator().manual_seed(0)
    names = [f"layers.0.{n}" for n in range(16)]  # 16 x 16 MiB of packed parts: 256 MiB
    packed = {n: PackedWeight("gptq", {"qweight": torch.randint(-2**31, 2**31 - 1, (2048, 2048), dtype=torch.int32,
                                                                 generator=gen),
                                       "scales": torch.rand(32, 4096, generator=gen).to(torch.float16)}, 4, 128, True)
              for n in names}
    before = {n: {p: t.clone() for p, t in pw.parts.items()} for n, pw in packed.items()}

    class Hook:
        def block_state(self, i):
            tensors, records = packed_state(packed, names)
            return tensors, {"packed": records}

    ckpt = BlockCheckpoint(tmp_path / "quantize" / "key.partial", print)
    ckpt.folder.mkdir(parents=True)
    assert ckpt.save(0, Hook(), None) is None  # nothing was pending
    assert ckpt.wait() == 0  # block 0's files are on disk now
    spill_packed(packed, ckpt.lazy(0))
    # the write first: reading the parts to check them would touch a map's pages before the baseline
    parts = {f"{n}.{p}": t for n, pw in packed.items() for p, t in pw.parts.items()}
    size = sum(t.nbytes for t in parts.values())
    rss = _vm_rss_bytes()
    write_safetensors(tmp_path / "out.safetensors", parts)
    grown = _vm_rss_bytes() - rss
    assert grown < size / 4, f"writing {size >> 20} MiB from the spilled parts left {grown >> 20} MiB resident"
    for n, pw in packed.items():
        for p, lazy in pw.parts.items():
            assert isinstance(lazy, Lazy) and lazy.dtype == before[n][p].dtype and lazy.shape == before[n][p].shape
            first = lazy.read()
            assert torch.equal(first, before[n][p])
            first.zero_()  # each read is fresh memory: an edit does not reach the next one
            assert torch.equal(lazy.read(), before[n][p])


def test_a_resumed_quant_stream_is_read_into_the_engines_buffer_not_a_map(tmp_path):
    """The restored quant stream lands in memory the engine allocates (page-locked on a GPU: every
    batch auto-round stages from it is then DMA), with the saved bytes; a map of the file would be
    pageable, each staged batch a synchronous copy."""
    import torch

    from pipelines.checkpoint import Lazy
    from pipelines.methods.weights import packed_state
    from pipelines.resume import BlockCheckpoint
    from quantizers.formats import PackedWeight

    gen = torch.Generator().manual_seed(1)
    packed = {"layers.0.q": PackedWeight("gptq", {"qweight": torch.randint(0, 99, (8, 64), dtype=torch.int32,
                                                                          generator=gen)}, 4, 64, True)}
    stream = torch.randn(4, 16, 32, generator=gen).to(torch.bfloat16)

    class Hook:
        restored = {}

        def block_state(self, i):
            tensors, records = packed_state(packed, list(packed))
            return tensors, {"packed": records}

        def restore_block(self, i, tensors, meta):
            self.restored[i] = (tensors, meta)

    folder = tmp_path / "quantize" / "key.partial"
    folder.mkdir(parents=True)
    first = BlockCheckpoint(folder, print)
    first.save(0, Hook(), stream)
    first.wait()

    given = []

    def empty(shape, dtype):
        given.append(torch.full(tuple(shape), 7, dtype=dtype))
        return given[-1]

    embeddings = torch.zeros_like(stream)
    hook = Hook()
    start, quant = BlockCheckpoint(folder, print).restore(hook, 3, embeddings, embeddings, empty=empty)
    assert start == 1 and len(given) == 1 and quant.data_ptr() == given[0].data_ptr()
    assert torch.equal(quant, stream) and quant.dtype == stream.dtype
    tensors, meta = hook.restored[0]
    assert all(isinstance(t, Lazy) for t in tensors.values())
    assert torch.equal(tensors["layers.0.q.qweight"].read(), packed["layers.0.q"].parts["qweight"])


def test_a_failed_checkpoint_write_is_raised_in_the_engine_not_lost_in_its_thread(tmp_path, monkeypatch):
    """The block files are written by a thread while the next block computes: a write that fails
    there (a full disk) stops the run at the next save or at the end, with the error, never silently."""
    import torch

    import pipelines.resume as resume

    def full_disk(path, tensors, metadata):
        raise OSError(28, "No space left on device", str(path))

    class Hook:
        def block_state(self, i):
            return {"w": torch.ones(2)}, {}

    ckpt = resume.BlockCheckpoint(tmp_path / "quantize" / "key.partial", print)
    ckpt.folder.mkdir(parents=True)
    monkeypatch.setattr(resume, "_write", full_disk)
    ckpt.save(0, Hook(), None)
    with pytest.raises(OSError, match="No space left on device"):
        ckpt.save(1, Hook(), None)
    assert ckpt.wait() is None  # the failed write was reported once; block 1's was not started
    assert list(ckpt.folder.iterdir()) == []
