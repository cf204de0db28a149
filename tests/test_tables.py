"""Whole-generator bits: embedding tables and heads stored as ggml blocks, the whole-q4 / whole-q3
profiles at <= 4.5 / <= 3.6 bits per weight on the real 8B split, read back by llama.cpp's own
format code (the gguf package) and by the GGUF export, refused where a runtime cannot read them."""
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from bench.bpw_at_scale import at_scale
from pipelines.backbone_export import export_backbone
from pipelines.errors import PipelineError
from pipelines.loader import load_bundle, load_source
from pipelines.profile import load_profile
from pipelines.pipeline import STAGES

gguf = pytest.importorskip("gguf")

BOUND = {"whole-q4": 4.5, "whole-q3": 3.6}


@pytest.mark.parametrize("profile", sorted(BOUND))
def test_whole_profiles_pass_their_gates_within_their_bits_at_8b(shipped, profile):
    m = json.loads((shipped(profile).bundle / "manifest.json").read_text())
    assert m["status"] == "accepted" and all(c["passed"] for c in m["gate"]["checks"])
    assert any(c["metric"].startswith("free.") for c in m["gate"]["checks"])  # free-running checks included
    assert at_scale(m) <= BOUND[profile]  # the whole 8B generator, every stored bit but headers
    tables = m["method_details"]["tables"]
    assert "text_head" not in tables  # BF16: quantized, it moves the end of audio (whole-q4.yaml)
    stored = {t: e for t, e in m["tensors"].items() if e["format"] == "ggml"}
    assert {t for k in tables.values() for t in k["tensors"]} == set(stored)
    assert m["tensors"]["lm_heads.0.weight"]["format"] == "bf16"


def test_tables_are_ggml_blocks_that_llama_cpp_code_reads_exactly(shipped, tiny_path, tmp_path):
    """The stored bytes are the GGUF tensor: gguf's own dequantizer gives our loader's weights, bit for
    bit, and the GGUF export copies them unchanged under the ggml type the part names."""
    from pipelines.cli import main

    bundle = shipped("whole-q3").bundle
    m = json.loads((bundle / "manifest.json").read_text())
    ours = load_bundle(bundle, torch.float32)
    src = load_source(tiny_path, torch.float32)
    out = tmp_path / "whole-q3.gguf"
    main(["export-gguf", str(bundle), str(out)])
    reader = gguf.GGUFReader(str(out))
    in_file = {t.name: t for t in reader.tensors}
    seen = set()
    with safe_open(bundle / "model.safetensors", "pt") as f:
        for name, entry in m["tensors"].items():
            if entry["format"] != "ggml":
                continue
            (part,) = entry["stored"]
            raw = f.get_tensor(part)
            assert raw.dtype == torch.uint8 and part.endswith("." + entry["ggml_type"].lower())
            kind = gguf.GGMLQuantizationType[entry["ggml_type"]]
            theirs = gguf.quants.dequantize(raw.numpy(), kind)
            mine = ours.get_parameter(name).detach().numpy()
            assert theirs.shape == mine.shape and np.array_equal(theirs, mine), name
            w = src.get_parameter(name).detach()
            assert ((torch.from_numpy(mine) - w).norm() / w.norm()).item() < (0.12 if kind.name == "Q4_0" else 0.01)
            g = in_file[_gguf_name(name)]
            assert g.tensor_type == kind and bytes(np.asarray(g.data).tobytes()) == raw.numpy().tobytes(), name
            seen.add(entry["ggml_type"])
    assert seen == {"Q4_0", "Q8_0"}


def _gguf_name(name):
    from pipelines.gguf_export import gguf_name

    return gguf_name(name)


def test_a_backbone_folder_is_refused_for_a_bundle_with_ggml_tables(shipped, tmp_path):
    with pytest.raises(PipelineError, match=r"transformers: language_model.embed_tokens is stored as ggml blocks.*"
                                            r"nothing written") as e:
        export_backbone(shipped("whole-q4").bundle, tmp_path / "backbone")
    assert "\n" not in str(e.value) and not (tmp_path / "backbone").exists()


@pytest.mark.parametrize("tables,text", [
    ({"text_embeding": 8}, r"quantize.tables: unknown table 'text_embeding' \(allowed: text_embedding, audio_embeddings"),
    ({"audio_heads": 6}, r"quantize.tables.audio_heads: 6 bits; a table is stored as ggml blocks of 4 or 8 bits"),
    ([8], r"quantize.tables: expected a mapping"),
])
def test_bad_tables_are_refused_with_one_line(tables, text):
    with pytest.raises(PipelineError, match=text) as e:
        load_profile("autoround-q3", STAGES, "tiny", overrides={"quantize": {"tables": tables}})
    assert "\n" not in str(e.value)
