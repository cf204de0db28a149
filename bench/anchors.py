"""The anchors run directly: autoawq's and auto-round's own quantize on the fixture's Qwen3 backbone.

The backbone is the fixture's `language_model.*` (+ `lm_heads.0` as `lm_head`) saved as a plain
Qwen3ForCausalLM folder with a word-level tokenizer over the same vocab, so both libraries load it
offline the way a user loads Qwen3. Each anchor gets the settings of the profile it is compared
with (samples, length, iterations, batch, bits, group, seed); its calibration is seeded random
token ids of that count and length (the content does not change the cost).
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from pipelines.atomic import atomic_folder
from pipelines.checkpoint import INDEX, Checkpoint, canonical_json, shard_names, shard_plan
from pipelines.api import plan
from pipelines.stages import _stats_end, _stats_start

SHARD_BYTES = 5 << 30


def write_backbone(fixture: Path, out: Path) -> Path:
    """The fixture's Qwen3 backbone as a Qwen3ForCausalLM folder (+ tokenizer), written atomically."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ckpt = Checkpoint(fixture)
    names = {"model." + k.removeprefix("language_model."): k for k in ckpt.keys() if k.startswith("language_model.")}
    names["lm_head.weight"] = "lm_heads.0.weight"
    plan = shard_plan({k: 2 * math.prod(ckpt.shape(v)) for k, v in names.items()}, SHARD_BYTES)
    files = shard_names(len(plan))
    with atomic_folder(out) as tmp:
        for fname, keys in zip(files, plan):  # one shard in memory at a time
            save_file({k: ckpt.get(names[k]) for k in keys}, str(tmp / fname), {"format": "pt"})
        if len(files) > 1:
            weight_map = {k: f for f, keys in zip(files, plan) for k in keys}
            (tmp / INDEX).write_text(canonical_json({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}))
        lc = ckpt.config()["language_config"]
        config = {**lc, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "dtype": "bfloat16", "use_cache": False}
        (tmp / "config.json").write_text(canonical_json(config, indent=2))
        vocab = {f"t{i}": i for i in range(lc["vocab_size"])}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", model_max_length=1 << 20).save_pretrained(tmp)
    return out


def settings(anchor: str, model: str, profile: str | None = None) -> dict:
    """The anchor's arguments, taken from the matching profile (or a copy of it) as resolved for `model`;
    a `-defaults` anchor gets only what a user states (width, group, samples, length, iterations) and
    the library's own defaults for everything else."""
    prof = plan(profile or ANCHORS[anchor], model)
    q = prof.stages["quantize"].config
    if anchor == "autoawq-defaults":
        return {"quant_config": {"w_bit": q.bits, "q_group_size": q.group_size, "zero_point": q.zero_point,
                                 "version": q.version.upper()},
                "max_calib_samples": q.nsamples, "max_calib_seq_len": q.seqlen, "seed": prof.seed, "defaults": True}
    if anchor == "auto-round-defaults":
        return {"bits": q.bits, "group_size": q.group_size, "sym": q.sym, "iters": q.iters, "nsamples": q.nsamples,
                "seqlen": q.seqlen, "seed": prof.seed, "defaults": True}
    if anchor == "autoawq":
        return {"quant_config": {"w_bit": q.bits, "q_group_size": q.group_size, "zero_point": q.zero_point,
                                 "version": q.version.upper()},
                "max_calib_samples": q.nsamples, "max_calib_seq_len": q.seqlen,
                "n_parallel_calib_samples": q.batch_size, "duo_scaling": q.duo_scaling, "apply_clip": q.apply_clip,
                "seed": prof.seed}
    return {"bits": q.bits, "group_size": q.group_size, "sym": q.sym, "iters": q.iters, "nsamples": q.nsamples,
            "seqlen": q.seqlen, "batch_size": q.batch_size, "lr": q.lr,
            "enable_deterministic_algorithms": q.enable_deterministic_algorithms,
            "low_gpu_mem_usage": q.low_gpu_mem_usage, "enable_torch_compile": q.enable_torch_compile, "seed": prof.seed}


def calib_ids(folder: Path, n: int, seqlen: int, seed: int) -> torch.Tensor:
    import json

    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    return torch.randint(0, vocab, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def run_autoawq(folder: Path, s: dict, device: str) -> tuple[dict, dict]:
    from awq import AutoAWQForCausalLM
    from awq.quantize.quantizer import AwqQuantizer
    from transformers import PreTrainedTokenizerFast

    stats = {}
    started = _stats_start()
    tok = PreTrainedTokenizerFast.from_pretrained(folder)
    model = AutoAWQForCausalLM.from_pretrained(str(folder))  # autoawq's default: weights on the host
    stats["load"] = _stats_end(started)
    ids = calib_ids(folder, s["max_calib_samples"], s["max_calib_seq_len"], s["seed"]).tolist()
    started = _stats_start()
    ours = {} if s.get("defaults") else {"n_parallel_calib_samples": s["n_parallel_calib_samples"],
                                         "duo_scaling": s["duo_scaling"], "apply_clip": s["apply_clip"]}
    with block_walls(AwqQuantizer, "_get_input_feat") as walls:  # its loop gathers each block's inputs first
        model.quantize(tok, quant_config=s["quant_config"], calib_data=ids, max_calib_samples=s["max_calib_samples"],
                       max_calib_seq_len=s["max_calib_seq_len"], **ours)
    stats["quantize"] = _stats_end(started) | {"block_s": walls}
    return stats, decoder_layers(model.model)


def run_autoround(folder: Path, s: dict, device: str) -> tuple[dict, dict]:
    from auto_round import AutoRound
    from auto_round.compressors import orchestrator

    ids = calib_ids(folder, s["nsamples"], s["seqlen"], s["seed"])
    stats = {}
    started = _stats_start()
    ours = {} if s.get("defaults") else {
        "batch_size": s["batch_size"], "lr": s["lr"], "enable_deterministic_algorithms": s["enable_deterministic_algorithms"],
        "low_gpu_mem_usage": s["low_gpu_mem_usage"] and device.startswith("cuda"),
        "enable_torch_compile": s["enable_torch_compile"] and device.startswith("cuda")}
    ar = AutoRound(str(folder), bits=s["bits"], group_size=s["group_size"], sym=s["sym"],
                   dataset=[row.unsqueeze(0) for row in ids], iters=s["iters"], nsamples=s["nsamples"],
                   seqlen=s["seqlen"], seed=s["seed"], device_map=device, **ours)
    stats["load"] = _stats_end(started)
    started = _stats_start()
    with block_walls(orchestrator, "materialize_model_") as walls:  # its loop materializes each block first
        ar.quantize()
    stats["quantize"] = _stats_end(started) | {"block_s": walls}
    return stats, decoder_layers(ar.model)


@contextmanager
def block_walls(owner, name: str):
    """The library's own loop timed per block, beside ours from the engine's block lines: `name`
    (of module or class `owner`) is called once at the start of each block; the last block runs
    to the end of the `with`. Yields the list the walls are put in, at the end."""
    starts, original = [], getattr(owner, name)

    def timed(*args, **kwargs):
        starts.append(time.perf_counter())
        return original(*args, **kwargs)

    walls: list[float] = []
    setattr(owner, name, timed)
    try:
        yield walls
    finally:
        setattr(owner, name, original)
        ends = starts[1:] + [time.perf_counter()]
        walls += [round(b - a, 3) for a, b in zip(starts, ends)]


def decoder_layers(model) -> dict[str, torch.Tensor]:
    """What the anchor left in the Qwen3 decoder layers, in BF16 on the host under the backbone's
    names: autoawq's packed GEMM Linears dequantized by autoawq's own unpacker, auto-round's
    quantized-dequantized weights and the norms (AWQ folds its scales into them) as they are."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        for name, m in layer.named_modules():
            if type(m).__name__ == "WQLinear_GEMM":
                from awq.utils.packing_utils import dequantize_gemm

                w = dequantize_gemm(m.qweight, m.qzeros, m.scales, m.w_bit, m.group_size).t()
                out[f"model.layers.{i}.{name}.weight"] = w.to("cpu", torch.bfloat16)
        for name, t in layer.state_dict().items():
            if t.is_floating_point() and not name.endswith(("scales", "qweight", "qzeros")):
                out.setdefault(f"model.layers.{i}.{name}", t.to("cpu", torch.bfloat16))
    return out


def held_out(generator: Path, layers: dict[str, torch.Tensor], ev: dict, device: str) -> dict:
    """The anchor's decoder layers in the MOSS generator, scored by the evaluate stage's own `compare`
    against BF16 on the held-out set the profile was scored on (embeddings, heads and final norm
    are the source's, as in our bundles)."""
    from pipelines.calibration import build
    from pipelines.evaluate import compare

    ckpt = Checkpoint(generator)
    prefix = "language_model."
    mapped = {name: "model." + name.removeprefix(prefix) for name in ckpt.keys() if name.startswith(prefix + "layers.")}
    missing = sorted(n for n, k in mapped.items() if k not in layers)
    if missing:
        raise RuntimeError(f"the anchor's model has no {mapped[missing[0]]} (for {missing[0]}; {len(missing)} missing)")
    held = build(ev["dataset"], ckpt.config(), ev["nsamples"], ev["seqlen"], generator)
    metrics = compare(ckpt.config(), ckpt.get, lambda n: layers[mapped[n]] if n in mapped else ckpt.get(n), held.ids,
                      device=device, batch_size=ev["batch_size"])
    return {"dataset": {"name": held.name, "sha256": held.sha256}, "metrics": metrics}


# anchor -> the profile whose settings it runs with: at our settings (our batch, determinism, compile)
# and as its users run it (`-defaults`)
ANCHORS = {"autoawq": "awq4", "autoawq-defaults": "awq4", "auto-round": "autoround-q3",
           "auto-round-defaults": "autoround-q3"}
RUNNERS = {"autoawq": run_autoawq, "autoawq-defaults": run_autoawq, "auto-round": run_autoround,
           "auto-round-defaults": run_autoround}
