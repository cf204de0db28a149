"""MossTTSDelay (the MOSS-TTS 8B generator) as a plain torch module tree.

Upstream names: `language_model` (transformers' Qwen3Model), `emb_ext.{k}` (n_vq audio
embeddings), `lm_heads.{0}` (text head) and `lm_heads.{1..n_vq}` (audio heads). Input ids
are (B, S, 1 + n_vq): channel 0 text, channel k + 1 codebook k; the 1 + n_vq embeddings are
summed into the backbone and every head reads the last hidden state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import Qwen3Config, Qwen3Model

from ..environment import portable_cpu_attention
from ..errors import PipelineError
from .definition import Component, Definition

BLOCK_PREFIX = "language_model.layers"
# MOSS-TTS's special token ids (its config.json and the llama.cpp runtime assume these values)
SPECIAL_IDS = {
    "pad_token_id": 151643,
    "im_start_token_id": 151644,
    "im_end_token_id": 151645,
    "audio_start_token_id": 151652,
    "audio_end_token_id": 151653,
    "audio_user_slot_token_id": 151654,
    "audio_assistant_gen_slot_token_id": 151656,
    "audio_assistant_delay_slot_token_id": 151662,
}
BLOCK_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
INPUT_GROUPS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("self_attn.v_proj", ("self_attn.o_proj",)),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.up_proj", ("mlp.down_proj",)),
)

DERIVED_INPUTS = (("mlp.down_proj", ("mlp", "mlp.gate_proj")),)

DEFINITION = Definition(
    name="MossTTSDelay",
    model_types=("moss_tts_delay",),
    block_prefix=BLOCK_PREFIX,
    block_linears=BLOCK_LINEARS,
    input_groups=INPUT_GROUPS,
    derived_inputs=DERIVED_INPUTS,
    fused_groups=(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")),
    tables=(("text_embedding", r"^language_model\.embed_tokens\.weight$"), ("audio_embeddings", r"^emb_ext\.\d+\.weight$"),
            ("text_head", r"^lm_heads\.0\.weight$"), ("audio_heads", r"^lm_heads\.[1-9]\d*\.weight$")),
    components=(
        Component("backbone_linears", r"^language_model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.",
                  "kept BF16 by the allocation"),
        Component("norms", r"norm\.weight$", "norm gain: tiny and outlier-carrying, kept BF16"),
        Component("embeddings", r"^(language_model\.embed_tokens|emb_ext)\.", "embedding table: not a Linear, kept BF16"),
        Component("heads", r"^lm_heads\.", "output head: kept BF16 (text and audio logits are the most fragile)"),
    ),
)


REQUIRED_TOP = ("n_vq", "audio_vocab_size")
REQUIRED_LANGUAGE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size")


def _positive_int(d: dict, key: str, where: str) -> None:
    if key not in d:
        raise PipelineError(f"{where}: key {key!r} missing")
    if isinstance(d[key], bool) or not isinstance(d[key], int) or d[key] < 1:
        raise PipelineError(f"{where}: {key} must be a positive integer, got {d[key]!r}")


@dataclass(frozen=True)
class MossTTSDelayConfig:
    language_config: dict
    n_vq: int = 32
    audio_vocab_size: int = 1024
    audio_pad_code: int = 1024
    sampling_rate: int = 24000
    raw: dict | None = None  # the whole config.json, written back unchanged on export

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "MossTTSDelayConfig":
        """Checked: a missing or malformed field is one line naming the file and the key."""
        if d.get("model_type") != "moss_tts_delay":
            raise PipelineError(f"{where}: model_type is {d.get('model_type')!r}, expected 'moss_tts_delay'")
        lc = d.get("language_config")
        if not isinstance(lc, dict):
            raise PipelineError(f"{where}: key 'language_config' missing (the Qwen3 backbone's config)")
        for key in REQUIRED_TOP:
            _positive_int(d, key, where)
        for key in REQUIRED_LANGUAGE:
            _positive_int(lc, key, f"{where}: language_config")
        if lc["num_attention_heads"] % lc["num_key_value_heads"]:
            raise PipelineError(f"{where}: language_config.num_attention_heads {lc['num_attention_heads']} is not a "
                                f"multiple of num_key_value_heads {lc['num_key_value_heads']}")
        pad = d.get("audio_pad_code", d["audio_vocab_size"])
        if not isinstance(pad, int) or not 0 <= pad <= d["audio_vocab_size"]:
            raise PipelineError(f"{where}: audio_pad_code {pad!r} is not a code in [0, audio_vocab_size]")
        return cls(
            language_config=dict(lc),
            n_vq=int(d["n_vq"]),
            audio_vocab_size=int(d["audio_vocab_size"]),
            audio_pad_code=int(pad),
            sampling_rate=int(d.get("sampling_rate", 24000)),
            raw=d,
        )

    def qwen3(self) -> Qwen3Config:
        lc = {k: v for k, v in self.language_config.items() if k not in ("architectures", "transformers_version")}
        lc["tie_word_embeddings"] = False
        cfg = Qwen3Config(**lc)
        cfg._attn_implementation = "sdpa"
        portable_cpu_attention()
        return cfg

    @property
    def hidden_size(self) -> int:
        return int(self.language_config["hidden_size"])

    @property
    def num_layers(self) -> int:
        return int(self.language_config["num_hidden_layers"])

    @property
    def vocab_size(self) -> int:
        return int(self.language_config["vocab_size"])


class MossTTSDelay(nn.Module):
    def __init__(self, config: MossTTSDelayConfig):
        super().__init__()
        self.config = config
        h, a = config.hidden_size, config.audio_vocab_size + 1
        self.language_model = Qwen3Model(config.qwen3())
        self.emb_ext = nn.ModuleList(nn.Embedding(a, h) for _ in range(config.n_vq))
        self.lm_heads = nn.ModuleList(
            [nn.Linear(h, config.vocab_size, bias=False)] + [nn.Linear(h, a, bias=False) for _ in range(config.n_vq)]
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, S, 1 + n_vq) ids -> (B, S, H) summed embeddings: the block-0 input."""
        if input_ids.dim() != 3 or input_ids.shape[-1] != 1 + self.config.n_vq:
            raise ValueError(
                f"input_ids: expected shape (B, S, {1 + self.config.n_vq}), got {tuple(input_ids.shape)}"
            )
        x = self.language_model.embed_tokens(input_ids[..., 0])
        for k, emb in enumerate(self.emb_ext):
            x = x + emb(input_ids[..., k + 1])
        return x

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.language_model(inputs_embeds=self.embed(input_ids), use_cache=False)
        return out.last_hidden_state

    def heads(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        logits = [head(hidden) for head in self.lm_heads]
        for k in range(1, len(logits)):  # the pad code is never predicted
            logits[k][..., self.config.audio_pad_code] = float("-inf")
        return logits

    def forward(self, input_ids: torch.Tensor) -> list[torch.Tensor]:
        """Returns [text logits (B,S,V)] + n_vq x [audio logits (B,S,A+1)]."""
        return self.heads(self.hidden_states(input_ids))


def audio_positions(config: dict, ids: torch.Tensor) -> torch.Tensor:
    """(N, S) bool: where the text channel holds an audio gen/delay slot (the audio heads speak there)."""
    slots = [config.get(k, SPECIAL_IDS[k]) for k in
             ("audio_assistant_gen_slot_token_id", "audio_assistant_delay_slot_token_id")]
    return torch.isin(ids[..., 0], torch.tensor(slots))


def block_linear_names(config: MossTTSDelayConfig) -> list[str]:
    """Every quantizable decoder Linear, in stable (block, module) order."""
    return [f"{BLOCK_PREFIX}.{i}.{m}" for i in range(config.num_layers) for m in BLOCK_LINEARS]


def block_linear_shapes(config: MossTTSDelayConfig) -> dict[str, tuple[int, int]]:
    """[out, in] of every decoder-block Linear, from config.json alone."""
    lc = config.language_config
    h, f = config.hidden_size, int(lc["intermediate_size"])
    heads, kv = int(lc["num_attention_heads"]), int(lc["num_key_value_heads"])
    hd = int(lc.get("head_dim") or h // heads)
    return {"self_attn.q_proj": (heads * hd, h), "self_attn.k_proj": (kv * hd, h), "self_attn.v_proj": (kv * hd, h),
            "self_attn.o_proj": (h, heads * hd), "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f)}


def build_empty(config: MossTTSDelayConfig) -> MossTTSDelay:
    """The module tree on the meta device: no memory until tensors are assigned."""
    with torch.device("meta"):
        return MossTTSDelay(config)


def load_state(model: MossTTSDelay, tensors, dtype=torch.bfloat16, device="cpu") -> MossTTSDelay:
    """Assign tensors (a name -> tensor mapping or callable) into a meta-built model."""
    expected = dict(model.named_parameters())
    get = tensors if callable(tensors) else tensors.__getitem__
    for name, param in expected.items():
        t = get(name)
        if tuple(t.shape) != tuple(param.shape):
            raise ValueError(f"tensor {name}: shape {tuple(t.shape)}, config expects {tuple(param.shape)}")
        model.get_submodule(name.rsplit(".", 1)[0]).register_parameter(
            name.rsplit(".", 1)[1], nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)
        )
    # Non-persistent buffers (rotary inv_freq) are not in checkpoints: recompute them.
    rotary = model.language_model.rotary_emb
    with torch.device(device):
        fresh = type(rotary)(config=model.language_model.config)
    model.language_model.rotary_emb = fresh
    return model.eval()
