"""The GPU check's report: its sections' files merged into one JSON, and a summary to read.

    python -m bench.gpu_report --out FILE [--meta KEY=VALUE ...] SECTION_FILE...

A section whose file still says "running" was stopped by the script's time limit: it is
reported as timed out, with what it had measured. No torch here: the report runs after
the sections, on whatever they left.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

SECTIONS = ("correctness", "steps", "throughput", "roofline", "scenarios")


def merge(files: list[Path], meta: dict[str, str]) -> dict[str, Any]:
    """One JSON: `meta`, the device (from the first section that recorded it), and every
    section, "did not run" for one without a file."""
    sections: dict[str, Any] = {name: {"status": "did not run"} for name in SECTIONS}
    for path in files:
        if path.exists() and path.stat().st_size:
            sections.update(json.loads(path.read_text()))
    for data in sections.values():
        if data.get("status") == "running":
            data["status"] = "timed out (what it measured is kept)"
    device = next((s["device"] for s in sections.values() if "device" in s), None)
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {"created_at": created, **meta, "device": device, "sections": sections}


def summary(result: dict[str, Any]) -> list[str]:
    device = result.get("device") or {}
    lines = [f"GPU check on {device.get('name', '?')} ({device.get('type', '?')}), "
             f"torch {device.get('torch', '?')}, CUDA {device.get('cuda', '?')}"]  # fmt: skip
    for name in SECTIONS:
        data = result["sections"][name]
        lines.append(f"\n== {name}: {data.get('status')}")
        if "error" in data:
            lines.append(f"   error: {data['error']}")
        lines += SECTION_LINES[name](data)
    return lines


def _correctness_lines(data: dict[str, Any]) -> list[str]:
    lines = []
    for row in data.get("results", []):
        label = f"{row['weights']:13s} {row['dtype']:9s} {row.get('graphs', ''):36s}"
        if "status" in row:
            lines.append(f"   {label} {row['status']}")
            continue
        verdict = "identical" if row["is_identical"] else (
            f"{row['num_mismatched']} differ (first divergence at tokens {row['first_divergence']})"
        )  # fmt: skip
        lines.append(f"   {label} {row['num_prompts']} prompts x {row['max_tokens']} tokens: "
                     f"{verdict}; {row['num_graph_replays']} graph steps")  # fmt: skip
        if row.get("graphs_error"):
            lines.append(f"      no graphs: {row['graphs_error']}")
    return lines


def _steps_lines(data: dict[str, Any]) -> list[str]:
    lines = []
    for row in data.get("rows", []):
        medians = "  ".join(f"{name} {t * 1e3:.2f} ms" for name, t in row["median_s"].items())
        lines.append(f"   {row['shape']:42s} {medians}")
    return lines


def _throughput_lines(data: dict[str, Any]) -> list[str]:
    lines = ["   run                                        out tok/s  TTFT p50/p99 ms"
             "   ITL p50/p99 ms  graph steps"]  # fmt: skip
    for label, run in data.get("runs", {}).items():
        if not isinstance(run, dict):
            lines.append(f"   {label:42s} {run}")
            continue
        ttft, itl = run["ttft_s"], run["itl_s"]
        lines.append(
            f"   {label:42s} {run['output_tokens_per_s']:9.0f}  "
            f"{ttft['p50'] * 1e3:6.1f}/{ttft['p99'] * 1e3:7.1f}  "
            f"{itl['p50'] * 1e3:6.2f}/{itl['p99'] * 1e3:6.2f}  "
            f"{run['graph_replay_fraction']:10.0%}"
        )
        for kind, steps in run.get("steps", {}).items():  # the step times behind the ITL
            lines.append(
                f"      {kind} steps: {steps['num']}, p50/p99/max "
                f"{steps['p50'] * 1e3:.2f}/{steps['p99'] * 1e3:.2f}/{steps['max'] * 1e3:.2f} ms,"
                f" {steps['total_s']:.2f} s in all"
            )
    return lines


def _roofline_lines(data: dict[str, Any]) -> list[str]:
    bandwidth = data.get("bandwidth")
    lines = []
    if bandwidth:
        lines.append(
            f"   bandwidth {bandwidth['bytes_per_s'] / 1e9:.0f} GB/s ({bandwidth['method']})"
        )
    for label, point in data.get("points", {}).items():
        if not isinstance(point, dict):
            lines.append(f"   {label:40s} {point}")
            continue
        lines.append(
            f"   {label:40s} step {point['step_s'] * 1e3:7.3f} ms, roofline "
            f"{point['roofline_s'] * 1e3:7.3f} ms: {point['fraction_of_roofline']:6.1%}, "
            f"{point['tokens_per_s']:8.0f} tok/s"
        )
    return lines


def _scenarios_lines(data: dict[str, Any]) -> list[str]:
    lines = []
    if "capacity_tokens_per_s" in data:
        lines.append(f"   scaled to a capacity of {data['capacity_tokens_per_s']:.0f} tok/s: "
                     f"{json.dumps(data.get('sizes'))}")  # fmt: skip
    for name, outcome in data.get("results", {}).items():
        if not isinstance(outcome, dict):
            lines.append(f"   {name}: {outcome}")
            continue
        for check, value in outcome["checks"].items():
            verdict = "met" if value["is_met"] else "NOT met"
            lines.append(f"   {name}: {check}: {value['value']:.3f}: {verdict}")
    return lines


SECTION_LINES = {
    "correctness": _correctness_lines,
    "steps": _steps_lines,
    "throughput": _throughput_lines,
    "roofline": _roofline_lines,
    "scenarios": _scenarios_lines,
}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_report")
    parser.add_argument("--out", required=True)
    parser.add_argument("--meta", action="append", default=[], help="KEY=VALUE")
    parser.add_argument("files", nargs="*")
    args = parser.parse_args(argv)
    meta = dict(item.split("=", 1) for item in args.meta)
    result = merge([Path(f) for f in args.files], meta)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("\n".join(summary(result)))
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
