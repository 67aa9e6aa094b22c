"""`bench/junit_durations.py`: the suite's duration per test file, slowest first, from pytest's junit reports."""

from __future__ import annotations

from pathlib import Path

from bench.junit_durations import main, read_report

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" tests="4" time="30.5">
<testcase classname="tests.test_fast" name="test_a" time="1.0" />
<testcase classname="tests.test_slow" name="test_b" time="20.0" />
<testcase classname="tests.test_slow.TestGroup" name="test_c" time="5.0"><failure message="x" /></testcase>
<testcase classname="tests.test_fast" name="test_d" time="2.0" />
</testsuite></testsuites>"""


def test_files_are_summed_over_their_tests_and_classes_and_listed_slowest_first(tmp_path: Path):
    (tmp_path / "r.xml").write_text(REPORT)
    files, wall, failed = read_report(tmp_path / "r.xml")
    assert [(f.name, f.tests, f.seconds, f.failed) for f in files] == [
        ("tests/test_slow.py", 2, 25.0, 1), ("tests/test_fast.py", 2, 3.0, 0)]
    assert (wall, failed) == (30.5, 1)


def test_a_prefix_names_the_files_of_a_suite_run_from_another_folder(tmp_path: Path, capsys):
    (tmp_path / "w.xml").write_text(REPORT)
    assert main([f"worker_image/={tmp_path / 'w.xml'}"]) == 0
    out = capsys.readouterr().out
    assert "w.xml: 4 tests, 1 failed; wall 30 s, test time 28 s summed over 2 files" in out
    assert out.index("`worker_image/tests/test_slow.py` | 2 (1 failed) | 25.0 | 89.3% |") < \
        out.index("`worker_image/tests/test_fast.py`")
