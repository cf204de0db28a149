"""Optional subcommands (push/pull/ls, rebuild, report, export-backbone): each import registers its commands."""
import importlib

for _mod in ("registry.commands", "rebuild", "report", "backbone_export"):
    try:
        importlib.import_module(f"pipelines.{_mod}")
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("pipelines"):
            raise
