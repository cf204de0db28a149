import math

import pytest
import torch

from pipelines import engine as blocks
from pipelines.checkpoint import Checkpoint
from pipelines.fixtures import fixture_config, tensor_specs
from pipelines.loader import load_source
from pipelines.models.moss_tts_delay import MossTTSDelayConfig, block_linear_names


def test_full_shape_matches_the_real_8b_inventory():
    specs = tensor_specs(fixture_config("full-shape"))
    assert len(specs) == 463
    assert sum(math.prod(s) for s in specs.values()) == 8_489_841_664
    cfg = MossTTSDelayConfig.from_dict(fixture_config("full-shape"))
    linears = block_linear_names(cfg)
    assert len(linears) == 252
    assert sum(math.prod(specs[n + ".weight"]) for n in linears) == 6_945_767_424
    assert specs["emb_ext.31.weight"] == (1025, 4096) and specs["lm_heads.0.weight"] == (155648, 4096)


def test_tiny_fixture_is_hard_like_a_trained_model(tiny_path):
    ck = Checkpoint(tiny_path)
    gains = ck.get("language_model.layers.0.input_layernorm.weight").float()
    big = (gains > 15).sum().item()
    assert 2 <= big <= 0.02 * gains.numel() + 1  # a few outlier channels, x20-50
    assert gains.max() > 20 and gains.max() < 55
    w = ck.get("language_model.layers.0.mlp.up_proj.weight").float().flatten()
    z = (w - w.mean()) / w.std()
    assert (z**4).mean() > 3.5  # heavier tails than a Gaussian (kurtosis 3)


class _FPOnly:
    streams, capture = (blocks.FP,), ()

    def on_block(self, step):
        return None


def test_forward_takes_33_channels_and_matches_block_streaming(tiny_path):
    model = load_source(tiny_path, dtype=torch.float32)
    cfg = model.config
    ids = torch.randint(0, 60, (2, 9, 1 + cfg.n_vq))
    logits = model(ids)
    assert len(logits) == 1 + cfg.n_vq
    assert logits[0].shape == (2, 9, cfg.vocab_size)
    assert logits[1].shape == (2, 9, cfg.audio_vocab_size + 1)
    assert torch.isinf(logits[1][..., cfg.audio_pad_code]).all()
    # The layer-by-layer path every method uses gives the same logits as the module tree.
    ck = Checkpoint(tiny_path)
    get = lambda n: ck.get(n).float()
    engine = blocks.Engine(cfg, get, "cpu", torch.float32)
    engine.run(_FPOnly(), ids)
    h = blocks.final_norm(cfg, get, engine.last[blocks.FP])
    streamed = [h @ get(f"lm_heads.{k}.weight").t() for k in range(cfg.n_vq + 1)]
    for k in range(1, len(streamed)):
        streamed[k][..., cfg.audio_pad_code] = float("-inf")
    for a, b in zip(logits, streamed):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # the audio channels matter: changing codebook 5 changes the output
    ids2 = ids.clone()
    ids2[..., 6] = (ids2[..., 6] + 1) % 60
    assert not torch.allclose(model(ids2)[0], logits[0])


def test_wrong_channel_count_is_refused(tiny_path):
    model = load_source(tiny_path, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"expected shape \(B, S, 33\)"):
        model(torch.zeros(1, 4, 5, dtype=torch.long))


def test_checkpoint_reads_are_private_copies(tiny_path):
    ckpt = Checkpoint(tiny_path)
    name = "language_model.layers.0.self_attn.q_proj.weight"
    first = ckpt.get(name)
    before = first.clone()
    first.mul_(0)  # a method scaling a weight in place must not change the source
    assert torch.equal(ckpt.get(name), before)


@pytest.mark.parametrize("body", [b"abc", b"\xff\xff\xff\xff\xff\x00\x00\x00{}", b"\x05\x00\x00\x00\x00\x00\x00\x00[1,2]",
                                  b"\x10\x00\x00\x00\x00\x00\x00\x00" + b'{"w": {"x": 1}}'.ljust(16)])
def test_a_bad_safetensors_header_is_one_line_naming_the_file(tmp_path, body):
    from pipelines.errors import PipelineError

    (tmp_path / "model.safetensors").write_bytes(body)
    with pytest.raises(PipelineError, match=r"model\.safetensors: unreadable safetensors shard \(bad header") as e:
        Checkpoint(tmp_path)
    assert "\n" not in str(e.value)


class _QuantStream:
    """A quant-stream hook: the source block with down_proj halved is the quantized block. With
    `reads_fp_in` it reads the fp input and returns the stream's output itself (nothing can be
    overwritten); without, it returns the block, as auto-round's hook does."""

    streams, capture = (blocks.FP, blocks.QUANT), ()

    def __init__(self, reads_fp_in: bool):
        self.reads_fp_in, self.seen = reads_fp_in, []

    def on_block(self, step):
        import copy

        self.seen.append({"fp_in": step.fp_in is not None, "fp_out": step.fp_out.data_ptr(),
                          "quant_in": step.quant_in.data_ptr()})
        block = copy.deepcopy(step.layer)
        block.mlp.down_proj.weight.mul_(0.5)
        return step.run(block, step.quant_in) if self.reads_fp_in else block


def test_streams_are_overwritten_in_place_where_nothing_reads_them_with_the_same_values(tiny_path):
    """A hook that reads only the fp output, and returns its quantized block, gets both streams each
    in one host buffer (at 128 x 2048 tokens of an 8B a block holds 4 GiB of streams, not 8), with
    bit for bit the values of a run that keeps every stream."""
    ck = Checkpoint(tiny_path)
    cfg = MossTTSDelayConfig.from_dict(ck.config())
    ids = torch.randint(0, 60, (5, 9, 1 + cfg.n_vq))
    runs = {}
    for reads in (True, False):
        engine, hook = blocks.Engine(cfg, ck.get, "cpu", batch_size=2), _QuantStream(reads)
        engine.run(hook, ids)
        runs[reads] = engine.last, hook.seen
    (kept, seen_kept), (in_place, seen) = runs[True], runs[False]
    assert len(seen) == cfg.num_layers >= 3
    for stream in (blocks.FP, blocks.QUANT):
        assert torch.equal(kept[stream], in_place[stream])
    assert not torch.equal(in_place[blocks.FP], in_place[blocks.QUANT])
    assert not any(s["fp_in"] for s in seen) and all(s["fp_in"] for s in seen_kept)
    # one buffer per stream (block 0's fp output is new: its input is also the quant stream's)
    assert len({s["fp_out"] for s in seen}) == 1 and len({s["quant_in"] for s in seen}) == 1
    assert len({s["fp_out"] for s in seen_kept}) > 1  # (a freed buffer's address can come back)


def test_a_long_runs_block_lines_split_each_block_by_phase(tiny_path):
    """With block lines on, each block's log line gives its wall time and the phases it went to
    (load, the two forwards, the hook; with checkpoints, their writes too), which add up to it:
    where a 36-block run's time went, when its bar is silent off a terminal. Off, no line."""
    import re

    ck = Checkpoint(tiny_path)
    cfg = MossTTSDelayConfig.from_dict(ck.config())
    lines = []
    engine = blocks.Engine(cfg, ck.get, "cpu", batch_size=2, log=lines.append, block_lines=True)
    engine.run(_QuantStream(reads_fp_in=False), torch.randint(0, 60, (3, 9, 1 + cfg.n_vq)))
    assert len(lines) == cfg.num_layers
    for i, line in enumerate(lines):
        m = re.fullmatch(rf"blocks block {i} of {cfg.num_layers}: ([\d.]+) s \((.*)\), host RSS .*", line)
        assert m, line
        laps = dict(re.fullmatch(r"(.+) ([\d.]+)", lap).groups() for lap in m[2].split(", "))
        assert list(laps) == ["load", "fp forward", "hook", "quant forward"]
        assert abs(sum(map(float, laps.values())) - float(m[1])) <= 0.05 + 0.01 * len(laps)
    quiet = []
    blocks.Engine(cfg, ck.get, "cpu", batch_size=2, log=quiet.append).run(_QuantStream(False), torch.randint(0, 60, (3, 9, 1 + cfg.n_vq)))
    assert quiet == []


def test_prefetch_reads_the_next_block_while_the_hook_runs_with_the_same_values(tiny_path):
    """With prefetch, block i+1's tensors are asked of the getter while block i's hook runs (on a GPU
    the tuning hides their read and NaN/Inf check), and the streams are bit for bit those of a run
    without it. A getter's error is raised by the run, at the block it belongs to."""
    import threading

    from pipelines.errors import PipelineError
    from pipelines.models.moss_tts_delay import BLOCK_PREFIX

    ck = Checkpoint(tiny_path)
    cfg = MossTTSDelayConfig.from_dict(ck.config())
    ids = torch.randint(0, 60, (3, 9, 1 + cfg.n_vq))
    plain = blocks.Engine(cfg, ck.get, "cpu", batch_size=2)
    plain.run(_QuantStream(False), ids)

    asked = threading.Event()

    def get(name):
        if name.startswith(f"{BLOCK_PREFIX}.1."):
            asked.set()
        return ck.get(name)

    class WaitsForBlock1(_QuantStream):
        def on_block(self, step):
            if step.index == 0:
                assert asked.wait(10), "block 1 was not read while block 0's hook ran"
            return super().on_block(step)

    ahead = blocks.Engine(cfg, get, "cpu", batch_size=2, prefetch=True)
    ahead.run(WaitsForBlock1(False), ids)
    for stream in (blocks.FP, blocks.QUANT):
        assert torch.equal(plain.last[stream], ahead.last[stream])

    broken = f"{BLOCK_PREFIX}.2.mlp.up_proj.weight"

    def failing(name):
        if name == broken:
            raise PipelineError(f"tensor {name} contains NaN or Inf")
        return ck.get(name)

    hook = _QuantStream(False)
    with pytest.raises(PipelineError, match=broken):
        blocks.Engine(cfg, failing, "cpu", batch_size=2, prefetch=True).run(hook, ids)
    assert len(hook.seen) == 2  # blocks 0 and 1 ran; block 2's read failed during block 1, raised at block 2
