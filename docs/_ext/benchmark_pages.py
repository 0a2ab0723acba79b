"""The benchmark pages, written from ``benchmarks/results/<name>.json`` at every build.

One Markdown page per results file: the machine it was measured on (the JSON's ``machine``), the
commit and date that recorded the file (git), the command that reruns it (the JSON's ``args``
turned back into the script's options), the method (the script's own docstring), the settings,
every result as tables, and the plot ``<name>.png`` where the script draws one. No figure is
copied by hand: rerun a benchmark and rebuild, and the page follows.
"""
from __future__ import annotations

import ast
import json
import re
import subprocess
from pathlib import Path

TITLES = {
    "scaling": "Scaling efficiency",
    "allreduce": "All-reduce bandwidth against the ring model",
    "accumulation": "Gradient accumulation",
    "compare": "hvdtrain vs plain Horovod vs PyTorch DDP",
    "compare_keras": "Keras: hvdtrain vs Horovod's own Keras layer vs one process",
    "trainer": "The training loop's own cost",
    "scaling_rule": "Learning-rate scaling rules by global batch",
    "gpu": "One GPU: hvdtrain vs a plain PyTorch loop",
    "gpu_breakdown": "One GPU: where a step's time goes",
    "vs_single": "Distributing vs one process",
    "modes": "Every job's speed: one mode or two",
}
# Results written by another script than <name>.py (compare.py --framework keras).
SCRIPTS = {"compare_keras": "compare"}
# Options that only say where output goes or which part of a run this process is.
NOT_RERUN = {"readme", "json_out", "worker", "render", "trainer_src"}
MAX_LIST = 8  # lists longer than this are left out of the tables (per-iteration timings)
MAX_COLUMNS = 12


def fmt(value) -> str:
    """A table cell: ratios to 3 decimals, large numbers to 1 (thousands separated), small ones
    to 3 significant digits, lists joined with ``; ``."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) < 0.1 or abs(value) >= 1e7:
            return f"{value:.3g}"
        if abs(value) < 10:
            return f"{value:.3f}"
        if abs(value) < 100:
            return f"{value:.2f}"
        return f"{value:,.1f}"
    if isinstance(value, list):
        return "; ".join(fmt(v) for v in value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def _scalar(value) -> bool:
    return not isinstance(value, (dict, list)) or (
        isinstance(value, list) and len(value) <= MAX_LIST
        and all(not isinstance(v, (dict, list)) for v in value))


def flatten(obj: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; long lists and lists of records are left out."""
    out = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        elif _scalar(value):
            out[name] = value
    return out


def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(fmt(h) for h in headers) + " |",
             "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _columns(records: list[dict]) -> list[str]:
    cols: list[str] = []
    for rec in records:
        cols += [k for k in rec if k not in cols]
    return cols


def render(obj, depth: int = 3) -> str:
    """Tables for one JSON value: its scalars as a two-column table, a list of records or a
    dict of records as one table (a row each), anything wider as a section per key."""
    if _scalar(obj):
        return fmt(obj)
    if isinstance(obj, list):
        records = [flatten(r) for r in obj if isinstance(r, dict)]
        if not records:
            return f"({len(obj)} values)"
        cols = _columns(records)
        return table(cols, [[r.get(c) for c in cols] for r in records])
    parts = []
    scalars = {k: v for k, v in obj.items() if _scalar(v)}
    if scalars:
        parts.append(table(["", "value"], [[k, v] for k, v in scalars.items()]))
    nested = {k: v for k, v in obj.items() if not _scalar(v)}
    records = {k: flatten(v) for k, v in nested.items() if isinstance(v, dict)}
    cols = _columns(list(records.values()))
    if records and len(records) == len(nested) and len(cols) <= MAX_COLUMNS:
        parts.append(table([""] + cols, [[k] + [r.get(c) for c in cols]
                                         for k, r in records.items()]))
    else:
        for key, value in nested.items():
            parts.append(f"{'#' * depth} {key}\n\n{render(value, min(depth + 1, 6))}")
    return "\n\n".join(parts)


def rst_to_markdown(text: str) -> str:
    """The scripts' docstrings (reStructuredText) as MyST Markdown: inline code and roles as
    code, ``Run::`` blocks as fenced code."""
    out: list[str] = []
    code: list[str] | None = None  # the lines of the literal block being read

    def end_block():
        while code and not code[-1].strip():
            code.pop()
        out.extend(["```text", *code, "```", ""])

    for line in text.splitlines():
        if code is not None:
            if line.strip() and not line.startswith("    "):
                end_block()
                code = None
            else:
                if code or line.strip():
                    code.append(line[4:])
                continue
        if line.rstrip().endswith("::"):
            head = line.rstrip()[:-2].rstrip()
            out += [head + ":" if head else "", ""]
            code = []
            continue
        line = re.sub(r":[a-z:]+:`~?\.?([^`]+)`", r"`\1`", line)
        out.append(re.sub(r"``([^`]+)``", r"`\1`", line))
    if code is not None:
        end_block()
    return "\n".join(out).rstrip() + "\n"


def first_command(text: str) -> str | None:
    """The first line of the first literal block (``Launch::``) of a docstring."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.rstrip().endswith("::"):
            for following in lines[i + 1:]:
                if following.strip():
                    return following.strip() if following.startswith("    ") else None
    return None


def rerun_command(script: Path, args: dict) -> str:
    """The command that reruns the benchmark with the recorded settings: each recorded option
    that the script still declares (``--min-bytes``), flags only when they were on."""
    source = script.read_text() if script.exists() else ""
    words = [f".venv/bin/python benchmarks/{script.name}"]
    for key, value in args.items():
        option = "--" + key.replace("_", "-")
        if key in NOT_RERUN or value is None or value is False or f'"{option}"' not in source:
            continue
        words.append(option if value is True else f"{option} {value}")
    return " ".join(words)


def recorded(results: Path, repo: Path) -> str:
    """``2026-11-22, commit 47a4d3f``: the last commit that changed the results file."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%cs %h", "--", str(results.resolve())],
                             cwd=repo, capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        out = []
    if len(out) != 2:
        return "not in this checkout's git history"
    return f"{out[0]}, commit `{out[1]}`"


def page(name: str, data: dict, bench_dir: Path) -> str:
    """The Markdown page of ``results/<name>.json`` (``data``)."""
    script = bench_dir / f"{SCRIPTS.get(name, name)}.py"
    results = bench_dir / "results" / f"{name}.json"
    png = bench_dir / "results" / f"{name}.png"
    title = TITLES.get(name, name.replace("_", " ").capitalize())
    doc = ast.get_docstring(ast.parse(script.read_text())) if script.exists() else None
    args = data.get("args") if isinstance(data.get("args"), dict) else None
    if args is not None:
        command = rerun_command(script, args)
    else:  # no recorded options: the script's own first launch line
        command = first_command(doc or "") or f"python benchmarks/{script.name}"
        command = command.split("  #")[0].rstrip()
    lines = [f"# {title}", "",
             f"Generated from `benchmarks/results/{name}.json` each time these pages are built.",
             "", table(["", ""], [
                 ["recorded", recorded(results, bench_dir.parent)],
                 ["script", f"`benchmarks/{script.name}`"],
             ]), "",
             "## Rerun", "", "```bash", command, "```", "",
             f"It rewrites `benchmarks/results/{name}.json`"
             + (f" and `{png.name}`" if png.exists() else "")
             + "; `make docs` then rebuilds this page.", ""]
    machine = data.get("machine")
    if isinstance(machine, dict):
        rows = [[k, str(v) if isinstance(v, int) and not isinstance(v, bool) else v]
                for k, v in machine.items()]  # versions and counts, not quantities
        lines += ["## Machine", "", table(["", ""], rows), ""]
    if doc:
        lines += ["## Method", "", rst_to_markdown(doc), ""]
    if args is not None:
        lines += ["## Settings", "", render(args), ""]
    body = {k: v for k, v in data.items() if k not in ("machine", "args")}
    if list(body) == ["results"]:
        body = body["results"]
    lines += ["## Results", "", render(body), ""]
    if png.exists():
        lines += [f"![{title}](../../../benchmarks/results/{png.name})", ""]
    return "\n".join(lines)


def write_pages(bench_dir: Path, out_dir: Path) -> list[Path]:
    """Write one page per ``bench_dir/results/*.json`` into ``out_dir`` (only files whose text
    changed, so Sphinx rereads only those); remove pages whose JSON is gone."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for results in sorted((bench_dir / "results").glob("*.json")):
        text = page(results.stem, json.loads(results.read_text()), bench_dir)
        path = out_dir / f"{results.stem}.md"
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        written.append(path)
    for stale in set(out_dir.glob("*.md")) - set(written):
        stale.unlink()
    return written
