"""MOSS-Audio-Tokenizer (v1, "CAT") as a plain torch module tree, decode path only.

Upstream names, built from config.json alone (no remote code):
  encoder.{i}  / decoder.{i}  `encoder_kwargs` / `decoder_kwargs` in order; a
      "PatchedPretransform" entry holds no tensors but keeps its index, so the real
      encoder's transformers are stacks 1,3,5,7 and the decoder's 0,2,4,6.
  {stack}.input_proj / .output_proj   Linear, present only when the dimension differs
  {stack}.transformer.layers.{L}.     self_attn.{in_projs,out_projs}.0 (fused QKV),
      norm{1,2} (LayerNorm with bias), linear{1,2}, layer_scale_{1,2}.scale
  quantizer.{input_proj,output_proj}, quantizer.quantizers.{i}.{in_proj,out_proj}:
      weight-normalised 1x1 Conv1d (`parametrizations.weight.original0` = g [out,1,1],
      `original1` = v [out,in,1], `bias` [out]); quantizer.quantizers.{i}.codebook.weight.

Only decoding is implemented (codes -> waveform); the encoder's modules exist so that a
full checkpoint can be shape-checked against its config, and `decode_only=True` builds the
tree without them. Activations run in (B, T, C) layout; upstream's (B, C, T) transposes
are layout only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import Checkpoint
from ..errors import PipelineError
from .definition import Component, Definition

MODEL_TYPES = ("speech_tokenizer", "moss-audio-tokenizer")
LINEAR_SUFFIXES = ("self_attn.in_projs.0", "self_attn.out_projs.0", "linear1", "linear2")


@dataclass(frozen=True)
class TransformerSpec:
    input_dimension: int
    output_dimension: int
    d_model: int
    num_heads: int
    num_layers: int
    dim_feedforward: int
    max_period: float = 10_000.0
    layer_scale: float | None = 0.01
    context_duration: float | None = None  # per-stage override (a later upstream key); else the global one


@dataclass(frozen=True)
class PatchSpec:
    patch_size: int


@dataclass(frozen=True)
class QuantizerSpec:
    input_dim: int
    rvq_dim: int
    output_dim: int
    num_quantizers: int
    codebook_size: int
    codebook_dim: int


@dataclass(frozen=True)
class CodecConfig:
    sampling_rate: int
    downsample_rate: int
    context_duration: float
    encoder: tuple
    decoder: tuple
    quantizer: QuantizerSpec
    raw: dict = field(default_factory=dict, compare=False)  # the whole config.json, copied into bundles

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "CodecConfig":
        if d.get("model_type") not in MODEL_TYPES:
            raise PipelineError(f"{where}: model_type is {d.get('model_type')!r}, expected one of {list(MODEL_TYPES)}")
        qk = dict(d.get("quantizer_kwargs") or {})
        qtype = qk.get("quantizer_type", d.get("quantizer_type", "rvq"))
        # Both quantizer kinds decode the same way: codebook row -> out_proj, summed, -> output_proj.
        if qtype not in ("rlfq", "random_prefix_rlfq", "rvq", "spec_rvq"):
            raise PipelineError(f"{where}: quantizer_type {qtype!r} is not supported")
        q = QuantizerSpec(
            input_dim=_int(qk, "input_dim", f"{where}: quantizer_kwargs"),
            rvq_dim=int(qk.get("rvq_dim") or qk.get("input_dim")),
            output_dim=int(qk.get("output_dim") or qk.get("input_dim")),
            num_quantizers=_int(qk, "num_quantizers", f"{where}: quantizer_kwargs"),
            codebook_size=_int(qk, "codebook_size", f"{where}: quantizer_kwargs"),
            codebook_dim=_int(qk, "codebook_dim", f"{where}: quantizer_kwargs"),
        )
        cfg = cls(
            sampling_rate=_int(d, "sampling_rate", where),
            downsample_rate=_int(d, "downsample_rate", where),
            context_duration=float(d.get("causal_transformer_context_duration", 10.0)),
            encoder=tuple(_module_spec(e, f"{where}: encoder_kwargs[{i}]") for i, e in enumerate(d.get("encoder_kwargs", []))),
            decoder=tuple(_module_spec(e, f"{where}: decoder_kwargs[{i}]") for i, e in enumerate(d.get("decoder_kwargs", []))),
            quantizer=q,
            raw=d,
        )
        cfg._check_chain(where)
        return cfg

    def _check_chain(self, where: str) -> None:
        """Dimensions must flow quantizer -> decoder stages -> 1 channel, and patches multiply to downsample_rate."""
        if not self.decoder:
            raise PipelineError(f"{where}: decoder_kwargs is empty")
        dim, total = self.quantizer.output_dim, 1
        for i, m in enumerate(self.decoder):
            if isinstance(m, PatchSpec):
                if dim % m.patch_size:
                    raise PipelineError(f"{where}: decoder_kwargs[{i}] patch_size {m.patch_size} does not divide {dim} channels")
                dim, total = dim // m.patch_size, total * m.patch_size
            else:
                if m.input_dimension != dim:
                    raise PipelineError(f"{where}: decoder_kwargs[{i}].input_dimension is {m.input_dimension}, expected {dim}")
                if m.d_model % m.num_heads or (m.d_model // m.num_heads) % 2:
                    raise PipelineError(f"{where}: decoder_kwargs[{i}]: d_model {m.d_model} / num_heads {m.num_heads} must be an even head size")
                dim = m.output_dimension
        if dim != 1:
            raise PipelineError(f"{where}: decoder ends with {dim} channels, expected 1 (mono)")
        if total != self.downsample_rate:
            raise PipelineError(f"{where}: decoder patch sizes multiply to {total}, downsample_rate is {self.downsample_rate}")

    def stage_contexts(self) -> dict[int, int]:
        """Attention window (frames) per decoder transformer: context seconds x that stage's frame rate."""
        rate, out = self.sampling_rate / self.downsample_rate, {}
        for i, m in enumerate(self.decoder):
            if isinstance(m, PatchSpec):
                rate *= m.patch_size
            else:
                dur = self.context_duration if m.context_duration is None else m.context_duration
                out[i] = int(rate * dur)  # upstream truncates the same way
        return out

    @property
    def frame_rate(self) -> float:
        return self.sampling_rate / self.downsample_rate


def _int(d: dict, key: str, where: str) -> int:
    if key not in d:
        raise PipelineError(f"{where}.{key} is missing")
    return int(d[key])


def _module_spec(e: dict, where: str):
    kind = e.get("module_type")
    if kind == "PatchedPretransform":
        return PatchSpec(_int(e, "patch_size", where))
    if kind != "Transformer":
        raise PipelineError(f"{where}.module_type is {kind!r}, expected 'Transformer' or 'PatchedPretransform'")
    # Only the variant the v1 checkpoints use is implemented; refuse the others rather than guess.
    for key, want in (("norm", "layer_norm"), ("positional_embedding", "rope"), ("gating", "none"), ("causal", True)):
        if e.get(key, want) != want:
            raise PipelineError(f"{where}.{key} is {e.get(key)!r}; only {want!r} is supported")
    return TransformerSpec(
        input_dimension=_int(e, "input_dimension", where),
        output_dimension=_int(e, "output_dimension", where),
        d_model=_int(e, "d_model", where),
        num_heads=_int(e, "num_heads", where),
        num_layers=_int(e, "num_layers", where),
        dim_feedforward=_int(e, "dim_feedforward", where),
        max_period=float(e.get("max_period", 10_000.0)),
        layer_scale=None if e.get("layer_scale", 0.01) is None else float(e.get("layer_scale", 0.01)),
        context_duration=None if e.get("context_duration") is None else float(e["context_duration"]),
    )


# --------------------------------------------------------------------------- modules


def rope(x: torch.Tensor, max_period: float) -> torch.Tensor:
    """Rotary embedding over (B, H, T, D), adjacent pairs (2i, 2i+1) rotated, angles in fp32."""
    b, h, t, d = x.shape
    freqs = torch.exp(torch.arange(d // 2, dtype=torch.float32) * (-math.log(max_period) * 2 / d))
    ang = torch.arange(t, dtype=torch.float32)[:, None] * freqs[None, :]  # (T, D/2)
    cos, sin = torch.cos(ang), torch.sin(ang)
    xr, xi = x.float().reshape(b, h, t, d // 2, 2).unbind(-1)
    out = torch.stack([xr * cos - xi * sin, xr * sin + xi * cos], dim=-1)
    return out.reshape(b, h, t, d).to(x.dtype)


class SelfAttention(nn.Module):
    def __init__(self, d: int, heads: int, context: int, max_period: float):
        super().__init__()
        self.heads, self.context, self.max_period = heads, context, max_period
        # ModuleLists of one: upstream supports per-step weights; v1 uses a single set.
        self.in_projs = nn.ModuleList([nn.Linear(d, 3 * d, bias=False)])
        self.out_projs = nn.ModuleList([nn.Linear(d, d, bias=False)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.in_projs[0](x).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = rope(qkv[0], self.max_period), rope(qkv[1], self.max_period), qkv[2]
        # Causal sliding window: query i sees keys j with 0 <= i - j < context. Queries go in
        # blocks of `context` against the keys they can reach, so cost is O(T * context), not T^2.
        c = max(1, self.context)
        ys = []
        for s in range(0, t, c):
            e, k0 = min(s + c, t), max(0, s - c + 1)
            delta = torch.arange(s, e)[:, None] - torch.arange(k0, e)[None, :]
            mask = (delta >= 0) & (delta < c)
            ys.append(F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, k0:e], v[:, :, k0:e], attn_mask=mask))
        y = torch.cat(ys, dim=2)
        return self.out_projs[0](y.transpose(1, 2).reshape(b, t, d))


class LayerScale(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(d))

    def forward(self, x):
        return self.scale * x


class TransformerLayer(nn.Module):
    """Pre-norm block: x + ls1 * attn(norm1 x); x + ls2 * linear2(gelu(linear1(norm2 x)))."""

    def __init__(self, s: TransformerSpec, context: int):
        super().__init__()
        self.self_attn = SelfAttention(s.d_model, s.num_heads, context, s.max_period)
        self.norm1 = nn.LayerNorm(s.d_model, eps=1e-5)
        self.norm2 = nn.LayerNorm(s.d_model, eps=1e-5)
        self.linear1 = nn.Linear(s.d_model, s.dim_feedforward, bias=False)
        self.linear2 = nn.Linear(s.dim_feedforward, s.d_model, bias=False)
        self.layer_scale_1 = LayerScale(s.d_model) if s.layer_scale is not None else nn.Identity()
        self.layer_scale_2 = LayerScale(s.d_model) if s.layer_scale is not None else nn.Identity()

    def forward(self, x):
        x = x + self.layer_scale_1(self.self_attn(self.norm1(x)))
        return x + self.layer_scale_2(self.linear2(F.gelu(self.linear1(self.norm2(x)))))  # exact (erf) GELU


class Transformer(nn.Module):
    def __init__(self, s: TransformerSpec, context: int):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(s, context) for _ in range(s.num_layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class ProjectedTransformer(nn.Module):
    def __init__(self, s: TransformerSpec, context: int):
        super().__init__()
        if s.input_dimension != s.d_model:
            self.input_proj = nn.Linear(s.input_dimension, s.d_model, bias=False)
        self.transformer = Transformer(s, context)
        if s.output_dimension != s.d_model:
            self.output_proj = nn.Linear(s.d_model, s.output_dimension, bias=False)

    def forward(self, x):  # (B, T, C)
        if hasattr(self, "input_proj"):
            x = self.input_proj(x)
        x = self.transformer(x)
        return self.output_proj(x) if hasattr(self, "output_proj") else x


class Patch(nn.Module):
    """Parameter-free reshape between channels and time (upstream PatchedPretransform)."""

    def __init__(self, patch_size: int):
        super().__init__()
        self.patch_size = patch_size

    def forward(self, x):  # upsample: (B, T, C*p) -> (B, T*p, C); channel c*p + j becomes step t*p + j
        b, t, cp = x.shape
        p = self.patch_size
        return x.reshape(b, t, cp // p, p).transpose(2, 3).reshape(b, t * p, cp // p)


class WeightNormParams(nn.Module):
    def __init__(self, c_out: int, c_in: int):
        super().__init__()
        self.original0 = nn.Parameter(torch.empty(c_out, 1, 1))  # g
        self.original1 = nn.Parameter(torch.empty(c_out, c_in, 1))  # v


class WeightNormConv1x1(nn.Module):
    """Conv1d(kernel 1) with torch's weight_norm(dim=0) layout: W = g * v / ||v|| per output channel."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.parametrizations = nn.ModuleDict({"weight": WeightNormParams(c_out, c_in)})
        self.bias = nn.Parameter(torch.empty(c_out))

    def weight(self) -> torch.Tensor:
        p = self.parametrizations["weight"]
        v = p.original1.float()
        return (p.original0.float() * v / v.norm(dim=(1, 2), keepdim=True))[:, :, 0]

    def forward(self, x):  # (B, T, C_in) fp32 -> (B, T, C_out) fp32
        return F.linear(x.float(), self.weight(), self.bias.float())


class CodebookQuantizer(nn.Module):
    def __init__(self, q: QuantizerSpec, decode_only: bool):
        super().__init__()
        if q.rvq_dim != q.codebook_dim:
            if not decode_only:
                self.in_proj = WeightNormConv1x1(q.rvq_dim, q.codebook_dim)
            self.out_proj = WeightNormConv1x1(q.codebook_dim, q.rvq_dim)
        self.codebook = nn.Embedding(q.codebook_size, q.codebook_dim)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, rvq_dim); raw rows, no normalisation
        z = F.embedding(codes, self.codebook.weight).float()
        return self.out_proj(z) if hasattr(self, "out_proj") else z


class ResidualQuantizer(nn.Module):
    def __init__(self, q: QuantizerSpec, decode_only: bool):
        super().__init__()
        self.spec = q
        if q.input_dim != q.rvq_dim and not decode_only:
            self.input_proj = WeightNormConv1x1(q.input_dim, q.rvq_dim)
        if q.rvq_dim != q.output_dim:
            self.output_proj = WeightNormConv1x1(q.rvq_dim, q.output_dim)
        self.quantizers = nn.ModuleList(CodebookQuantizer(q, decode_only) for _ in range(q.num_quantizers))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:  # (n_q, B, T) -> (B, T, output_dim), fp32 like upstream
        z = sum(self.quantizers[i].decode(codes[i]) for i in range(codes.shape[0]))
        return self.output_proj(z) if hasattr(self, "output_proj") else z


class MossAudioTokenizer(nn.Module):
    def __init__(self, config: CodecConfig, decode_only: bool = False):
        super().__init__()
        self.config = config
        if not decode_only:
            # Encoder windows are irrelevant here (no encode()); 0 marks them unused.
            self.encoder = nn.ModuleList(
                Patch(m.patch_size) if isinstance(m, PatchSpec) else ProjectedTransformer(m, 0) for m in config.encoder
            )
        self.quantizer = ResidualQuantizer(config.quantizer, decode_only)
        ctx = config.stage_contexts()
        self.decoder = nn.ModuleList(
            Patch(m.patch_size) if isinstance(m, PatchSpec) else ProjectedTransformer(m, ctx[i])
            for i, m in enumerate(config.decoder)
        )

    @property
    def decoder_dtype(self) -> torch.dtype:
        return next(p.dtype for n, p in self.named_parameters() if n.startswith("decoder."))

    def check_codes(self, codes: torch.Tensor, name: str = "codes") -> torch.Tensor:
        q = self.config.quantizer
        if not isinstance(codes, torch.Tensor) or codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
            raise PipelineError(f"{name}: expected an integer tensor of codes")
        if codes.dim() == 2:
            codes = codes[:, None, :]
        if codes.dim() != 3 or codes.shape[-1] == 0:
            raise PipelineError(f"{name}: expected shape (n_q, B, T) or (n_q, T) with T > 0, got {tuple(codes.shape)}")
        if not 1 <= codes.shape[0] <= q.num_quantizers:
            raise PipelineError(f"{name}: {codes.shape[0]} codebooks, the codec has {q.num_quantizers} (a prefix of 1..{q.num_quantizers} decodes)")
        bad = (codes < 0) | (codes >= q.codebook_size)
        if bad.any():
            i, b, t = (int(v) for v in bad.nonzero()[0])
            raise PipelineError(f"{name}: codebook {i} (batch {b}, frame {t}) has code {int(codes[i, b, t])}, expected 0..{q.codebook_size - 1}")
        return codes.long()

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (n_q, B, T) or (n_q, T) -> waveform (B, 1, T * downsample_rate), float32."""
        codes = self.check_codes(codes)
        x = self.quantizer.decode(codes).to(self.decoder_dtype)
        for m in self.decoder:
            x = m(x)
        return x.float().transpose(1, 2)

    forward = decode


# --------------------------------------------------------------------------- build / load


def build_empty(config: CodecConfig, decode_only: bool = False) -> MossAudioTokenizer:
    """The module tree on the meta device: no memory until tensors are assigned."""
    with torch.device("meta"):
        return MossAudioTokenizer(config, decode_only)


def tensor_specs(config: CodecConfig, decode_only: bool = False) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in build_empty(config, decode_only).named_parameters()}


def decoder_linear_names(config: CodecConfig) -> list[str]:
    """Every decoder Linear (module name), in stage/layer order: the FP8 candidates."""
    names = []
    for i, m in enumerate(config.decoder):
        if isinstance(m, TransformerSpec):
            if m.input_dimension != m.d_model:
                names.append(f"decoder.{i}.input_proj")
            names += [f"decoder.{i}.transformer.layers.{layer}.{s}" for layer in range(m.num_layers) for s in LINEAR_SUFFIXES]
            if m.output_dimension != m.d_model:
                names.append(f"decoder.{i}.output_proj")
    return names


# The decode-only artifact: what it stores and how its bits are broken down (the encoder and the
# quantizer's input side are not part of it). Decoder Linears are counted by their stored format.
DEFINITION = Definition(
    name="MOSS-Audio-Tokenizer (decode path)",
    model_types=MODEL_TYPES,
    components=(
        Component("quantizer_decode_path", r"^quantizer\.",
                  "quantizer decode path (codebooks, weight-normed 1x1 convs): not a Linear, kept BF16"),
        Component("decoder_norms_layerscale", r"^decoder\..*\.(norm[12]|layer_scale_[12])\.",
                  "LayerNorm / LayerScale: tiny, sets every activation's scale, kept BF16"),
        Component("decoder_linears", r"^decoder\.", "decoder Linear kept BF16"),
    ),
    linear_component="decoder_linears",
    split_by_format=True,
)


def load_state(model: MossAudioTokenizer, get, dtype=torch.float32, quantizer_dtype=torch.float32,
               where: str = "checkpoint") -> MossAudioTokenizer:
    """Assign tensors from `get(name)` into a meta-built model; shapes are checked against the config.

    The quantizer's decode path stays in `quantizer_dtype` (upstream computes it in fp32);
    the decoder takes `dtype`.
    """
    for name, param in model.named_parameters():
        t = get(name)
        if tuple(t.shape) != tuple(param.shape):
            raise PipelineError(f"{where}: tensor {name} has shape {list(t.shape)}, config.json implies {list(param.shape)}")
        owner, attr = name.rsplit(".", 1)
        want = quantizer_dtype if name.startswith("quantizer.") else dtype
        model.get_submodule(owner).register_parameter(attr, nn.Parameter(t.to(want), requires_grad=False))
    return model.eval()


# --------------------------------------------------------------------------- from a checkpoint


def read_config(ckpt: Checkpoint) -> CodecConfig:
    return CodecConfig.from_dict(ckpt.config(), where=str(ckpt.root / "config.json"))


def stored_name(ckpt: Checkpoint, name: str) -> str:
    """Older torch weight_norm saves g/v as `weight_g`/`weight_v`; both layouts load."""
    if name in ckpt.weight_map:
        return name
    for new, old in ((".parametrizations.weight.original0", ".weight_g"), (".parametrizations.weight.original1", ".weight_v")):
        if name.endswith(new) and name[: -len(new)] + old in ckpt.weight_map:
            return name[: -len(new)] + old
    raise PipelineError(f"{ckpt.root}: tensor {name} missing (config.json implies it)")


@dataclass
class Extraction:
    kept: list[str]  # decode-path tensor names (upstream names)
    dropped: list[str]  # encoder + quantizer input-side tensors
    params_before: int
    params_after: int
    shapes: dict[str, tuple[int, ...]]  # every source tensor's shape (upstream names)

    def manifest(self) -> dict:
        groups: dict[str, int] = {}
        for n in self.dropped:
            parts = n.split(".")
            g = ".".join(parts[:2]) if parts[0] == "encoder" else (
                "quantizer.quantizers.*.in_proj" if ".in_proj." in n else "quantizer.input_proj")
            groups[g] = groups.get(g, 0) + 1
        return {
            "params_before": self.params_before,
            "params_after": self.params_after,
            "params_dropped": self.params_before - self.params_after,
            "dropped_groups": dict(sorted(groups.items())),
            "dropped_tensors": sorted(self.dropped),
        }


def extract_decode_only(ckpt: Checkpoint, cfg: CodecConfig) -> Extraction:
    """Check the whole source against its config (names and shapes, nothing read) and split
    it into the decode path and what is dropped."""
    full = tensor_specs(cfg)
    keep = tensor_specs(cfg, decode_only=True)
    stored = {}
    for name, shape in sorted(full.items()):
        s = stored_name(ckpt, name)
        got = tuple(ckpt.shape(s))
        if got != shape:
            raise PipelineError(f"{ckpt.root}: tensor {s} has shape {list(got)}, config.json implies {list(shape)}")
        stored[s] = name
    extra = sorted(set(ckpt.weight_map) - set(stored))
    if extra:
        raise PipelineError(f"{ckpt.root}: unexpected tensor {extra[0]} (not in the module tree config.json describes)")
    before = sum(math.prod(s) for s in full.values())
    after = sum(math.prod(s) for s in keep.values())
    return Extraction(sorted(keep), sorted(set(full) - set(keep)), before, after, full)


def source_decoder(ckpt: Checkpoint, dtype=torch.float32) -> MossAudioTokenizer:
    """The decode-only model straight from the source checkpoint (FP32 reference by default)."""
    cfg = read_config(ckpt)
    return load_state(build_empty(cfg, decode_only=True), lambda n: ckpt.get(stored_name(ckpt, n)), dtype=dtype,
                      where=str(ckpt.root))
