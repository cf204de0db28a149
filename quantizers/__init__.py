"""Quantization methods and on-disk packing. Never imports `pipelines`."""
