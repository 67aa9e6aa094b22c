"""Constants and helpers the worker tests share (a module of its own: `conftest` is a name both test
folders use, so tests cannot import from it reliably)."""

from __future__ import annotations

from pathlib import Path

PLANTED_SECRET = "hf_planted_secret_value_123"
"""Set as HF_TOKEN while jobs run: it must never show up in anything the worker stores or returns."""
BASE_TRAINING = {"max_steps": 50, "learning_rate": 1e-2, "batch_size": 8}


def stored_files_containing(root: Path, text: str) -> list[Path]:
    """Every file under `root` whose bytes contain `text`."""
    needle = text.encode()
    return [path for path in root.rglob("*") if path.is_file() and needle in path.read_bytes()]
