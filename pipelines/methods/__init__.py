"""The quantization methods, one module each, hooking into the layer-sequential engine where they
need activations (pipelines/engine.py); the algorithms and formats themselves live in `quantizers/`.
Each exposes `quantize(ctx, config, device) -> Weights`; the quantize stage dispatches on the
config's type."""
