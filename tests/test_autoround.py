"""autoround-q3: auto-round's SignRound on MOSS block inputs, one block at a time through its block API,
packed by our GPTQ packing."""
import json
from contextlib import nullcontext

import pytest
import torch

from pipelines import engine as blocks, calibration
from pipelines.backbone_export import export_backbone
from pipelines.checkpoint import Checkpoint
from pipelines.api import build
from pipelines.errors import PipelineError
from pipelines.evaluate import compare
from pipelines.loader import load_bundle, load_source
from pipelines.models.moss_tts_delay import MossTTSDelayConfig
from pipelines.api import plan as load_profile
from quantizers.autoround import AutoRoundConfig, _OneBlock, tune_block
from quantizers.errors import QuantizerError
from quantizers.formats import gptq
from quantizers.rtn import RTNConfig, quantize_rtn


@pytest.fixture(scope="module")
def ar_build(shipped):
    return shipped("autoround-q3")


def _manifest(ctx):
    return json.loads((ctx.bundle / "manifest.json").read_text())


def _block0(tiny_path, n: int):
    """The tiny fixture's block 0 on n x 64 tokens of moss-calib-v1: its inputs, rotary and source output."""
    ckpt = Checkpoint(tiny_path)
    mcfg = MossTTSDelayConfig.from_dict(ckpt.config())
    ids = calibration.build("moss-calib-v1", ckpt.config(), n, 64).ids
    x, pos = blocks.embed(mcfg, ckpt.get, ids), blocks.rotary(mcfg, 64)
    return ckpt, mcfg, x, pos, blocks.Engine(mcfg, ckpt.get).forward(blocks.load_block(mcfg, 0, ckpt.get), x, pos)


def test_autoround_q3_beats_rtn3_on_the_same_grid(ar_build, tiny_path):
    m = _manifest(ar_build)
    ar, base = m["evaluation"]["metrics"], m["evaluation"]["baseline"]
    rtn = base["metrics"]
    assert base["method"] == "rtn"
    # The baseline is what the project's RTN gives on autoround-q3's own grid (3-bit sym g128) ...
    assert {(e["bits"], e["group_size"], e["sym"]) for e in m["tensors"].values() if e["format"] == "gptq"} == {(3, 128, True)}
    ckpt = Checkpoint(tiny_path)
    config = ckpt.config()
    ev = m["stages"]["evaluate"]
    held = calibration.build(ev["dataset"], config, ev["nsamples"], ev["seqlen"])
    assert held.sha256 == m["evaluation"]["dataset"]["sha256"]
    linears = [k.removesuffix(".weight") for k, v in m["tensors"].items() if v["format"] == "gptq"]
    rtn_w = {k: quantize_rtn(ckpt.get(k + ".weight"), RTNConfig(3, 128, True)).dequantize() for k in linears}
    mine = compare(config, ckpt.get, lambda n: rtn_w[m] if (m := n.removesuffix(".weight")) in rtn_w else ckpt.get(n),
                   held.ids)
    assert mine["kl_audio_mean"] == pytest.approx(rtn["kl_audio_mean"], rel=1e-4)
    # ... and the tuned bundle beats it everywhere that matters.
    assert 0 < ar["kl_audio_mean"] < 0.2 * rtn["kl_audio_mean"]
    assert ar["kl_text"] < rtn["kl_text"]
    assert ar["final_rel_error"] < rtn["final_rel_error"]
    assert ar["top1_audio_mean"] > rtn["top1_audio_mean"]


def test_bundle_is_autoround_format_with_protected_tensors(ar_build):
    m = _manifest(ar_build)
    qc = json.loads((ar_build.bundle / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "auto-round" and qc["packing_format"] == "auto_round:auto_gptq"
    assert (qc["bits"], qc["group_size"], qc["sym"], qc["iters"]) == (3, 128, True, 200)  # auto-round's default
    assert qc["block_name_to_quantize"] == "language_model.layers"
    gptq = [k for k, v in m["tensors"].items() if v["format"] == "gptq"]
    assert len(gptq) == 28 and all(k.startswith("language_model.layers.") for k in gptq)
    assert {"language_model.embed_tokens.weight", "emb_ext.0.weight", "lm_heads.0.weight", "lm_heads.32.weight",
            "language_model.norm.weight", "language_model.layers.0.input_layernorm.weight"} <= set(m["protected"])
    bpw = m["bits_per_weight"]
    assert bpw["quantized_linear"] == pytest.approx(3 + (16 + 3) / 128)  # fp16 scales, 3-bit zeros per group
    assert bpw["effective"] > 3.5  # embeddings and heads are BF16: the point of recording it
    assert m["method"] == "autoround" and m["method_details"]["tuned_blocks"] == "language_model.layers"
    assert "quantize_block" in m["method_details"]["driven_by"]


def test_transformers_loads_the_exported_backbone_like_our_loader(ar_build, tiny_path, tmp_path):
    from transformers import AutoModelForCausalLM

    dest = export_backbone(ar_build.bundle, tmp_path / "backbone")
    cfg = json.loads((dest / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["quantization_config"]["block_name_to_quantize"] == "model.layers"
    # transformers' auto-round integration picks its own CPU kernel (it runs it in float16)
    hf = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32, device_map="cpu").eval()
    q_proj = hf.model.layers[0].self_attn.q_proj
    assert hasattr(q_proj, "qweight") and not isinstance(getattr(q_proj, "weight", None), torch.nn.Parameter)
    ours = load_bundle(ar_build.bundle, dtype=torch.float32)
    source = load_source(tiny_path, dtype=torch.float32)
    ids = calibration.build("moss-heldout-v1", Checkpoint(ar_build.bundle).config(), 2, 64).ids
    with torch.no_grad():
        x = ours.embed(ids)
        h_ours = ours.language_model(inputs_embeds=x, use_cache=False).last_hidden_state
        h_hf = hf.model(inputs_embeds=x.to(hf.dtype), use_cache=False).last_hidden_state.float()
        h_src = source.language_model(inputs_embeds=x, use_cache=False).last_hidden_state
        top1_hf = hf(inputs_embeds=x.to(hf.dtype), use_cache=False).logits.argmax(-1)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    quant_error = rel(h_ours, h_src)  # what 3-bit quantization does: the check must see far less than this
    assert rel(h_hf, h_ours) < min(2e-3, quant_error / 10), (rel(h_hf, h_ours), quant_error)
    assert (top1_hf == ours.lm_heads[0](h_ours).argmax(-1)).float().mean() > 0.95


def test_export_refuses_an_existing_folder(ar_build, tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(PipelineError, match="already exists"):
        export_backbone(ar_build.bundle, tmp_path / "taken")


@pytest.fixture(scope="module")
def small_run(tiny_path):
    """Block 0 of the tiny fixture tuned by auto-round's block API directly, every hub path trapped."""
    import datasets
    import huggingface_hub
    from auto_round import calib_dataset

    fetched = []

    def trap(name):
        def f(*a, **k):
            fetched.append(name)
            raise RuntimeError(f"auto-round tried to fetch through {name}")
        return f

    from auto_round.algorithms.block_runner import BlockForwardRunner

    whole_passes, forward = [], BlockForwardRunner.forward

    def counted(self, block, inputs, others, indices=None, cache_device=None):
        if indices is None:  # a pass over every sample (tuning batches pass indices)
            whole_passes.append(len(inputs))
        return forward(self, block, inputs, others, indices, cache_device)

    mp = pytest.MonkeyPatch()
    mp.setattr(BlockForwardRunner, "forward", counted)
    mp.setattr(calib_dataset, "get_dataloader", trap("get_dataloader"))
    mp.setattr(datasets, "load_dataset", trap("datasets.load_dataset"))
    for fn in ("hf_hub_download", "snapshot_download"):
        mp.setattr(huggingface_hub, fn, trap(fn))
    ckpt = Checkpoint(tiny_path)
    mcfg = MossTTSDelayConfig.from_dict(ckpt.config())
    ids = calibration.build("moss-calib-v1", ckpt.config(), 4, 64).ids
    x, pos = blocks.embed(mcfg, ckpt.get, ids), blocks.rotary(mcfg, 64)
    layer = blocks.load_block(mcfg, 0, ckpt.get)
    reference = blocks.Engine(mcfg, ckpt.get).forward(layer, x, pos)
    deterministic_before = torch.are_deterministic_algorithms_enabled()
    try:
        ours = tune_block(layer, x, reference, pos,
                          AutoRoundConfig(iters=2, nsamples=4, seqlen=64, batch_size=2), seed=0, device="cpu")
    finally:
        mp.undo()
    return layer, ours, fetched, deterministic_before, whole_passes


def test_never_fetches_from_a_hub_and_hands_back_process_settings(small_run):
    _, ours, fetched, deterministic_before, _ = small_run
    assert fetched == []
    assert torch.are_deterministic_algorithms_enabled() == deterministic_before
    assert len(ours) == 7


def test_auto_round_makes_no_pass_over_all_samples(small_run):
    """It fits to the engine's fp output (not recomputed) and leaves the tuned block's outputs to the
    engine (no copy of them of its own): no forward over the whole calibration set."""
    assert small_run[-1] == []


def test_the_tuned_block_holds_exactly_the_weights_its_integers_give(small_run):
    """The engine runs the tuned block on the quant stream: its weights are the packed integers'
    dequantization, so the next block is tuned on what the bundle computes."""
    layer, ours, *_ = small_run
    for name, iw in ours.items():
        w = layer.get_submodule(name).weight
        assert torch.equal(w, iw.dequantize(w.dtype)), name


def test_the_integers_are_computed_where_the_tuned_weight_is():
    """On a GPU the tuned block's integers, and then their packing, are computed on the device (on
    the host they took seconds a block at 8B widths). Without a GPU here, the meta device stands in:
    a weight there with auto-round's scale on the host gives integers, scales and zeros there."""
    import torch
    from torch import nn

    from quantizers.autoround import int_weight

    layer = nn.Linear(256, 8, bias=False, device="meta", dtype=torch.bfloat16)
    layer.scale, layer.zp, layer.bits, layer.group_size, layer.sym = torch.rand(8, 2).to(torch.bfloat16), 4, 3, 128, True
    iw = int_weight(layer)
    assert {iw.q.device.type, iw.scales.device.type, iw.zeros.device.type} == {"meta"}
    assert iw.q.shape == (8, 256) and iw.q.dtype == torch.int32


def test_best_params_kept_in_place_give_what_auto_rounds_own_copies_give(tiny_path, monkeypatch):
    """auto-round's best-so-far parameters, overwritten in place on the device instead of copied anew
    at every improvement: the same integers and scales, bit for bit, and auto-round's own function is
    back afterwards."""
    import contextlib

    from auto_round.algorithms.quantization.sign_round import quantizer
    from quantizers import autoround

    ckpt, mcfg, x, pos, reference = _block0(tiny_path, 4)
    cfg = AutoRoundConfig(iters=6, nsamples=4, seqlen=64, batch_size=2, lr=0.01)  # the loss improves every step
    own = quantizer.collect_best_params
    calls = []

    def counted(*a, **k):
        calls.append(1)
        return own(*a, **k)

    ours = tune_block(blocks.load_block(mcfg, 0, ckpt.get), x, reference, pos, cfg, seed=0, device="cpu")
    assert quantizer.collect_best_params is own
    monkeypatch.setattr(autoround, "best_params_in_place", contextlib.nullcontext)
    monkeypatch.setattr(quantizer, "collect_best_params", counted)
    theirs = tune_block(blocks.load_block(mcfg, 0, ckpt.get), x, reference, pos, cfg, seed=0, device="cpu")
    assert len(calls) > 1  # several improvements: a kept reference instead of a copy would show
    for name, iw in ours.items():
        assert torch.equal(iw.q, theirs[name].q) and torch.equal(iw.scales, theirs[name].scales), name


def test_the_tuned_block_is_not_sent_to_the_host_and_back(tiny_path, monkeypatch):
    """auto-round's block API ends by moving the block to the host (`mv_module_from_gpu`); the engine
    runs it next on the device, so tune_block keeps it there: auto-round's mover is not called for
    the block, and is back afterwards."""
    from auto_round.compressors import orchestrator

    ckpt, mcfg, x, pos, reference = _block0(tiny_path, 2)
    moved, mover = [], orchestrator.mv_module_from_gpu
    monkeypatch.setattr(orchestrator, "mv_module_from_gpu", lambda m: moved.append(m) or mover(m))
    recorder = orchestrator.mv_module_from_gpu
    cfg = AutoRoundConfig(iters=2, nsamples=2, seqlen=64, batch_size=2, lr=0.01)
    layer = blocks.load_block(mcfg, 0, ckpt.get)
    assert tune_block(layer, x, reference, pos, cfg, seed=0, device="cpu")
    assert moved == [] and orchestrator.mv_module_from_gpu is recorder
    orchestrator.mv_module_from_gpu(layer)  # (what the test would see, were the block sent)
    assert moved == [layer]


def test_auto_rounds_collections_walk_only_the_objects_of_its_block(tiny_path, monkeypatch):
    """auto-round's full garbage collections during a block's tuning skip the objects the process held
    before (frozen: hundreds of thousands, 0.2-0.3 s a walk here), the freeze is undone after, and
    the block leaves no garbage in cycles behind (auto-round's self-referring Linear wrappers, which
    hold the block's Linears: on a GPU, its weights), which no later young collection would free."""
    import gc

    ckpt, mcfg, x, pos, reference = _block0(tiny_path, 2)
    frozen, collect = [], gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: frozen.append(gc.get_freeze_count()) or collect(*a))
    cfg = AutoRoundConfig(iters=2, nsamples=2, seqlen=64, batch_size=2, lr=0.01)
    collect()  # what the set-up left
    for i in range(2):
        assert tune_block(blocks.load_block(mcfg, i, ckpt.get), x, reference, pos, cfg, seed=0, device="cpu")
    assert len(frozen) >= 4 and min(frozen) > 10_000  # auto-round collected, the process's objects set aside
    assert gc.get_freeze_count() == 0
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        collect()
        left = [type(o).__name__ for o in gc.garbage if isinstance(o, (torch.Tensor, torch.nn.Module))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert left == [], left


def test_batches_staged_a_step_ahead_give_what_auto_rounds_own_gathering_gives(tiny_path, monkeypatch):
    """The batches auto-round draws, copied into slots a step ahead from its own sampler's forecast
    (on a side stream on CUDA; here the same bookkeeping on the host): the same integers and scales
    bit for bit, every batch after the first one forecast right (the sampler reshuffles every 2
    steps here), the loop fed from the slots, and auto-round's functions back afterwards."""
    from auto_round.algorithms.quantization.sign_round.quantizer import IndexSampler, SignRoundQuantizer
    from quantizers import autoround

    ckpt, mcfg, x, pos, reference = _block0(tiny_path, 4)
    cfg = AutoRoundConfig(iters=7, nsamples=4, seqlen=64, batch_size=2, lr=0.01)
    plain = tune_block(blocks.load_block(mcfg, 0, ckpt.get), x, reference, pos, cfg, seed=0, device="cpu")
    served, row = [], autoround._Slots.row
    monkeypatch.setattr(autoround._Slots, "row", lambda self, k, i: served.append(row(self, k, i)) or served[-1])
    tune, draw = SignRoundQuantizer.quantize_block, IndexSampler.next_batch
    with autoround.staged_batches("cpu") as counts:
        staged = tune_block(blocks.load_block(mcfg, 0, ckpt.get), x, reference, pos, cfg, seed=0, device="cpu")
    assert (SignRoundQuantizer.quantize_block, IndexSampler.next_batch) == (tune, draw)
    assert counts == {"prefetched": cfg.iters - 1, "copied_when_drawn": 1}
    hits = sum(t is not None for t in served)
    # every row of both streams the loop read came from a slot; off the slot, at most one read a step
    # (auto-round's runner reads sample 0 for its device)
    assert hits >= 2 * cfg.iters * cfg.batch_size and len(served) - hits <= cfg.iters
    for name, iw in plain.items():
        assert torch.equal(iw.q, staged[name].q) and torch.equal(iw.scales, staged[name].scales), name


def test_compiled_tuning_gets_one_static_graph_per_weight_shape_and_grid():
    """auto-round's weight quantizer under `static_shapes` (what a compiled tuning runs in): every
    (shape, bits, group_size) its Linears meet gets a graph of its own with nothing symbolic, none
    falls back to eager, and dynamo's settings are back afterwards. Without it, dynamo's automatic
    dynamic shapes give fewer graphs, symbolic in shape, bits and group size."""
    import torch._dynamo
    from auto_round.data_type.int import quant_tensor_sym

    from quantizers.autoround import static_shapes

    shapes, grids = [(256, 256), (64, 256), (768, 256), (256, 768)], [(3, 128), (2, 128), (4, 128), (3, 64), (2, 64)]

    def compile_all(ctx):
        torch._dynamo.reset()
        graphs = []

        def counting(gm, example_inputs):
            graphs.append(any(isinstance(e, torch.SymInt) or (isinstance(e, torch.Tensor) and any(
                isinstance(d, torch.SymInt) for d in e.shape)) for e in example_inputs))
            return gm.forward

        quant = torch.compile(quant_tensor_sym, backend=counting)
        with ctx:
            for _ in range(2):  # the second pass (the next block) compiles nothing
                for bits, group in grids:
                    for out_f, in_f in shapes:
                        groups = out_f * in_f // group
                        v = torch.zeros(groups, group, requires_grad=True)
                        lo, hi = torch.ones(groups, requires_grad=True), torch.ones(groups, requires_grad=True)
                        q, _, _ = quant(torch.randn(out_f, in_f, dtype=torch.bfloat16), bits=bits, group_size=group,
                                        v=v, min_scale=lo, max_scale=hi, scale_dtype=torch.float16)
                        q.float().sum().backward()
        return graphs

    before = (torch._dynamo.config.automatic_dynamic_shapes, torch._dynamo.config.recompile_limit)
    static = compile_all(static_shapes())
    assert len(static) == len(shapes) * len(grids) and not any(static)
    assert (torch._dynamo.config.automatic_dynamic_shapes, torch._dynamo.config.recompile_limit) == before
    dynamic = compile_all(nullcontext())
    assert len(dynamic) < len(static) and any(dynamic)
    torch._dynamo.reset()


@pytest.mark.parametrize("cpu_has_bf16", [True, False])
def test_a_bf16_block_tunes_in_bf16_on_every_cpu_without_asking_it(tiny_path, monkeypatch, cpu_has_bf16):
    """auto-round's CPU probe (a py-cpuinfo subprocess) would cast the block to fp32 on a CPU without
    bf16 instructions: another tuning on another machine. It is not asked, and the integers are those
    a bf16 tuning gives."""
    from auto_round.utils import device as ar_device
    from auto_round.utils.device_manager import get_ar_device

    asked = []

    class Probe:
        def __init__(self):
            asked.append(1)
            self.bf16 = cpu_has_bf16

    ckpt, mcfg, x, pos, reference = _block0(tiny_path, 4)
    cfg = AutoRoundConfig(iters=4, nsamples=4, seqlen=64, batch_size=2, lr=0.01)
    bf16 = tune_block(blocks.load_block(mcfg, 0, ckpt.get), x, reference, pos, cfg, seed=0, device="cpu")
    monkeypatch.setattr(ar_device, "CpuInfo", Probe)
    monkeypatch.delattr(get_ar_device("cpu"), "_bf16_supported", raising=False)  # as in a fresh process
    layer = blocks.load_block(mcfg, 0, ckpt.get)
    here = tune_block(layer, x, reference, pos, cfg, seed=0, device="cpu")
    assert asked == [] and layer.mlp.up_proj.weight.dtype == torch.bfloat16
    for name, iw in bf16.items():
        assert torch.equal(iw.q, here[name].q) and torch.equal(iw.scales, here[name].scales), name


def test_a_reference_of_another_shape_is_one_clear_error(tiny_path):
    x = torch.zeros(2, 64, 256)
    with pytest.raises(QuantizerError, match=r"block reference: expected shape \[2, 64, 256\], got \[2, 32, 256\]"):
        tune_block(None, x, x[:, :32], None, AutoRoundConfig(iters=2, nsamples=2, seqlen=64), seed=0, device="cpu")


def test_our_gptq_packing_is_bit_identical_to_autoround_pack_layer(small_run):
    """auto-round's own packer (what its save_quantized writes for auto_round:auto_gptq) on the tuned layers."""
    from auto_round.export.export_to_autoround.export import pack_layer

    layer, ours, *_ = small_run
    model = _OneBlock(layer, torch.bfloat16)
    for name, iw in ours.items():
        assert iw.bits == 3 and iw.sym and int(iw.q.max()) <= 7
        pack_layer(f"model.layers.0.{name}", model, "auto_round:auto_gptq")
        ref = model.get_submodule(f"model.layers.0.{name}")
        for part, t in gptq.pack(iw).items():
            want = getattr(ref, part)
            assert want.dtype == t.dtype and torch.equal(want.cpu(), t), f"{name}.{part}"


def _profile(tmp_path, calibrate, quantize) -> str:
    lines = ["name: ar-bad", "kind: generator", "seed: 0", "stages:"]
    if calibrate:
        lines.append(f"  calibrate: {calibrate}")
    lines += [f"  quantize: {quantize}", "  export: {shard_size_mb: 64}"]
    p = tmp_path / "ar-bad.yaml"
    p.write_text("\n".join(lines) + "\n")
    return str(p)


@pytest.mark.parametrize("bad, key", [("bits: 5", "bits"), ("group_size: 96", "group_size"), ("iters: 0", "iters")])
def test_unsupported_grid_is_refused_at_load(tmp_path, bad, key):
    path = _profile(tmp_path, "{nsamples: 4, seqlen: 64}", f"{{method: autoround, {bad}}}")
    with pytest.raises(PipelineError, match=rf"stages\.quantize\.{key}: .*(not supported|must be)"):
        load_profile(path, "tiny")


def _nothing_written(root):
    assert not (root / "bundles").exists()
    assert not list((root / "cache").glob("quantize/*"))


def test_calibration_shorter_than_seqlen_is_refused(tmp_path):
    path = _profile(tmp_path, "{nsamples: 4, seqlen: 64}",
                    "{method: autoround, iters: 2, nsamples: 4, seqlen: 128, batch_size: 2}")
    with pytest.raises(PipelineError, match=r"0 of 4 calibration sequences are usable \(length 64, quantize.seqlen is 128\)"):
        build(path, "tiny", cache_root=tmp_path / "cache", bundle_root=tmp_path / "bundles")
    _nothing_written(tmp_path)


def test_fewer_calibration_sequences_than_nsamples_is_refused(tmp_path):
    path = _profile(tmp_path, "{nsamples: 4, seqlen: 64}",
                    "{method: autoround, iters: 2, nsamples: 8, seqlen: 64, batch_size: 2}")
    with pytest.raises(PipelineError, match="4 of 4 calibration sequences are usable.*nsamples needs 8"):
        build(path, "tiny", cache_root=tmp_path / "cache", bundle_root=tmp_path / "bundles")
    _nothing_written(tmp_path)


def test_no_calibration_stage_is_one_clear_error(tmp_path):
    path = _profile(tmp_path, None, "{method: autoround, iters: 2, nsamples: 4, seqlen: 64}")
    with pytest.raises(PipelineError, match="method 'autoround' needs a calibrate stage"):
        build(path, "tiny", cache_root=tmp_path / "cache", bundle_root=tmp_path / "bundles")
    _nothing_written(tmp_path)


def test_autoround_q3_exports_to_a_bit_exact_gguf(ar_build, tmp_path):
    """auto-round's symmetric int3 g128 as Q4_0 (d = s, code q + 4)."""
    pytest.importorskip("gguf")
    from test_gguf_export import check_round_trip, export

    r = export(ar_build.bundle, tmp_path / "ar3.gguf")
    assert r.returncode == 0 and "not bit-exact" not in r.stdout, r.stderr
    check_round_trip(ar_build.bundle, tmp_path / "ar3.gguf", "Q4_0")
