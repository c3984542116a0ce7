"""The frontier's outputs: its JSON, two figures and its section of RESULTS.md (table, TapeSAC
against each baseline at equal memory), and the batch-growth comparison's JSON and section."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.common import mib, pct, quartiles
from benchmarks.figures import method_frontier_figure, normalised_frontier_figure

TITLE = (
    "# TapeSAC against every baseline: the memory-time frontier\n\n"
    "Sections between the `frontier` HTML comment markers are written by `python -m benchmarks.frontier` "
    "(`tapesac bench`); the rest is written by hand.\n"
)


def _torch_checkpoint_planning(plan: dict[str, Any]) -> str:
    """The planning sentence's end when plans could run blocks under torch.utils.checkpoint."""
    if not plan.get("torch_checkpoint_blocks"):
        return ""
    must, full = plan["must_only_steps_s"], plan["full_steps_s"]
    return (
        " Plans may run blocks under torch.utils.checkpoint (`torch_checkpoint_blocks`): before "
        f"planning, {len(must)} must-only steps took median "
        f"{statistics.median(must) * 1e3:.1f} ms and {len(full)} full-checkpointing steps "
        f"{statistics.median(full) * 1e3:.1f} ms"
        if full
        else " Plans may run blocks under torch.utils.checkpoint (`torch_checkpoint_blocks`), but "
        "no full-checkpointing step was predicted within the probe's limit"
    )


def table(result: dict[str, Any]) -> str:
    lines = [
        "| method | peak MiB | limit MiB (predicted peak) | median step ms (IQR) | recomputed GFLOP "
        "| extra memory (Fig. 9) | recompute eliminated, FLOPs | recompute eliminated, time (IQR) "
        "| note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(result["rows"], key=lambda r: (r["peak_bytes"] is None, r["peak_bytes"] or 0)):
        if r["error"]:
            lines.append(
                f"| {r['method']} | - | - | failed | - | - | - | - | "
                f"{r['note']}; **{_cell(r['error'][:300])}** |"
            )
            continue
        t = (
            f"{1e3 * r['median_s']:.1f} ({1e3 * r['q1_s']:.1f}-{1e3 * r['q3_s']:.1f})"
            if "median_s" in r
            else "-"
        )
        ts = (
            f"{pct(r['time_share'])} ({pct(r['time_share_q1'])} to {pct(r['time_share_q3'])})"
            if "time_share" in r
            else "-"
        )
        re = f"{r['recomputed_flops'] / 1e9:.4g}" if r.get("recomputed_flops") is not None else "-"
        limit = mib(r["limit_bytes"]) + (
            f" ({mib(r['plan_predicted_peak_bytes'])})"
            if r.get("plan_predicted_peak_bytes") is not None
            else ""
        )
        lines.append(
            f"| {r['method']} | {mib(r['peak_bytes'])} | {limit} | {t} | {re} "
            f"| {pct(r.get('memory_share'))} | {pct(r.get('flop_share'))} | {ts} | {_cell(r['note'])} |"
        )
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def comparisons(result: dict[str, Any]) -> list[str]:
    """For every baseline (``none`` included), the TapeSAC rows at equal or lower measured peak:
    the one recomputing the fewest FLOPs and the fastest by median time, each against the
    baseline, the time also paired per round; no point hidden."""
    rows_ = [r for r in result["rows"] if not r["error"] and "median_s" in r]
    ours = [r for r in rows_ if r["family"] == "tapesac"]
    out = []
    for b in rows_:
        if b["family"] == "tapesac":
            continue
        fit = [r for r in ours if r["peak_bytes"] <= b["peak_bytes"]]
        head = (
            f"- **{b['method']}** ({mib(b['peak_bytes'])} MiB, "
            f"{_gflop(b.get('recomputed_flops'))} GFLOP recomputed, {1e3 * b['median_s']:.1f} ms): "
        )
        if not fit:
            out.append(
                head + "**no TapeSAC row at equal or lower peak** (TapeSAC's lowest measured "
                f"peak is {mib(min(r['peak_bytes'] for r in ours)) if ours else '-'} MiB)."
            )
            continue
        fewest = min(fit, key=lambda r: (r.get("recomputed_flops") or 0, r["median_s"]))
        fastest = min(fit, key=lambda r: r["median_s"])
        fb, fo = b.get("recomputed_flops") or 0, fewest.get("recomputed_flops") or 0
        flop = "ahead" if fo < fb else ("level" if fo == fb else "**behind**")
        ratio = b["median_s"] / fastest["median_s"]
        overlap = fastest["q1_s"] <= b["q3_s"] and b["q1_s"] <= fastest["q3_s"]
        timing = ("ahead" if ratio > 1 else "**behind**") + (" (IQRs overlap)" if overlap else "")
        out.append(
            head + f"by FLOPs {flop}: {fewest['method']} recomputes {_gflop(fo)} GFLOP at "
            f"{mib(fewest['peak_bytes'])} MiB; by time {timing}: {fastest['method']} "
            f"{1e3 * fastest['median_s']:.1f} ms at {mib(fastest['peak_bytes'])} MiB "
            f"(baseline / TapeSAC = {ratio:.3f}{_paired(b, fastest)})."
        )
    return out


def _paired(baseline: dict[str, Any], ours: dict[str, Any]) -> str:
    """The baseline's step over ours within each round, median and IQR: drift on a shared host
    moves both steps of a round alike, so this spreads less than the medians' ratio."""
    pairs = [
        x / y
        for x, y in zip(baseline.get("round_s", ()), ours.get("round_s", ()))
        if x is not None and y is not None
    ]
    if not pairs:
        return ""
    q1, med, q3 = quartiles(pairs)
    return f"; per round {med:.3f}, IQR {q1:.3f}-{q3:.3f}, {len(pairs)} rounds"


def _gflop(flops: int | None) -> str:
    return "-" if flops is None else f"{flops / 1e9:.4g}"


def write_outputs(result: dict[str, Any], out_dir: Path, markdown: Path | None) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"frontier_{'_'.join(run_name(result))}"
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    ok = [
        r
        for r in result["rows"]
        if not r["error"] and "median_s" in r and r["peak_bytes"] is not None
    ]
    points = [
        {
            "label": r["method"],
            "family": r["family"],
            "peak": r["peak_bytes"],
            "seconds": r["median_s"],
            "q1": r["q1_s"],
            "q3": r["q3_s"],
        }
        for r in ok
    ]
    title = f"{result['model']} {result['size']}, batch {result['batch']} x seq {result['seq']}"
    time_png = out_dir / f"{stem}_time_vs_memory.png"
    method_frontier_figure(points, title=f"Step time vs peak memory: {title}").savefig(time_png)
    norm = [
        {
            "label": r["method"],
            "family": r["family"],
            "memory_share": r["memory_share"],
            "flop_share": r.get("flop_share"),
            "time_share": r.get("time_share"),
            "time_q1": r.get("time_share_q1"),
            "time_q3": r.get("time_share_q3"),
        }
        for r in ok
        if r.get("memory_share") is not None
    ]
    norm_png = out_dir / f"{stem}_normalised.png"
    normalised_frontier_figure(norm, title=f"Normalised frontier (Figure 9): {title}").savefig(
        norm_png
    )
    paths = {"json": json_path, "time_png": time_png, "norm_png": norm_png}
    if markdown is not None:
        section = markdown_section(result, paths, markdown.parent)
        update_markdown(markdown, ":".join(run_name(result)), section)
        paths["markdown"] = markdown
    return paths


def run_name(result: dict[str, Any]) -> tuple[str, ...]:
    """Model and size, the save-set cap when it is not the default, and whether plans may run
    blocks under torch.utils.checkpoint (each its own files and section)."""
    cap = result.get("max_set_size", 12)
    torch_checkpoint = result.get("tapesac_planning", {}).get("torch_checkpoint_blocks", False)
    return (
        (result["model"], result["size"])
        + (() if cap == 12 else (f"set{cap}",))
        + (("torch_checkpoint",) if torch_checkpoint else ())
    )


def update_markdown(path: Path, key: str, section: str) -> None:
    """Replace this run's section (between its markers) in ``path``, or append it; everything
    outside the markers (the title, hand-written analysis, other runs' sections) is kept."""
    begin, end = f"<!-- frontier {key} -->", f"<!-- /frontier {key} -->"
    text = path.read_text() if path.exists() else TITLE
    block = f"{begin}\n{section}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def markdown_section(result: dict[str, Any], paths: dict[str, Path], base: Path) -> str:
    rel = {
        k: Path(p).resolve().relative_to(base.resolve())
        if Path(p).resolve().is_relative_to(base.resolve())
        else p
        for k, p in paths.items()
    }
    m = result["machine"]
    plan = result.get("tapesac_planning", {})
    lines = [
        f"## Frontier: {result['model']} model, size {result['size']}"
        + (
            f", TapeSAC's max_set_size {result['max_set_size']}"
            if result.get("max_set_size", 12) != 12
            else ""
        )
        + (
            ", TapeSAC's plans may run blocks under torch.utils.checkpoint"
            if plan.get("torch_checkpoint_blocks")
            else ""
        ),
        "",
        f"Command: `{result['command']}`  ",
        f"Machine: {m.get('cpu')} ({m.get('cpus')} CPUs), {m.get('platform')}, Python {m.get('python')}, "
        f"torch {m.get('torch')}{', GPU ' + m['gpu'] if 'gpu' in m else ''}; "
        f"{result['threads']} torch thread(s); commit {result['commit']}; wall {result['wall_s']:.0f} s.  ",
        f"Model: {result['parameters'] / 1e6:.2f}M parameters, batch {result['batch']} x seq {result['seq']}, "
        f"{result['dtype']}, dropout {result['dropout']}, on {result['device']}. Step = forward + loss + "
        f"backward (no optimizer; the same for every method).  ",
        f"Timing: {result['steps']} measured rounds after {result['warmup']} warm-up rounds; each round runs "
        "one step of every method, order rotated per round (torch.compile rows included: "
        "each budget compiled under a config patch in this process, so they are interleaved too).",
        "",
        "Peak: bytes above those live at the step's start (torch profiler's allocation events on "
        "CPU, exact; allocator peak on GPU). Recomputed FLOPs: backward FLOPs (FlopCounterMode, plus "
        "SDPA from shapes where FlopCounterMode has no formula, as on CPU) minus those of `none`. "
        "Figure 9 shares against `full`: extra memory = (peak − full's) / (none's − full's); "
        "recompute eliminated = (full's recomputation − this one's) / full's, from FLOPs and from "
        "time (per round: (t_full − t) / (t_full − t_none); median and IQR over rounds).",
        "",
        f"TapeSAC planning: the Controller (margin 0) profiled the model; must-only peak modelled "
        f"{mib(plan.get('must_only_peak_model'))} MiB, everything worth saving "
        f"{mib(plan.get('everything_worth_saving'))} MiB. `tapesac@f`: limit = must-only peak + f × "
        "everything; `tapesac@fig9=x`: limit = `full`'s measured peak + x × (`none`'s − `full`'s), "
        "Figure 9's extra-memory share x; `tapesac=X`: limit = X's measured peak. Rows whose plan is identical to an "
        "earlier one are merged (see notes)." + _torch_checkpoint_planning(plan),
        "",
        table(result),
        "",
        "### TapeSAC against each baseline at equal or lower measured peak",
        "",
        *comparisons(result),
        "",
        f"![step time vs peak memory]({rel['time_png']})",
        "",
        f"![normalised frontier]({rel['norm_png']})",
        "",
        f"Raw data: `{rel['json']}`.",
        "",
    ]
    return "\n".join(lines)


def write_growth(g: dict[str, Any], out_dir: Path, markdown: Path | None) -> str:
    """The batch-growth comparison's JSON, and its section in ``markdown`` when given; returns
    the section."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"frontier_growth_{g['model']}_{g['size']}.json"
    path.write_text(json.dumps(g, indent=1, default=str) + "\n")
    section = growth_section(g)
    if markdown is not None:
        update_markdown(markdown, f"growth:{g['model']}:{g['size']}", section)
    return section


def growth_section(g: dict[str, Any]) -> str:
    lines = [
        f"## Batch growth x{g['grow']}: {g['model']} model, size {g['size']}",
        "",
        f"Command: `{g['command']}`  ",
        f"Limit: {mib(g['limit_bytes'])} MiB ({g['limit_from']}), batch {g['batch']} -> "
        f"{g['batch'] * g['grow']} x seq {g['seq']}; {g['steps']} measured interleaved rounds "
        f"after {g['warmup']} warm-up at the grown batch. Controller steps: "
        + ", ".join(f"{h['batch']}:{h['mode']}" for h in g["controller_history"])
        + ".",
        "",
        "| method | peak at base batch MiB | peak at grown batch MiB | over the limit at grown batch MiB "
        "| median step ms at grown batch (IQR) | note |",
        "|---|---|---|---|---|---|",
    ]
    for r in g["rows"]:
        over = r["over_limit_bytes"]
        lines.append(
            f"| {r['method']} | {mib(r['peak_base_bytes'])} | {mib(r['peak_grown_bytes'])} "
            f"| {'**' + mib(over) + '**' if over else '0 (fits)'} "
            f"| {1e3 * r['median_s']:.1f} ({1e3 * r['q1_s']:.1f}-{1e3 * r['q3_s']:.1f}) "
            f"| {_cell(r['note'])} |"
        )
    s = g.get("replanned_speedup")
    if s:
        lines += [
            "",
            f"TapeSAC re-planned vs must-only at the grown batch: measured "
            f"{s['ratio_of_medians']:.3f}x (ratio of medians; per-round median {s['median_of_ratios']:.3f}, "
            f"IQR {s['q1']:.3f}-{s['q3']:.3f}), predicted {s['predicted']:.3f}x.",
        ]
    else:
        lines += ["", "The Controller did not reach a planned step at the grown batch."]
    return "\n".join(lines) + "\n"
