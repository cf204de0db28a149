"""`mossquant report MODEL`: every bundle of a model side by side in `artifacts/<model>/REPORT.md`.

Read from the manifests alone (the newest version of each profile), so the report shows exactly
what the bundles record: effective bits per weight with the per-component breakdown, fidelity
against the source (generator: teacher-forced KL / top-1 / per-block error on the held-out set;
codec: waveform SNR, PCM difference, log-mel distance), and the gate verdicts. PNG plots beside
it. The report and plots are written to a temporary folder first and moved into place, the
report last, so a reader never sees a report that points at missing plots.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .atomic import fsync_tree, temporary_sibling
from .errors import PipelineError
from .progress import progress

REPORT = "REPORT.md"
BF16_BPW = 16.0
# Preferred column order; components not listed here follow alphabetically.
COMPONENTS = ("backbone_linears", "embeddings", "heads", "norms")
GENERATOR_METRICS = ("kl_audio_mean", "kl_audio_max", "top1_audio_mean", "top1_audio_min", "kl_text", "top1_text",
                     "final_rel_error")
CODEC_METRICS = ("snr_db", "min_sequence_snr_db", "mean_abs_diff", "rel_mean_abs_diff", "max_abs_diff",
                 "log_mel_distance_db")
REQUIRED = ("schema", "model", "profile", "version", "status", "gate", "bits_per_weight")


@dataclass
class Entry:
    """The newest bundle of one profile."""

    folder: Path
    manifest: dict

    @property
    def profile(self) -> str:
        return self.manifest["profile"]

    @property
    def bpw(self) -> dict:
        return self.manifest["bits_per_weight"]

    @property
    def metrics(self) -> dict:
        """The generator's teacher-forced figures."""
        return (self.manifest.get("evaluation") or {}).get("metrics") or {} if self.manifest.get("kind") != "codec" else {}

    @property
    def codec(self) -> dict:
        """The codec's decode-parity figures."""
        return (self.manifest.get("evaluation") or {}).get("metrics") or {} if self.manifest.get("kind") == "codec" else {}

    @property
    def free(self) -> dict:
        """The free-running evaluation (stage freerun), when the profile ran one."""
        return self.manifest.get("free_running") or {}

    @property
    def failed(self) -> list[dict]:
        return [c for c in self.manifest["gate"].get("checks", []) if not c.get("passed")]

    def header_bpw(self) -> float:
        return self.bpw["header_bits"] / self.bpw["source_params"]

    def contributions(self) -> dict[str, float]:
        """Each component's bits over all source parameters: these add up to `effective`."""
        total = self.bpw["source_params"]
        out = {c: v["bits"] / total for c, v in self.bpw["components"].items()}
        out["headers"] = self.header_bpw()
        return out


def collect(model: str, root: Path) -> list[Entry]:
    """The newest bundle of every profile of `model` under root/<model>/<profile>/v1-*/."""
    from . import manifest

    folder = Path(root) / model
    profiles = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")) if folder.is_dir() else []
    entries = []
    for profile in progress(profiles, desc="report: manifests", unit="bundle"):
        newest = manifest.newest(folder / profile)
        if newest is None:
            continue
        m = manifest.read(newest)
        where = newest / "manifest.json"
        for key in REQUIRED:
            if key not in m:
                raise PipelineError(f"{where}: key {key!r} missing (expected a {manifest.SCHEMA} manifest)")
        if m["model"] != model or m["profile"] != profile:
            raise PipelineError(f"{where}: manifest says {m['model']}/{m['profile']}, found under {model}/{profile}/")
        for key in ("effective", "components", "header_bits", "source_params"):
            if key not in m["bits_per_weight"]:
                raise PipelineError(f"{where}: bits_per_weight.{key} missing")
        entries.append(Entry(newest, m))
    if not entries:
        raise PipelineError(f"{folder}: no bundles of model {model!r} (expected <profile>/v1-*/manifest.json; "
                            f"build one with `mossquant quantize PROFILE --model {model}`)")
    return entries


def every_version(entries: list[Entry]) -> list[Entry]:
    """Every bundle of the generator profiles shown, all versions (a uniform sweep builds one profile at
    several widths with `--set quantize.bits=B`: each is a point of the Pareto plot)."""
    from . import manifest

    out = []
    for e in entries:
        for folder in manifest.bundles(e.folder.parent):
            m = e.manifest if folder == e.folder else manifest.read(folder)
            if (m.get("evaluation") or {}).get("metrics") and "quantized_linear" in m.get("bits_per_weight", {}):
                out.append(Entry(folder, m))
    return out


# --------------------------------------------------------------------------- Markdown


def fmt(x) -> str:
    if x is None:
        return "—"
    if isinstance(x, bool) or isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return f"{x:.6g}"
    return str(x)


def table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return out + [""]


def components_of(entries: list[Entry]) -> list[str]:
    names = {c for e in entries for c in e.bpw["components"]}
    return [c for c in COMPONENTS if c in names] + sorted(names - set(COMPONENTS))


def extra_metrics(entries: list[Entry], known: tuple) -> list[str]:
    """Numeric figures beyond the standard columns (e.g. the scorers' `<name>.<key>`)."""
    return sorted({k for e in entries for k, v in e.metrics.items()
                   if k not in known and isinstance(v, (int, float)) and not isinstance(v, bool)})


def held_out(e: Entry) -> str:
    ev, st = e.manifest.get("evaluation") or {}, (e.manifest.get("stages") or {}).get("evaluate") or {}
    name = (ev.get("dataset") or {}).get("name", "?")
    return f"{name} ({st['nsamples']}×{st['seqlen']})" if "nsamples" in st and "seqlen" in st else name


def render(model: str, entries: list[Entry], plots: dict[str, str], root: Path) -> str:
    pins = sorted({(e.manifest.get("source") or {}).get("repo", "?") + " @ " + (e.manifest.get("source") or {}).get("revision", "?")
                   for e in entries})
    lines = [f"# Build report: {model}", "",
             f"Every bundle of `{model}` side by side: the newest version of each profile under `artifacts/{model}/`, "
             f"read from its `manifest.json` (nothing recomputed). Regenerate with `mossquant report {model}`.", "",
             f"Source: {', '.join(f'`{p}`' for p in pins)}.", ""]
    codec = _companion_codec(model)
    if codec and (Path(root) / codec).is_dir():
        lines += [f"Companion codec `{codec}`: see [its report](../{codec}/{REPORT}).", ""]

    lines += ["## Bundles", ""]
    rows = []
    for e in entries:
        m = e.manifest
        failed = "; ".join(f"{c['metric']} = {fmt(c['value'])} (limit {c['op']} {fmt(c['threshold'])})" for c in e.failed)
        rows.append([e.profile, f"[{m['version']}]({e.profile}/{m['version']}/)", m.get("method"), m["status"],
                     failed or None, round(e.bpw.get("stored_bits", 0) / 8e6, 3)])
    lines += table(["profile", "version", "method", "status", "failed checks", "weights (MB)"], rows)

    comps = components_of(entries)
    lines += ["## Bits per weight", "",
              "`effective`: every stored safetensors bit (packed weights, scales, zeros, protected tensors, headers) "
              "over the source's parameter count. Component columns: that component's own bits per weight; "
              "`headers`: safetensors header bits per source parameter. The bar chart stacks each component's share "
              "of `effective` (its bits over all source parameters).", ""]
    rows = [[e.profile, e.bpw["effective"], e.bpw.get("quantized_linear")]
            + [(e.bpw["components"].get(c) or {}).get("bpw") for c in comps] + [round(e.header_bpw(), 6)] for e in entries]
    lines += table(["profile", "effective", "quantized_linear", *comps, "headers"], rows)
    lines += _images(plots, ["bpw_components"])

    gen = [e for e in entries if e.metrics]
    if gen:
        extra = extra_metrics(gen, GENERATOR_METRICS)
        lines += ["## Fidelity against the BF16 source", "",
                  "Teacher-forced on the held-out set (never used for calibration): KL(source ‖ bundle) and top-1 "
                  "agreement per head (audio heads on the audio positions, averaged over the codebooks; the text head "
                  "everywhere), and ‖h_bundle − h_source‖ / ‖h_source‖ after each block.", ""]
        rows = [[e.profile, held_out(e)] + [e.metrics.get(k) for k in GENERATOR_METRICS + tuple(extra)] for e in gen]
        lines += table(["profile", "held-out set", *GENERATOR_METRICS, *extra], rows)
        lines += _images(plots, ["bpw_vs_fidelity", "block_error", "per_codebook"])
        pts = pareto_points(every_version(gen))
        if len(pts) > 1:
            front = set(pareto_front(pts))
            lines += ["### Bits against fidelity (Pareto)", "",
                      "Every bundle of every profile (all versions: `make pareto` adds uniform RTN and auto-round at 2, 3 "
                      "and 4 bits), and the plain-RTN figures the calibrated profiles scored on their own grids; "
                      "`front`: no other point has fewer bits and lower KL.", ""]
            lines += table(["point", "bits per Linear weight", "kl_audio_mean", "rejected", "front"],
                           [[label, x, y, rej, (x, y) in front] for x, y, label, rej in pts])
            lines += _images(plots, ["pareto"])
        base = [e for e in gen if rtn_baseline(e)]
        if base:
            lines += ["### Against plain RTN on the same grid", "",
                      "Profiles whose evaluate stage scores a baseline (`baseline: rtn`: round-to-nearest on each "
                      "quantized tensor's own grid, on the same held-out set) beside the bundle's own figures.", ""]
            keys = ("kl_audio_mean", "top1_audio_mean", "kl_text")
            rows = [[e.profile, held_out(e)] + [x for k in keys for x in (e.metrics.get(k), rtn_baseline(e).get(k))]
                    for e in base]
            lines += table(["profile", "RTN scored on", *(f"{k} ({w})" for k in keys for w in ("bundle", "rtn"))], rows)
    free = [e for e in entries if e.free]
    if free:
        lines += ["## Free-running against BF16", "",
                  "Each model generates on its own from held-out prompts (text plus a voice prompt of reference audio), "
                  "greedy and sampled; sampling is coupled (both models get the same noise). Ratios are to BF16 against "
                  "itself under other noise (1 = as far from BF16 as a reroll of the dice); the pooled figures are what "
                  "the gate reads. Per set, sampled: code agreement with BF16 (the reroll's in brackets), geometric-mean "
                  "length ratio, the decoded log-mel distance after the voice prompt (dB), runaways; greedy: rows before "
                  "the first divergence (median).", ""]
        keys = ("free.code_disagreement_ratio", "free.length_ratio", "free.length_shift", "free.runaway_excess",
                "free.log_mel_ratio")
        lines += table(["profile", *keys], [[e.profile] + [e.free["metrics"].get(k) for k in keys] for e in free])
        rows = []
        for e in free:
            for name, st in e.free["sets"].items():
                sm, rs, gr = st["sampled"], st["resample"], st["greedy"]
                rows.append([e.profile, name, f"{sm['code_agreement']:.3f} ({rs['code_agreement']:.3f})",
                             round(sm["length_ratio_gmean"], 3), None if sm["log_mel_db"] is None else round(sm["log_mel_db"], 3),
                             sm["runaways"], sorted(gr["first_divergence"])[len(gr["first_divergence"]) // 2]])
        lines += table(["profile", "set", "code agreement (reroll)", "length ratio", "log-mel dB", "runaways",
                        "greedy first divergence"], rows)
        lines += _images(plots, ["divergence", "decoded_distance"])
        listen = [(e, w) for e in free for w in e.free.get("wav", [])]
        if listen:
            lines += ["Listen (BF16 and quantized, same prompt and noise): "
                      + ", ".join(f"[{e.profile} {Path(w).stem}](wavs/{e.profile}/{Path(w).name})" for e, w in listen), ""]
    cod = [e for e in entries if e.codec]
    if cod:
        lines += ["## Codec fidelity against the FP32 decode", "",
                  "The validation code set decoded by the FP32 source and by the bundle: pooled SNR, the worst "
                  "sequence's SNR, PCM mean / relative mean / max absolute difference, and the log-mel spectral "
                  "distance (dB, worst sequence). `baseline_snr_db`: the source weights cast to the bundle's compute "
                  "dtype with no quantization (the compute-only floor).", ""]
        rows = [[e.profile, ((e.manifest.get("evaluation") or {}).get("dataset") or {}).get("name")]
                + [e.codec.get(k) for k in CODEC_METRICS] + [_baseline(e).get("snr_db")] for e in cod]
        lines += table(["profile", "validation set", *CODEC_METRICS, "baseline_snr_db"], rows)
        lines += _images(plots, ["codec_bpw_vs_fidelity", "sequence_snr"])
    lines += ["## Gate verdicts", ""]
    rows = []
    for e in entries:
        checks = e.manifest["gate"].get("checks", [])
        if not checks:
            rows.append([e.profile, e.manifest["status"], None, None, None, None])
        for c in checks:
            rows.append([e.profile, e.manifest["status"], c["metric"], c["value"], f"{c['op']} {fmt(c['threshold'])}",
                         "pass" if c["passed"] else "**FAIL**"])
    lines += table(["profile", "status", "metric", "value", "limit", "check"], rows)
    return "\n".join(lines).rstrip() + "\n"


def _images(plots: dict[str, str], names: list[str]) -> list[str]:
    return [line for n in names if n in plots for line in (f"![{plots[n]}]({n}.png)", "")]


def rtn_baseline(e: Entry) -> dict:
    """The evaluate stage's baseline figures (RTN on the bundle's own grid), when it scored one."""
    return ((e.manifest.get("evaluation") or {}).get("baseline") or {}).get("metrics") or {}


def _baseline(e: Entry) -> dict:
    return ((e.manifest.get("evaluation") or {}).get("unquantized_baseline") or {}).get("metrics") or {}


def _companion_codec(model: str) -> str | None:
    try:
        from .source import load_model_spec

        return load_model_spec(model).codec
    except PipelineError:  # bundles of a model whose YAML is gone still get a report
        return None


# --------------------------------------------------------------------------- plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colors(entries: list[Entry]) -> dict[str, object]:
    plt = _pyplot()
    cycle = plt.get_cmap("tab10")
    return {e.profile: cycle(i % 10) for i, e in enumerate(entries)}


def _scatter(ax, entries, colors, value, ylabel, reference=None, log=False):
    """One marker per bundle, named in a legend (text labels beside close points run together)."""
    for e in entries:
        y = value(e)
        if y is None or (log and y <= 0):
            continue
        rejected = e.manifest["status"] == "rejected"
        ax.scatter(e.bpw["effective"], y, color=colors[e.profile], marker="X" if rejected else "o", s=60, zorder=3,
                   label=e.profile + (" (rejected)" if rejected else ""))
    if reference is not None and not (log and reference[0] <= 0):
        ax.scatter(BF16_BPW, reference[0], color="grey", marker="*", s=120, zorder=3, label=reference[1])
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("effective bits per weight")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, which="both")


def _legend_outside(fig, ax):
    """The legend right of the axes, where it cannot cover a point."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))


def plot_bpw_vs_fidelity(fig, entries, colors):
    a, b = fig.subplots(1, 2)
    # KL spans decades between profiles (and BF16 is 0): a log axis, the source shown on the top-1 panel only.
    _scatter(a, entries, colors, lambda e: e.metrics.get("kl_audio_mean"), "KL audio (mean over codebooks, log)", log=True)
    _scatter(b, entries, colors, lambda e: e.metrics.get("top1_audio_mean"), "top-1 agreement, audio (mean)", (1.0, "BF16 source"))
    _legend_outside(fig, b)
    fig.suptitle("Cost against fidelity (teacher-forced, held-out set; X = rejected by the gate)")


def plot_codec_bpw_vs_fidelity(fig, entries, colors):
    a, b = fig.subplots(1, 2)
    base = next((_baseline(e) for e in entries if _baseline(e)), {})
    _scatter(a, entries, colors, lambda e: e.codec.get("snr_db"), "SNR vs FP32 decode (dB)",
             (base["snr_db"], "BF16 weights") if "snr_db" in base else None)
    _scatter(b, entries, colors, lambda e: e.codec.get("log_mel_distance_db"), "log-mel distance (dB)",
             (base["log_mel_distance_db"], "BF16 weights") if "log_mel_distance_db" in base else None)
    _legend_outside(fig, b)
    fig.suptitle("Codec: cost against fidelity (X = rejected by the gate)")


def plot_block_error(fig, entries, colors):
    from matplotlib.ticker import MaxNLocator

    ax = fig.subplots()
    for e in entries:
        err = e.metrics.get("block_rel_error") or []
        ax.plot(range(len(err)), err, marker="o", ms=3, color=colors[e.profile], label=e.profile)
    values = [x for e in entries for x in e.metrics.get("block_rel_error") or []]
    if min(values) > 0 and max(values) > 20 * min(values):  # log only where the spread needs it
        ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("decoder block")
    ax.set_ylabel("relative output error")
    ax.set_title("Per-block relative error against the BF16 source (errors propagate, as deployed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_per_codebook(fig, entries, colors):
    a, b = fig.subplots(1, 2)
    for e in entries:
        for ax, key in ((a, "kl_audio"), (b, "top1_audio")):
            vals = e.metrics.get(key) or []
            ax.plot(range(len(vals)), vals, marker=".", color=colors[e.profile], label=e.profile)
    a.set_ylabel("KL (source ‖ bundle)")
    b.set_ylabel("top-1 agreement")
    a.set_yscale("log")  # per-codebook KL spans decades between profiles
    for ax in (a, b):
        ax.set_xlabel("audio codebook")
        ax.grid(alpha=0.3, which="both")
    _legend_outside(fig, b)
    fig.suptitle("Per-codebook fidelity (audio heads)")


def plot_sequence_snr(fig, entries, colors):
    ax = fig.subplots()
    for e in entries:
        per = (e.manifest.get("evaluation") or {}).get("per_sequence") or {}
        names = sorted(per)
        ax.plot(names, [per[n].get("snr_db") for n in names], marker="o", color=colors[e.profile], label=e.profile)
    ax.set_xlabel("validation sequence")
    ax.set_ylabel("SNR vs FP32 decode (dB)")
    ax.set_title("Codec: per-sequence SNR")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_divergence(fig, entries, colors):
    """Code agreement with BF16 over the run (coupled sampling, mean over sets), per profile."""
    ax = fig.subplots()
    for e in entries:
        curves = [st["sampled"]["agreement_curve"] for st in e.free["sets"].values()]
        width = e.free["params"]["max_frames"] / len(curves[0])
        mean = [None if all(c[i] is None for c in curves) else
                sum(c[i] for c in curves if c[i] is not None) / sum(c[i] is not None for c in curves)
                for i in range(len(curves[0]))]
        xs = [(i + 0.5) * width for i, v in enumerate(mean) if v is not None]
        ax.plot(xs, [v for v in mean if v is not None], marker="o", ms=3, color=colors[e.profile], label=e.profile)
    ax.set_xlabel("generated row")
    ax.set_ylabel("codes equal to BF16's (coupled sampling)")
    ax.set_title("Free-running divergence from BF16")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_decoded_distance(fig, entries, colors):
    ax = fig.subplots()
    for e in entries:
        names = list(e.free["sets"])
        ax.plot(names, [e.free["sets"][n]["sampled"]["log_mel_db"] for n in names], marker="o", color=colors[e.profile],
                label=e.profile)
    ref = next(iter(entries)).free["sets"]
    ax.plot(list(ref), [ref[n]["resample"]["log_mel_db"] for n in ref], ls="--", color="grey", label="BF16 reroll")
    ax.set_xlabel("held-out set")
    ax.set_ylabel("decoded log-mel distance to BF16 (dB)")
    ax.set_title("Free-running: decoded audio against BF16's")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _point_label(e: Entry) -> str:
    """The profile, with its uniform width where the recipe has one (a sweep builds several)."""
    bits = ((e.manifest.get("stages") or {}).get("quantize") or {}).get("bits")
    return f"{e.profile} ({bits}-bit)" if e.manifest.get("method") in ("rtn", "autoround", "awq") and bits else e.profile


def pareto_points(entries: list[Entry]) -> list[tuple[float, float, str, bool]]:
    """(bits per Linear weight, audio KL, label, rejected) for every bundle, and the plain-RTN figures its
    evaluate stage scored on the same grid (not gated: rejected None)."""
    pts = {}
    for e in entries:
        x, y = e.bpw["quantized_linear"], e.metrics.get("kl_audio_mean")
        if y is not None:
            pts.setdefault(_point_label(e), (x, y, _point_label(e), e.manifest["status"] == "rejected"))
        base = rtn_baseline(e).get("kl_audio_mean")
        if base is not None and e.manifest.get("method") != "rtn":
            label = f"plain RTN, grid of {_point_label(e)}"
            pts.setdefault(label, (x, base, label, None))  # scored, not gated
    return sorted(pts.values())


def pareto_front(points) -> list[tuple[float, float]]:
    """The points no other beats on both axes (fewer bits and lower KL), in order of bits."""
    front, best = [], float("inf")
    for x, y, *_ in sorted(points, key=lambda p: (p[0], p[1])):
        if y < best:
            front.append((x, y))
            best = y
    return front


def plot_pareto(fig, entries, colors):
    ax = fig.subplots()
    pts = pareto_points(entries)
    cmap = _pyplot().get_cmap("tab20")
    for i, (x, y, label, rejected) in enumerate(pts):
        ax.scatter(x, y, color=cmap(i % 20), marker="X" if rejected else "o", s=50, zorder=3,
                   label=label + (" (rejected)" if rejected else ""))
    front = pareto_front(pts)
    ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="grey", lw=1, ls="--", label="Pareto front")
    ax.set_yscale("log")
    ax.set_xlabel("stored bits per backbone-Linear weight (scales and zeros included)")
    ax.set_ylabel("KL audio, teacher-forced (mean over codebooks, log)")
    ax.set_title("Bits against fidelity: every bundle and the plain-RTN baselines (X = rejected)")
    ax.grid(alpha=0.3, which="both")
    _legend_outside(fig, ax)


def plot_bpw_components(fig, entries, colors):
    ax = fig.subplots()
    names = components_of(entries) + ["headers"]
    cmap = _pyplot().get_cmap("Set2")
    x = range(len(entries))
    bottom = [0.0] * len(entries)
    for i, c in enumerate(names):
        vals = [e.contributions().get(c, 0.0) for e in entries]
        ax.bar(x, vals, bottom=bottom, color=cmap(i % 8), label=c)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, e in enumerate(entries):
        ax.annotate(f"{e.bpw['effective']:.3f}", (i, bottom[i]), textcoords="offset points", xytext=(0, 3),
                    ha="center", fontsize=8)
    ax.axhline(BF16_BPW, color="grey", ls="--", lw=1, label="BF16")
    ax.set_xticks(list(x), [e.profile for e in entries], rotation=20, ha="right")
    ax.set_ylabel("bits per source weight")
    ax.set_title("Effective bits per weight, by component")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def plot_specs(entries: list[Entry]) -> list[tuple[str, str, object, list[Entry]]]:
    """(file stem, alt text, plot function, the entries it shows), only where there is data."""
    gen = [e for e in entries if e.metrics]
    cod = [e for e in entries if e.codec]
    specs = [("bpw_components", "effective bits per weight by component", plot_bpw_components, entries)]
    if gen:
        specs += [("bpw_vs_fidelity", "effective bits per weight against KL and top-1", plot_bpw_vs_fidelity, gen),
                  ("pareto", "bits per Linear weight against audio KL, every bundle (Pareto front)", plot_pareto,
                   every_version(gen)),
                  ("block_error", "per-block relative error", plot_block_error,
                   [e for e in gen if e.metrics.get("block_rel_error")]),
                  ("per_codebook", "per-codebook KL and top-1", plot_per_codebook, gen)]
    free = [e for e in entries if e.free]
    if free:
        specs += [("divergence", "free-running agreement with BF16 over the generated rows", plot_divergence, free),
                  ("decoded_distance", "free-running decoded log-mel distance per set", plot_decoded_distance, free)]
    if cod:
        specs += [("codec_bpw_vs_fidelity", "codec: bits per weight against SNR and log-mel distance",
                   plot_codec_bpw_vs_fidelity, cod),
                  ("sequence_snr", "codec: per-sequence SNR", plot_sequence_snr, cod)]
    return [s for s in specs if s[3]]


# --------------------------------------------------------------------------- writing


def write_report(model: str, root: Path | None = None) -> Path:
    """Write artifacts/<model>/REPORT.md and its PNGs; returns the report's path."""
    from .source import ARTIFACTS

    root = Path(root) if root else ARTIFACTS
    entries = collect(model, root)
    plt = _pyplot()
    colors = _colors(entries)
    folder = root / model
    tmp = temporary_sibling(folder / "report")
    try:
        plots = {}
        for stem, alt, fn, shown in progress(plot_specs(entries), desc="report: plots", unit="plot"):
            fig = plt.figure(figsize=(11, 4.5) if fn in (plot_bpw_vs_fidelity, plot_per_codebook, plot_codec_bpw_vs_fidelity,
                                                         plot_pareto)
                             else (8, 4.5))
            try:
                fn(fig, shown, colors)
                fig.tight_layout()
                fig.savefig(tmp / f"{stem}.png", dpi=100, bbox_inches="tight", metadata={"Software": None})  # no version stamp: stable bytes
            finally:
                plt.close(fig)
            plots[stem] = alt
        for e in entries:  # the free-running WAVs beside the report, so a person can listen
            for w in e.free.get("wav", []):
                (tmp / "wavs" / e.profile).mkdir(parents=True, exist_ok=True)
                shutil.copyfile(e.folder / w, tmp / "wavs" / e.profile / Path(w).name)
        (tmp / REPORT).write_text(render(model, entries, plots, root))
        fsync_tree(tmp)
        for stem in sorted(plots):
            os.replace(tmp / f"{stem}.png", folder / f"{stem}.png")
        if (tmp / "wavs").is_dir():
            shutil.rmtree(folder / "wavs", ignore_errors=True)
            os.replace(tmp / "wavs", folder / "wavs")
        os.replace(tmp / REPORT, folder / REPORT)  # last: the plots it names are already in place
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder / REPORT
