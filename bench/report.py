"""Result tables: one data model, three renderings (rich, Markdown, JSON).

A section returns ``Table`` objects; the runner prints them as they come and
writes all of them at the end, so JSON and Markdown always agree with what
was printed.
"""
from __future__ import annotations

import json
import platform
import subprocess
import sys
from typing import Any

import attrs


@attrs.define
class Table:
    key: str  # stable id for JSON consumers, e.g. "dispatch.plane"
    title: str
    columns: list[str]
    rows: list[list[Any]] = attrs.Factory(list)
    notes: list[str] = attrs.Factory(list)
    # Raw numbers behind the rendered cells (units in the names).
    data: list[dict[str, Any]] = attrs.Factory(list)

    def add(self, *cells: Any, **data: Any) -> None:
        self.rows.append(list(cells))
        if data:
            self.data.append(data)

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "title": self.title, "columns": self.columns,
                "rows": [[_plain(c) for c in r] for r in self.rows], "notes": self.notes, "data": self.data}


# The target summary: any section may return tables titled "targets: ..." with
# exactly these columns; the runner gathers their rows into one final table.
TARGETS_PREFIX = "targets:"
TARGET_COLUMNS = ["target", "measured", "goal", "met"]
TARGET_MET = ("YES", "NO")


def targets_table(key: str, title: str) -> Table:
    """An empty table of target rows for a section to fill (``add_target``)."""
    return Table(key, f"{TARGETS_PREFIX} {title}", list(TARGET_COLUMNS))


def add_target(t: Table, target: str, measured: str, goal: str, met: bool, **data: Any) -> None:
    t.add(target, measured, goal, "YES" if met else "NO", met=met, **data)


def is_targets(t: Table) -> bool:
    return t.title.startswith(TARGETS_PREFIX)


def collect_targets(tables: list[Table]) -> Table | None:
    """Every target row of ``tables``, in order, as the one "Targets" table
    (None when no section reported a target).  A targets table with other
    columns, or a met cell other than YES/NO, is a section's bug: raised."""
    found = [t for t in tables if is_targets(t)]
    if not found:
        return None
    out = Table("targets", "Targets", list(TARGET_COLUMNS))
    for t in found:
        if t.columns != TARGET_COLUMNS:
            raise ValueError(f"{t.key}: a targets table needs the columns {TARGET_COLUMNS}, has {t.columns}")
        for r in t.rows:
            if len(r) != len(TARGET_COLUMNS) or r[3] not in TARGET_MET:
                raise ValueError(f"{t.key}: target row {r!r} needs 4 cells, met one of {TARGET_MET}")
            out.rows.append(list(r))
        out.data += [dict(d, source=t.key) for d in t.data]
    met = sum(1 for r in out.rows if r[3] == "YES")
    out.notes.append(f"{met} of {len(out.rows)} targets met.")
    return out


def _plain(cell: Any) -> Any:
    return cell if isinstance(cell, (int, float, str, type(None))) else str(cell)


def cell(x: Any) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return fmt_num(x)
    return str(x)


def fmt_num(x: float) -> str:
    ax = abs(x)
    if ax == 0:
        return "0"
    if ax >= 1000:
        return f"{x:,.0f}"
    if ax >= 100:
        return f"{x:.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    if ax >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def ratio(a: float | None, b: float | None) -> str:
    """``a / b`` as "12.3x"; the caller words which way is faster."""
    if not a or not b:
        return "—"
    r = a / b
    return f"{r:.1f}x" if r >= 10 else f"{r:.2f}x"


def print_table(t: Table, console) -> None:
    from rich.markup import escape
    from rich.table import Table as RichTable

    rt = RichTable(title=t.title, title_justify="left", show_lines=False)
    for i, c in enumerate(t.columns):
        rt.add_column(c, justify="left" if i == 0 else "right")
    for r in t.rows:
        rt.add_row(*(escape(cell(c)) for c in r))
    console.print(rt)
    for n in t.notes:
        console.print(f"  [dim]{escape(n)}[/dim]", highlight=False)
    console.print()


def to_markdown(tables: list[Table], env: dict[str, Any]) -> str:
    out = ["# kvplane benchmarks", "", f"Machine: {env.get('cpu', '?')}, {env.get('cores', '?')} CPUs, "
           f"Python {env.get('python', '?')}; mode: {env.get('mode', '?')}.", ""]
    for t in tables:
        out += [f"## {t.title}", "", "| " + " | ".join(t.columns) + " |",
                "|" + "|".join(["---"] + ["---:"] * (len(t.columns) - 1)) + "|"]
        out += ["| " + " | ".join(cell(c).replace("|", "\\|") for c in r) + " |" for r in t.rows]
        if t.notes:
            out.append("")
            out += [f"- {n}" for n in t.notes]
        out.append("")
    return "\n".join(out)


def to_json(tables: list[Table], env: dict[str, Any]) -> str:
    return json.dumps({"env": env, "tables": [t.to_json() for t in tables]}, indent=2)


def environment(mode: str) -> dict[str, Any]:
    import os

    cpu = platform.processor() or "?"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {"python": sys.version.split()[0], "platform": platform.platform(), "cpu": cpu,
            "cores": os.cpu_count(), "mode": mode}
