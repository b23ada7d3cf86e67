"""Shared helpers for benchmark scripts: provenance (commit, device, command) and result files.

    from bench.common import write_results
    md, js = write_results("engine", rows, device="cpu", command=command_line())

writes bench/results/<name>-<device>.md (provenance + a markdown table) and .json (the same, machine-readable).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def git_commit() -> str:
    """Short HEAD commit, with `+dirty` when tracked files differ from it; `unknown` outside git.
    `BENCH_COMMIT` overrides it (runs on a copy of the tree without .git)."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")


def command_line() -> str:
    """How this process was started, e.g. `python -m bench.engine --preset h3 --num-blocks 4`."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    head = ["python", "-m", spec.name] if spec is not None and spec.name else ["python", *sys.argv[:1]]
    return shlex.join([*head, *sys.argv[1:]])


def device_tag(device: str) -> str:
    """The device part of a results file's name: `cpu`, or the GPU's name as `nvidia-h200`."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return "-".join(torch.cuda.get_device_name(torch.device(device)).lower().split())
    return "cpu"


def device_description(device: str) -> str:
    """`NVIDIA H200 (139.8 GiB), torch 2.13.0, CUDA 12.8` or `cpu: <processor>, N cores, torch ...`."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        return (f"{props.name} ({props.total_memory / 2**30:.1f} GiB), torch {torch.__version__}, "
                f"CUDA {torch.version.cuda}")
    cpu = platform.processor() or platform.machine()
    return f"cpu: {cpu}, {os.cpu_count()} cores ({torch.get_num_threads()} torch threads), torch {torch.__version__}"


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Rows of dicts -> a markdown table (columns: given, else the union of keys in first-seen order)."""
    if columns is None:
        columns = list(dict.fromkeys(key for row in rows for key in row))

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return "" if value is None else str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-").lower() or "unknown"


def write_run_results(name: str, rows: Sequence[dict[str, Any]], device: str, smoke: bool, command: str,
                      notes: list[str], started: float, out_dir: str | os.PathLike | None = None) -> Path:
    """A one-device bench's ending: the whole run's seconds (from `started`, a `time.perf_counter()`) as the last
    note, then `write_results` under `<name>-<device tag>` (`smoke-` before the tag for a `--smoke` run); prints
    the table and returns its markdown path."""
    notes.append(f"whole run: {time.perf_counter() - started:.0f} s")
    tag = device_tag(device)
    md, _ = write_results(name, rows, f"smoke-{tag}" if smoke else tag, command, notes=notes, out_dir=out_dir)
    print(md.read_text())
    return md


def write_results(
    name: str,
    rows: Sequence[dict[str, Any]],
    device: str,
    command: str,
    *,
    columns: Sequence[str] | None = None,
    notes: Sequence[str] = (),
    out_dir: str | os.PathLike | None = None,
) -> tuple[Path, Path]:
    """Write `<out_dir>/<name>-<device>.md` and `.json` (default out_dir: bench/results); return both paths.

    `device` is the tag in the file name (`cpu`, `cuda`, `h200`...); the description of the actual device
    (model, memory, torch/CUDA versions) is recorded inside.
    """
    out = Path(out_dir) if out_dir is not None else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{_slug(name)}-{_slug(device)}"
    meta = {
        "name": name,
        "commit": git_commit(),
        "device": device,
        "device_description": device_description("cuda" if device != "cpu" else "cpu"),
        "command": command,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
    }
    md = [f"# {name} ({device})", "",
          f"- commit: `{meta['commit']}`", f"- device: {meta['device_description']}",
          f"- command: `{command}`", f"- date: {meta['date']}", ""]
    md += [f"- {note}" for note in notes]
    if notes:
        md.append("")
    md += [markdown_table(rows, columns), ""]
    md_path, json_path = out / f"{stem}.md", out / f"{stem}.json"
    md_path.write_text("\n".join(md))
    json_path.write_text(json.dumps({**meta, "notes": list(notes), "rows": list(rows)}, indent=1, default=str) + "\n")
    return md_path, json_path


def write_sectioned_report(out: Path, stem: str, title: str, meta: dict[str, Any], notes: Sequence[str],
                           sections: Sequence[tuple[str, Sequence[dict[str, Any]]]], skipped: Sequence[str],
                           record: dict[str, Any]) -> Path:
    """`<out>/<stem>.md` (the run's header, then one table per non-empty section, then what was not measured) and
    `<stem>.json` (`record`); returns the markdown path. The multi-table benches' one writer."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# {title} ({meta['device']})", "",
             f"- commit: `{meta['commit']}`", f"- device: {meta['device_description']}",
             f"- command: `{meta['command']}`",
             f"- date: {meta['date']}", *[f"- {n}" for n in notes], ""]
    for heading, rows in sections:
        if rows:
            lines += [f"## {heading}", "", markdown_table(rows), ""]
    if skipped:
        lines += ["## Not measured", "", *[f"- {s}" for s in skipped], ""]
    path = out / f"{stem}.md"
    path.write_text("\n".join(lines))
    (out / f"{stem}.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    return path
