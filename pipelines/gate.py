"""The quality gate: thresholds on earlier stages' metrics (teacher-forced from `evaluate`,
free-running `free.*` from `freerun`). A failing bundle is still built, with `status: rejected`
and the failed checks in its manifest."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .errors import PipelineError


@dataclass
class GateParams:
    sources: list[str] = field(default_factory=lambda: ["evaluate", "freerun"])  # stages whose `metrics` are checked
    max: dict = field(default_factory=dict)  # metric -> largest allowed value
    min: dict = field(default_factory=dict)  # metric -> smallest allowed value

    def validate(self):
        for bound in (self.max, self.min):
            for k, v in bound.items():
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ValueError(f"{k}: threshold must be a number, got {v!r}")


def run_gate(ctx, params: GateParams, out: Path) -> dict:
    metrics = {}
    for source in params.sources:
        if source not in ctx.results:
            if source == "freerun":  # optional: a profile without free-running has no free.* to check
                continue
            raise PipelineError(f"{ctx.profile.path}: gate.sources: {source!r} is not an earlier stage")
        metrics.update(ctx.results[source].get("metrics", {}))
    checks = []
    for op, bound in (("<=", params.max), (">=", params.min)):
        for name, limit in sorted(bound.items()):
            if name not in metrics or not isinstance(metrics[name], (int, float)):
                known = ", ".join(k for k, v in sorted(metrics.items()) if isinstance(v, (int, float)))
                raise PipelineError(f"{ctx.profile.path}: gate metric {name!r} not produced by "
                                    f"{' or '.join(params.sources)} (known: {known})")
            value = metrics[name]
            ok = value <= limit if op == "<=" else value >= limit
            checks.append({"metric": name, "op": op, "threshold": limit, "value": value, "passed": ok})
    status = "accepted" if all(c["passed"] for c in checks) else "rejected"
    return {"status": status, "checks": checks}
