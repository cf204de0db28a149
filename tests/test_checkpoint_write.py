"""The streamed safetensors writer gives the bytes safetensors' own `save_file` gives, and reads
each tensor only when it writes it."""
import pytest
import torch
from safetensors.torch import save_file

from pipelines.checkpoint import DTYPES, Checkpoint, Lazy, write_safetensors, write_sharded
from pipelines.errors import PipelineError


def every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, (code, dt) in enumerate(sorted(DTYPES.items())):
        raw = torch.randint(0, 2 if dt == torch.bool else 256, (3 + i, 5), dtype=torch.uint8, generator=g)
        out[f"t{9 - i}.{code.lower()}"] = raw.view(dt) if dt.itemsize == 1 else torch.randn(3 + i, 5 + i, generator=g).to(dt)
    out["scalar"] = torch.tensor(1.5)
    out["empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    out["z.bool"] = torch.tensor([True, False, True])
    return out


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_the_streamed_file_has_save_files_bytes(tmp_path, metadata):
    tensors = every_dtype()
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata)
    write_safetensors(tmp_path / "ours.safetensors", tensors, metadata)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_several_metadata_keys_are_written_sorted(tmp_path):
    """save_file orders several metadata keys as a Rust HashMap does (random per process); ours
    sorts them, so the bytes do not depend on the dict's order, and the rest is save_file's."""
    import json

    tensors, meta = every_dtype(), {"format": "pt", "block": "3", "state": '{"a": "é\\n"}'}
    write_safetensors(tmp_path / "a.safetensors", tensors, meta)
    write_safetensors(tmp_path / "b.safetensors", tensors, dict(reversed(meta.items())))
    save_file(tensors, str(tmp_path / "ref.safetensors"), meta)
    ours, ref = ((tmp_path / f).read_bytes() for f in ("a.safetensors", "ref.safetensors"))
    assert ours == (tmp_path / "b.safetensors").read_bytes()
    n = int.from_bytes(ours[:8], "little")
    assert list(json.loads(ours[8:8 + n])["__metadata__"]) == sorted(meta)
    assert json.loads(ours[8:8 + n]) == json.loads(ref[8:8 + n]) and ours[8 + n:] == ref[8 + n:]


def test_tensors_are_read_one_at_a_time_and_checked(tmp_path):
    import weakref

    src, reads, last = every_dtype(), [], []

    def reader(name):
        def read():
            assert not last or last[-1]() is None, f"{name} read while {reads[-1]} is still held"
            t = src[name].clone()  # a fresh tensor: only the writer holds it
            reads.append(name)
            last.append(weakref.ref(t))
            return t
        return read

    lazies = {k: Lazy(t.dtype, tuple(t.shape), reader(k)) for k, t in src.items()}
    names = write_sharded(tmp_path, lazies, max_shard_bytes=200)
    assert len(names) > 2 and sorted(reads) == sorted(src)  # several shards, every tensor read exactly once
    back = Checkpoint(tmp_path)
    for k, t in src.items():
        raw = lambda x: x.reshape(-1).view(torch.uint8)  # noqa: E731  (bytes: random fp8 bytes hold NaNs)
        assert torch.equal(raw(back.get(k, check_finite=False)), raw(t)), k

    bad = {"w": Lazy(torch.float32, (2, 2), lambda: torch.zeros(2, 3))}
    with pytest.raises(PipelineError, match=r"tensor w came as torch.float32 \[2, 3\], expected torch.float32 \[2, 2\]"):
        write_safetensors(tmp_path / "bad.safetensors", bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn])
def test_a_nan_or_an_infinity_anywhere_in_a_tensor_is_found(dtype):
    from pipelines.checkpoint import all_finite

    n = 3 * (1 << 10) + 5  # several chunks of 1024, and a ragged last one
    clean = torch.linspace(-4, 4, n).to(dtype)
    assert all_finite(clean, chunk=1 << 10) and all_finite(clean[:0])
    bad = [float("nan")] + ([] if dtype == torch.float8_e4m3fn else [float("inf"), float("-inf")])  # e4m3fn has no inf
    for value in bad:
        for at in (0, 1 << 10, n // 2, n - 1):
            t = clean.clone()
            t[at] = value
            assert not all_finite(t, chunk=1 << 10), (value, at)
