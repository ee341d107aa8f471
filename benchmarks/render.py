"""Build the benchmark pages' result tables from the results the scripts wrote (``benchmarks/results``).

    python benchmarks/render.py            # rewrite each marked block from its results file
    python benchmarks/render.py --check    # exit 1, naming the blocks that differ (a test runs this)

The pages are every ``benchmarks/*.md`` (``PAGES``): README.md and the pages it links. A block is
marked by its results file's name, optionally with the rows to show
(``where="header=value"``) and the columns (headers separated by " | "; all if not given)::

    <!-- results: coordinator_scale where="ranks=4" columns="variant | makers | ranks | items/s" -->
    (generated: provenance line, title, table)
    <!-- /results -->

Everything between the markers is replaced; the prose around them (what the figures mean, the
goals) is written by hand. Each script writes its file with ``_common.publish``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from _common import RESULTS, ROOT, table

README = ROOT / "benchmarks" / "README.md"
PAGES = sorted((ROOT / "benchmarks").glob("*.md"))
"""The pages with marked blocks: README.md, real-models.md and streaming.md."""
BLOCK = re.compile(r'(<!-- results: (?P<name>[\w.-]+)(?P<attrs>(?: \w+="[^"]*")*) -->\n)(?P<body>.*?)(<!-- /results -->)',
                   re.S)
ATTR = re.compile(r'(\w+)="([^"]*)"')


def provenance(record: dict) -> str:
    """One line: the command, when and where it ran, and the file the table comes from."""
    m = record["machine"]
    cpu = ", ".join([m["cpu"], *m.get("cpu_features", [])])  # files written before 2026-12-07 name no features
    where = f"{m['cores']} cores ({cpu}), load average {m['load_average_1m']:g} at the end"
    return (f"`{record['command']}`: {record['date']}, commit {record['commit']}, {where}; "
            f"`benchmarks/results/{record['benchmark']}.json`")


def block(record: dict, columns: list[str] | None = None, where: str | None = None) -> str:
    """The generated text between a block's markers: the table's ``columns`` (all if None) of the
    rows whose cell ``header=value`` of ``where`` holds that value (all if None)."""
    headers = record["headers"]
    columns = columns or headers
    key, _, value = (where or "").partition("=")
    missing = [c for c in columns + ([key] if where else []) if c not in headers]
    if missing:
        raise SystemExit(f"{record['benchmark']} has no columns {missing}; it has {headers}")
    keep = [headers.index(c) for c in columns]
    lines = [provenance(record) + (f". {record['title']}:" if record.get("title") else ""), ""]
    rows = [[row[i] for i in keep] for row in record["rows"] if not where or str(row[headers.index(key)]) == value]
    return "\n".join(lines + [table(columns, rows), ""]) + "\n"


def render(text: str, results: Path = RESULTS) -> tuple[str, list[str]]:
    """``text`` with every marked block rebuilt; the names of the blocks that changed. A block
    whose results file is missing is an error: the README would show a table nothing produced."""
    changed: list[str] = []

    def rebuild(match: re.Match) -> str:
        name = match["name"]
        path = results / f"{name}.json"
        if not path.exists():
            raise SystemExit(f"a page marks a block '{name}', but {path} does not exist: run the benchmark")
        attrs = dict(ATTR.findall(match["attrs"]))
        columns = [c.strip() for c in attrs["columns"].split(" | ")] if "columns" in attrs else None
        body = block(json.loads(path.read_text()), columns, attrs.get("where"))
        if body != match["body"]:
            changed.append(name)
        return match[1] + body + match[5]

    return BLOCK.sub(rebuild, text), changed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block differs from its results")
    args = parser.parse_args()
    differ = []
    for page in PAGES:
        new, changed = render(page.read_text())
        if args.check:
            differ += [f"{page.name}: {name}" for name in changed]
            continue
        page.write_text(new)
        print(f"{page.name}: rebuilt {len(changed)} block(s): {', '.join(changed) or 'none changed'}")
    if differ:
        print(f"the benchmark pages differ from benchmarks/results in: {', '.join(differ)}; "
              "run python benchmarks/render.py", file=sys.stderr)
        return 1
    return 0

if __name__ == "__main__":
    sys.exit(main())
