"""What ships is what is tested, for the control plane too: `.venv` and the control-plane image install exactly
`requirements.lock` (`make lock` writes it from pyproject.toml and worker_image's core).

The lock cannot be compiled here (that needs the index), so these tests hold it against what the requirements
need, read from the installed packages' metadata: a dependency added to pyproject.toml without `make lock` is
installed unpinned, one removed leaves a pin nothing needs, and either fails here.
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements.lock"
ROOT, ROOT_EXTRAS = "loraflow", ("local", "test")
OURS = {"loraflow", "loraflow-worker"}
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)\s*(?:;\s*(.+))?$")


def locked_here() -> dict[str, str]:
    """name -> version of every pin of the lock whose marker holds on this interpreter and platform."""
    pins = {}
    for line in LOCK.read_text().splitlines():
        if (m := _PIN.match(line)) and (m.group(3) is None or Marker(m.group(3)).evaluate()):
            pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


def required_closure() -> set[str]:
    """Every distribution loraflow[local,test] needs on this interpreter, from the installed metadata."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(ROOT, frozenset(ROOT_EXTRAS))]
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        for text in metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker is None or any(requirement.marker.evaluate({"extra": e}) for e in extras or {""}):
                todo.append((canonicalize_name(requirement.name), frozenset(requirement.extras)))
    return {name for name, _ in seen}


def test_the_lock_pins_exactly_what_the_control_plane_requires():
    required, locked = required_closure() - OURS, set(locked_here())
    assert not required - locked, f"required but not in requirements.lock (run `make lock`): {sorted(required - locked)}"
    assert not locked - required, f"in requirements.lock but required by nothing (run `make lock`): {sorted(locked - required)}"


def test_this_environment_has_the_locked_versions():
    differing = {name: (metadata.version(name), version) for name, version in locked_here().items()
                 if metadata.version(name) != version}
    assert not differing, f"installed vs requirements.lock (run `make install`): {differing}"


def test_the_lock_says_how_it_is_made_and_leaves_our_own_projects_out():
    text = LOCK.read_text()
    assert "#    make lock" in text
    assert not {canonicalize_name(m.group(1)) for line in text.splitlines() if (m := _PIN.match(line))} & OURS
