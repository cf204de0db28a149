"""Stages, models, calibration, bundles and the registry. Uses `quantizers`, never the reverse."""
