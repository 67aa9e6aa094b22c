"""The test suite's duration per test file, slowest first, from pytest's `--junitxml` reports.

    .venv/bin/python -m pytest tests -p no:cacheprovider --junitxml=cp.xml
    .venv-worker/bin/python -m pytest worker_image/tests -p no:cacheprovider --junitxml=worker.xml
    .venv/bin/python bench/junit_durations.py cp.xml worker_image/=worker.xml

`PREFIX=REPORT` puts PREFIX before the report's file names (they are relative to the folder pytest ran
from: the worker's suite runs from `worker_image/`). For each report: a Markdown table of its files (tests, seconds, share of the report's test time), slowest
first, under a line with the report's wall time. A file's seconds are the sum of its tests' setup, call and
teardown (what the report records per test: a module-scoped fixture's setup counts in its first test). When
the suite runs on several pytest-xdist workers, the files' seconds add up to more than the wall time: that
is the point of running them at once.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path


@dataclass
class FileTime:
    name: str
    tests: int = 0
    seconds: float = 0.0
    failed: int = 0


def read_report(path: Path, prefix: str = "") -> tuple[list[FileTime], float, int]:
    """(files slowest first, the report's wall time in seconds, tests that failed or errored)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    files: dict[str, FileTime] = defaultdict(lambda: FileTime(""))
    wall = 0.0
    failed = 0
    for suite in suites:
        wall += float(suite.get("time") or 0)
        for case in suite.iter("testcase"):
            name = prefix + module_of(case.get("classname") or "")
            entry = files[name]
            entry.name = name
            entry.tests += 1
            entry.seconds += float(case.get("time") or 0)
            if case.find("failure") is not None or case.find("error") is not None:
                entry.failed += 1
                failed += 1
    return sorted(files.values(), key=lambda f: (-f.seconds, f.name)), wall, failed


def module_of(classname: str) -> str:
    """`tests.test_x` or `tests.test_x.TestSomething` → `tests/test_x.py`."""
    parts = classname.split(".")
    while len(parts) > 1 and parts[-1][:1].isupper():
        parts.pop()
    return "/".join(parts) + ".py"


def table(files: list[FileTime]) -> str:
    total = sum(f.seconds for f in files) or 1.0
    lines = ["| file | tests | seconds | share |", "|---|---:|---:|---:|"]
    for f in files:
        failed = f" ({f.failed} failed)" if f.failed else ""
        lines.append(f"| `{f.name}` | {f.tests}{failed} | {f.seconds:.1f} | {100 * f.seconds / total:.1f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", metavar="[PREFIX=]REPORT", help="pytest --junitxml files")
    args = parser.parse_args(argv)
    for report in args.reports:
        prefix, _, name = report.rpartition("=")
        path = Path(name)
        files, wall, failed = read_report(path, prefix)
        tests = sum(f.tests for f in files)
        summed = sum(f.seconds for f in files)
        print(f"{path.name}: {tests} tests{f', {failed} failed' if failed else ''}; wall {wall:.0f} s, "
              f"test time {summed:.0f} s summed over {len(files)} files\n")
        print(table(files))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
