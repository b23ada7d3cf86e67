"""dashboards/ditserve.json queries only metrics that exist (no Ray cluster, nothing imported from Ray).

Exported names are collected from the metric definitions in the code, read with `ast`: every
`Counter` / `Gauge` / `Histogram` made with a literal name in our `actors/` and `deployments/` (the only
packages that may import Ray), and in the installed Ray's own node metrics (the dashboard agent's
reporter: `ray_node_gpus_utilization`, ...) and Serve's (`ray_serve_*`). As scraped, Ray prefixes `ray_`;
a counter is `<name>_total`, a histogram `<name>_bucket` / `_sum` / `_count`, a gauge `<name>`.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "dashboards" / "ditserve.json"
#: Where Ray defines its node metrics (the dashboard agent's reporter) and Serve its own.
RAY_METRIC_SOURCES = ("dashboard/modules/reporter/reporter_agent.py", "serve/_private")
_SERIES = {"Counter": ("_total",), "Gauge": ("",), "Histogram": ("_bucket", "_sum", "_count")}


def defined_metrics(path: Path) -> set[str]:
    """The scraped series names of every metric a file defines with a literal name."""
    series = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        kind = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if kind not in _SERIES:
            continue
        name_arg = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "name"), None)
        if isinstance(name_arg, ast.Constant) and isinstance(name_arg.value, str):
            series.update(f"ray_{name_arg.value}{suffix}" for suffix in _SERIES[kind])
    return series


def python_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.py")) if root.is_dir() else [root]


def app_metrics() -> set[str]:
    return {name for package in ("actors", "deployments") for path in python_files(ROOT / package)
            for name in defined_metrics(path)}


def ray_metrics() -> set[str]:
    spec = importlib.util.find_spec("ray")  # a top-level package: found, not imported
    assert spec is not None and spec.origin is not None, "ray is not installed"
    ray_root = Path(spec.origin).parent
    return {name for source in RAY_METRIC_SOURCES for path in python_files(ray_root / source)
            for name in defined_metrics(path)}


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = {"and", "or", "unless", "bool", "offset"}


def promql_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers left once label matchers, ranges, grouping
    clauses and strings are removed, less function calls and keywords."""
    rest = _GROUPING.sub(" ", _RANGES.sub(" ", _MATCHERS.sub(" ", _STRINGS.sub(" ", expr))))
    names = set()
    for match in _IDENTIFIER.finditer(rest):
        is_call = rest[match.end():].lstrip().startswith("(")
        if not is_call and match.group() not in _KEYWORDS:
            names.add(match.group())
    return names


def test_the_promql_reader_finds_the_metrics_and_only_them():
    expr = ('histogram_quantile(0.95, sum by (stage, le) (rate(ray_a_bucket{application=~"$app",x="y"}[5m])))'
            ' / on() (sum(ray_b) or vector(0)) + avg without (le) (ray_c_total)')
    assert promql_metrics(expr) == {"ray_a_bucket", "ray_b", "ray_c_total"}


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [(f"panel {panel['title']!r}", target["expr"])
               for panel in dashboard["panels"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            metric = re.fullmatch(r"label_values\((\w+),\s*\w+\)", variable["definition"])
            assert metric, f"variable {variable['name']}: {variable['definition']!r} is not label_values(metric, label)"
            queries.append((f"variable {variable['name']!r}", metric.group(1)))
    return queries


def unexported(queries: list[tuple[str, str]], exported: set[str]) -> dict[str, list[str]]:
    """where -> the metrics its query selects that nobody exports."""
    missing = {}
    for where, expr in queries:
        names = promql_metrics(expr)
        assert names, f"{where}: {expr!r} selects no metric"
        if unknown := sorted(names - exported):
            missing[where] = unknown
    return missing


def test_every_metric_the_dashboard_queries_is_exported():
    missing = unexported(dashboard_queries(), app_metrics() | ray_metrics())
    assert not missing, f"queried but exported by neither the app nor Ray: {missing}"


def test_a_panel_querying_a_metric_nobody_exports_is_found(tmp_path):
    """The check above can fail: a misspelt name, or a histogram queried as a counter, is reported by panel."""
    source = tmp_path / "metrics.py"
    source.write_text('Counter("ditserve_video_jobs_finished", tag_keys=("outcome",))\n'
                      'Histogram(name="ditserve_stage_seconds", boundaries=[1.0])\n')
    exported = defined_metrics(source)
    assert exported == {"ray_ditserve_video_jobs_finished_total", "ray_ditserve_stage_seconds_bucket",
                        "ray_ditserve_stage_seconds_sum", "ray_ditserve_stage_seconds_count"}
    queries = [("panel 'outcomes'", 'sum by (outcome) (rate(ray_ditserve_video_jobs_finished_total[5m]))'),
               ("panel 'typo'", 'rate(ray_ditserve_video_job_finished_total[5m])'),
               ("panel 'stage'",
                'rate(ray_ditserve_stage_seconds_total[5m]) / rate(ray_ditserve_stage_seconds_count[5m])')]
    assert unexported(queries, exported) == {"panel 'typo'": ["ray_ditserve_video_job_finished_total"],
                                             "panel 'stage'": ["ray_ditserve_stage_seconds_total"]}


@pytest.mark.parametrize("series", [
    "ray_ditserve_plans_total",  # plan lookups by tier
    "ray_ditserve_rebuild_seconds_bucket",
    "ray_ditserve_denoise_seconds_per_forward_bucket",
    "ray_ditserve_stage_seconds_sum",
    "ray_ditserve_ongoing_requests",  # queue length, as the worker replicas hold it
    "ray_serve_deployment_queued_queries",
    "ray_ditserve_requests_total",  # outcomes
    "ray_ditserve_offload_copied_bytes_total",
    "ray_node_gpus_utilization",  # Ray's own, from the dashboard agent of each node
    "ray_ditserve_video_jobs_queued",  # the video job queue's length
    "ray_ditserve_pending_generations",  # the ingress's admission bound
    "ray_ditserve_retry_after_responses_total",
    "ray_ditserve_video_jobs_finished_total",  # job outcomes
    "ray_ditserve_video_jobs_created_total",
])
def test_the_dashboard_shows_what_an_operator_opens_it_for(series):
    queried = set().union(*(promql_metrics(expr) for _, expr in dashboard_queries()))
    assert series in queried


def test_every_panel_reads_the_chosen_prometheus_and_has_a_unique_id():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
