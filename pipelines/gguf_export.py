"""A generator bundle as one first-class `moss-tts-delay` GGUF, the file MOSS's llama.cpp runtime
(`llama-moss-tts` in OpenMOSS's fork) loads: our AWQ / auto-round / RTN integers carried into ggml
blocks without re-quantizing them (quantizers/formats/ggml.py says which types are exact).

Names and metadata follow the fork's loader and converter (src/llama-model.cpp, convert_hf_to_gguf.py
MossTTSDelayModel): `token_embd`, `blk.{i}.*` (Qwen3's), `output_norm`, `output` (= lm_heads.0),
`token_embd_audio.{k}` (= emb_ext.k) and `output_audio.{k}` (= lm_heads.k+1); no rope_freqs (the
loader refuses a tensor it does not create), no q/k permutation (Qwen3 ropes NEOX-style); norms F32.
The tokenizer comes from the pinned snapshot's tokenizer.json (byte-level BPE, as the converter
writes it); a fixture without one gets a minimal byte-level vocabulary.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from quantizers.errors import QuantizerError
from quantizers.formats import ggml

from .errors import PipelineError
from .models.moss_tts_delay import BLOCK_PREFIX, SPECIAL_IDS, MossTTSDelayConfig

ARCH = "moss-tts-delay"
LINEAR_TYPES = ("exact", "Q4_0", "Q4_1", "Q5_0", "Q8_0")
TABLE_TYPES = ("F16", "BF16", "Q8_0")
BLOCK_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
# The converter writes audio_assistant_*; the runtime tool reads audio_*_slot: both are written.
SLOT_ALIASES = {"audio_assistant_gen_slot_token_id": "audio_gen_slot_token_id",
                "audio_assistant_delay_slot_token_id": "audio_delay_slot_token_id"}


@dataclass
class GGUFParams:
    # Block Linears: "exact" = the smallest ggml type holding each tensor's integers bit for bit
    # (Q4_0 for symmetric <= 4-bit grids, Q5_0 for AWQ's asymmetric 4-bit, Q8_0 for 8-bit); or one
    # type for all (Q4_1 is near-exact for asymmetric 4-bit: its offset is rounded to float16).
    linear: str = "exact"
    # Text and audio embedding tables, and the heads: BF16 holds the source exactly; F16 (what the
    # official MOSS GGUFs use) loses the source's smallest values to subnormals; Q8_0 is llama.cpp's
    # own rounding (8.5 bits).
    embeddings: str = "BF16"
    heads: str = "BF16"

    def validate(self):
        if self.linear not in LINEAR_TYPES:
            raise ValueError(f"linear: {self.linear!r} (allowed: {', '.join(LINEAR_TYPES)})")
        for key in ("embeddings", "heads"):
            if getattr(self, key) not in TABLE_TYPES:
                raise ValueError(f"{key}: {getattr(self, key)!r} (allowed: {', '.join(TABLE_TYPES)})")


def gguf_name(name: str) -> str:
    """The fork's name for one source tensor."""
    if name == "language_model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "language_model.norm.weight":
        return "output_norm.weight"
    m = re.fullmatch(r"emb_ext\.(\d+)\.weight", name)
    if m:
        return f"token_embd_audio.{m.group(1)}.weight"
    m = re.fullmatch(r"lm_heads\.(\d+)\.weight", name)
    if m:
        k = int(m.group(1))
        return "output.weight" if k == 0 else f"output_audio.{k - 1}.weight"
    m = re.fullmatch(re.escape(BLOCK_PREFIX) + r"\.(\d+)\.(.+)\.weight", name)
    if m and m.group(2) in BLOCK_NAMES:
        return f"blk.{m.group(1)}.{BLOCK_NAMES[m.group(2)]}.weight"
    raise PipelineError(f"tensor {name}: no name in the {ARCH} GGUF layout")


# ------------------------------------------------------------------------- tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what byte-level BPE vocabularies use)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def tokenizer(snapshot: Path, config: dict, fixture: bool) -> dict:
    """tokens, token types, merges for `tokenizer.ggml.*` (padded to the model's vocab, as the
    converter pads with [PAD{i}])."""
    import gguf

    vocab = int(config["language_config"]["vocab_size"])
    special = {int(v) for k, v in config.items() if k.endswith("token_id") and isinstance(v, int)}
    path = Path(snapshot) / "tokenizer.json"
    if path.exists():
        data = json.loads(path.read_text())
        model = data.get("model") or {}
        if model.get("type") != "BPE":
            raise PipelineError(f"{path}: model.type {model.get('type')!r}, expected a byte-level 'BPE' tokenizer")
        by_id = {int(i): t for t, i in model["vocab"].items()}
        added = {int(t["id"]): t for t in data.get("added_tokens", [])}
        by_id.update({i: t["content"] for i, t in added.items()})
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    elif fixture:  # the fixture has no tokenizer: bytes 0-255, then specials where its config puts them
        by_id = dict(enumerate(_bytes_to_unicode()[b] for b in range(256)))
        by_id[256] = by_id[ord("a")] + by_id[ord("b")]
        by_id.update({i: f"<|special_{i}|>" for i in special})
        added = {i: {"special": True} for i in special}
        merges = [f"{by_id[ord('a')]} {by_id[ord('b')]}"]
    else:
        raise PipelineError(f"{path}: missing; the GGUF needs the snapshot's tokenizer (pin a snapshot that has it)")
    if max(by_id) >= vocab:
        raise PipelineError(f"{path}: token id {max(by_id)} is beyond the model's vocab_size {vocab}")
    tokens, types = [], []
    for i in range(vocab):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(int(gguf.TokenType.CONTROL if (added.get(i) or {}).get("special") else gguf.TokenType.NORMAL))
        else:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
    return {"tokens": tokens, "types": types, "merges": merges}


# ------------------------------------------------------------------------- tensors


def _table(t: torch.Tensor, kind: str):
    """An embedding or head table in F16 / BF16 / Q8_0: (array, raw ggml type or None)."""
    import gguf

    if kind == "F16":
        return t.to(torch.float16).numpy(), None
    if kind == "BF16":
        return t.to(torch.bfloat16).view(torch.uint16).numpy(), gguf.GGMLQuantizationType.BF16
    return gguf.quants.quantize(t.float().numpy(), gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0


def write_gguf(view, config: dict, snapshot: Path, fixture: bool, params: GGUFParams, dest: Path,
               provenance: dict) -> dict:
    """Write `dest` from a dequantizing view of a bundle (or quantize stage). Returns the record:
    per-tensor type, exactness, bits per weight."""
    import gguf

    if config.get("model_type") != "moss_tts_delay":
        raise PipelineError(f"config.json: model_type {config.get('model_type')!r}: a {ARCH} GGUF is made from a "
                            "generator bundle (the codec is not a MossTTSDelay)")
    cfg = MossTTSDelayConfig.from_dict({k: v for k, v in config.items() if k != "quantization_config"})
    lc = cfg.language_config
    tok = tokenizer(snapshot, config, fixture)
    w = gguf.GGUFWriter(str(dest), arch=ARCH)
    heads, head_dim = int(lc["num_attention_heads"]), int(lc.get("head_dim") or cfg.hidden_size // int(lc["num_attention_heads"]))
    w.add_block_count(cfg.num_layers)
    w.add_context_length(int(lc.get("max_position_embeddings", 40960)))
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(int(lc["intermediate_size"]))
    w.add_head_count(heads)
    w.add_head_count_kv(int(lc["num_key_value_heads"]))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(lc.get("rope_theta", 1e6)))
    w.add_layer_norm_rms_eps(float(lc.get("rms_norm_eps", 1e-6)))
    w.add_uint32(f"{ARCH}.n_vq", cfg.n_vq)
    w.add_uint32(f"{ARCH}.audio_vocab_size", cfg.audio_vocab_size)
    w.add_uint32(f"{ARCH}.audio_pad_code", cfg.audio_pad_code)
    w.add_uint32(f"{ARCH}.sampling_rate", cfg.sampling_rate)
    for key in SPECIAL_IDS:  # config.json key = the fork's metadata key (moss-tts-delay.<key>)
        if isinstance(config.get(key), int):
            for n in (key, SLOT_ALIASES.get(key)):
                if n:
                    w.add_uint32(f"{ARCH}.{n}", int(config[key]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    for k, v in sorted(provenance.items()):
        w.add_string(f"moss_quant.{k}", str(v))

    record, stored_bits, params_total = {}, 0, 0
    for name in sorted(view.names()):
        gname = gguf_name(name)
        module = name.removesuffix(".weight")
        if module in view.packed:
            iw = view.packed_weight(module).unpack()
            kind = ggml.exact_type(iw) if params.linear == "exact" else params.linear
            if kind is None:
                raise PipelineError(f"{name}: no exact GGUF type holds its {iw.bits}-bit grid (sym={iw.sym}); "
                                    f"choose gguf.linear: Q4_1 or Q8_0 in the profile")
            try:
                data = ggml.pack(iw, kind)
            except QuantizerError as e:
                raise PipelineError(f"{name}: {e}") from None
            w.add_tensor(gname, data, raw_dtype=gguf.GGMLQuantizationType[kind])
            exact, n = kind in ggml.RANGES, iw.q.numel()  # pack refused an exact type that does not fit
        else:
            t = view(name)
            if t.dim() == 1:  # norms: F32, as the converter writes them
                data, raw, kind = t.float().numpy(), None, "F32"
            else:
                kind = params.embeddings if name.startswith(("language_model.embed_tokens", "emb_ext.")) else (
                    params.heads if name.startswith("lm_heads.") else "BF16")  # a Linear kept BF16 stays so
                data, raw = _table(t, kind)
            w.add_tensor(gname, data, raw_dtype=raw)
            exact = kind in ("F32", "BF16") or (kind == "F16" and bool(torch.equal(t.to(torch.float16).to(t.dtype), t)))
            n = t.numel()
        params_total += n
        stored_bits += 8 * data.nbytes
        record[gname] = {"source": name, "type": kind, "exact": exact}
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    file_bits = 8 * dest.stat().st_size
    return {"arch": ARCH, "tensors": record, "source_params": params_total, "tensor_bits": stored_bits,
            "effective_bpw": round(file_bits / params_total, 6),
            "definition": "every bit of the GGUF file (tensors, metadata, tokenizer) / source parameters",
            "inexact": sorted(k for k, v in record.items() if not v["exact"])}


# ------------------------------------------------------------------------- the stage


def run(ctx, params: GGUFParams, out: Path) -> dict:
    from .loader import stage_view

    view = stage_view(ctx.dirs["quantize"])
    ckpt = ctx.checkpoint()
    prov = {"source": f"{ctx.spec.repo}@{ctx.spec.revision}", "profile": ctx.profile.name,
            "quantize_key": ctx.keys["quantize"]}
    record = write_gguf(view, ckpt.config(), ctx.snapshot, bool(ctx.spec.fixture), params, out / GGUF_FILE, prov)
    return {"file": GGUF_FILE, **{k: v for k, v in record.items() if k != "tensors"},
            "types": _type_counts(record["tensors"])}


GGUF_FILE = "model.gguf"


def _type_counts(tensors: dict) -> dict:
    out: dict = {}
    for v in tensors.values():
        out[v["type"]] = out.get(v["type"], 0) + 1
    return dict(sorted(out.items()))
