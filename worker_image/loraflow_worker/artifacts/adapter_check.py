"""Check the promise of a run: its adapter loads with PEFT on its base model and changes the model's output.

    python -m loraflow_worker.artifacts.adapter_check BASE_MODEL_DIR ADAPTER_DIR

Prints one JSON line, `{"loads": true, "changes_output": true, "max_abs_logit_change": 0.81, "vocab_size": 512}`,
and exits 0; when the adapter does not load it prints the error and exits 1. It runs in the worker's
environment (the control plane has no training stack): the local demo, the end-to-end tests and the chaos
benchmark call it there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROBE_TOKEN_IDS = [[1, 2, 3, 4, 5]]
CHANGE_ATOL = 1e-4
"""Logits within this of the base model's count as unchanged (float32 noise is far smaller)."""


def check_adapter(base_model: Path, adapter_dir: Path) -> dict[str, object]:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_model)
    ids = torch.tensor(PROBE_TOKEN_IDS)
    with torch.no_grad():
        before = base(ids).logits.clone()
        after = PeftModel.from_pretrained(base, adapter_dir)(ids).logits
    change = (after - before).abs().max().item()
    return {"loads": True, "changes_output": change > CHANGE_ATOL, "max_abs_logit_change": change,
            "vocab_size": after.shape[-1]}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    try:
        report = check_adapter(Path(args[0]), Path(args[1]))
    except Exception as exc:  # noqa: BLE001 - any failure to load is the answer, reported in one line
        print(json.dumps({"loads": False, "error": f"{type(exc).__name__}: {exc}"}))
        return 1
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
