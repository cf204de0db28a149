"""The stages, as data for the runner (pipelines/stages.py), in the order data flows:
sources -> calibrate -> measure -> quantize -> evaluate -> freerun -> gate -> [gguf] -> export. A profile lists a
subset of them, in this order."""
from __future__ import annotations

from . import calibration, codec_eval, evaluate, export, freerun, gate, gguf_export, quantize
from .methods import sensitivity
from .stages import StageSpec

STAGES = {
    "calibrate": StageSpec(calibration.run_calibrate, calibration.CalibrateParams),
    "measure": StageSpec(sensitivity.run_measure, sensitivity.MeasureParams, needs=("calibrate",)),
    "quantize": StageSpec(quantize.run, parse=quantize.parse, reads=("calibrate", "measure")),
    # The generator is judged teacher-forced against BF16; the codec by decoding against FP32.
    "evaluate": StageSpec({"generator": evaluate.run, "codec": codec_eval.run},
                          {"generator": evaluate.EvaluateParams, "codec": codec_eval.CodecEvaluateParams}, needs=("quantize",)),
    # ... and by what it generates on its own, decoded to audio (generator only).
    "freerun": StageSpec({"generator": freerun.run}, {"generator": freerun.FreeRunParams}, needs=("quantize",)),
    "gate": StageSpec(gate.run_gate, gate.GateParams, needs=("evaluate",), reads=("freerun",)),
    # The generator's integers as llama.cpp blocks (a model.gguf beside the safetensors in the bundle).
    "gguf": StageSpec(gguf_export.run, gguf_export.GGUFParams, needs=("quantize",)),
    "export": StageSpec(export.run, export.ExportParams, needs=("quantize",),
                        reads=("calibrate", "measure", "evaluate", "freerun", "gate", "gguf"), cached=False),
}
