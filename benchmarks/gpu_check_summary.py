"""The summary of `make gpu-check` (benchmarks/gpu_check.sh): test counts from junit.xml, the
demo's modes, the benchmark's rows, and each phase's time, written to ``<out>/summary.md``.

Reads only what the earlier phases left; a missing or partial file is reported as such."""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import xml.etree.ElementTree as ET


def junit_summary(path):
    if not os.path.exists(path):
        return ["- junit: **missing** (the suite did not write `junit.xml`)"], {}
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        return [f"- junit: **unreadable** ({e})"], {}
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    failing, skip_reasons = [], {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = [c.tag for c in case]
        if "failure" in kinds:
            counts["failed"] += 1
            el = case.find("failure")
            failing.append((name, "failed", (el.get("message") or "").splitlines()[:1]))
        elif "error" in kinds:
            counts["error"] += 1
            el = case.find("error")
            failing.append((name, "error", (el.get("message") or "").splitlines()[:1]))
        elif "skipped" in kinds:
            counts["skipped"] += 1
            msg = (case.find("skipped").get("message") or "").strip()
            skip_reasons[msg] = skip_reasons.get(msg, 0) + 1
        else:
            counts["passed"] += 1
    total = sum(counts.values())
    lines = [f"- tests reported in junit: {total} — passed {counts['passed']}, failed "
             f"{counts['failed']}, errors {counts['error']}, skipped {counts['skipped']}"]
    for name, kind, msg in failing[:40]:
        lines.append(f"  - {kind}: `{name}`" + (f" — {msg[0][:200]}" if msg else ""))
    if len(failing) > 40:
        lines.append(f"  - ... and {len(failing) - 40} more (junit.xml)")
    for msg, n in sorted(skip_reasons.items(), key=lambda kv: -kv[1])[:10]:
        lines.append(f"  - skipped {n}x: {msg[:160]}")
    return lines, counts


def pytest_log_summary(path, reported):
    if not os.path.exists(path):
        return []
    text = open(path, errors="replace").read()
    lines = []
    m = re.search(r"(\d+) workers \[(\d+) items?\]", text) or re.search(
        r"collected (\d+) items?", text)
    if m:
        n = int(m.group(m.lastindex))
        lines.append(f"- collected: {n} tests"
                     + (f"; {n - reported} not in junit (unfinished when the time limit cut "
                        f"the run)" if reported is not None and n > reported else ""))
    tail = [ln for ln in text.strip().splitlines() if ln.strip()][-1:] or [""]
    lines.append(f"- pytest's last line: `{tail[0][:200]}`")
    if "KeyboardInterrupt" in text or "Interrupted" in text:
        lines.append("- the suite was interrupted by its time limit; tests not in junit did "
                     "not finish")
    return lines


def demo_summary(demo_dir):
    path = os.path.join(demo_dir or "", "results.json")
    if not demo_dir or not os.path.exists(path):
        return ["- demo: no results.json (it did not finish; see run.log)"], None
    with open(path) as f:
        res = json.load(f)
    modes = res.get("modes", [])
    ok = [m for m in modes if m.get("status") == "ok"]
    lines = [f"- demo modes OK: {len(ok)}/{len(modes)}"]
    for m in modes:
        if m.get("status") != "ok":
            lines.append(f"  - {m.get('name')}: {m.get('status')} — "
                         f"{str(m.get('reason') or '')[:200]}")
    return lines, (len(ok), len(modes))


def bench_summary(out):
    lines = []
    for path in sorted(glob.glob(os.path.join(out, "*.json"))):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError):
            continue
        if "rows" not in data or "model" not in data:
            continue
        rows = data["rows"]
        kinds = {"ok": 0, "same program": 0, "skipped": 0, "not run": 0, "error": 0}
        for r in rows:
            s = r.get("status", "")
            k = ("ok" if s == "ok" else "same program" if s.startswith("same program")
                 else "skipped" if s.startswith("skipped") else "not run"
                 if s.startswith("not run") else "error")
            kinds[k] += 1
        lines.append(f"- bench {os.path.basename(path)}: {len(rows)} rows — "
                     + ", ".join(f"{k} {v}" for k, v in kinds.items()))
        for r in rows:
            s = r.get("status", "")
            if s != "ok" and not s.startswith("same program"):
                lines.append(f"  - {r.get('name')}: {s[:200]}")
    return lines or ["- bench: no table written (see run.log)"]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--demo", default=None)
    ap.add_argument("--total-s", default=None)
    ap.add_argument("--phases", nargs="*", default=[])
    args = ap.parse_args(argv)
    junit, counts = junit_summary(os.path.join(args.out, "junit.xml"))
    md = ["# gpu-check summary", "", "## Phases", ""]
    md += [f"- {p}" for p in args.phases]
    if args.total_s:
        md.append(f"- total: {args.total_s} s")
    md += ["", "## Test suite", ""] + junit + pytest_log_summary(
        os.path.join(args.out, "pytest.log"), sum(counts.values()) if counts else None)
    md += ["", "## Demo", ""] + demo_summary(args.demo)[0]
    md += ["", "## Benchmark", ""] + bench_summary(args.out)
    text = "\n".join(md) + "\n"
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
