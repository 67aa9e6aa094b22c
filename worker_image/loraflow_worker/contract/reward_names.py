"""How a GRPO reward (and a GRPO run's tools file and environment) is named, read the same way by the contract, the
control plane and the worker.

Three forms (see `contract.RewardSpec.name`):

- a built-in: `numeric_match`, ... (`BUILTIN_REWARD_PARAMS`);
- a module reward: `package.module:function`, importable on the worker (e.g. from `extra_packages`);
- a reward file: `path/to/file.py:function`, a file beside the run that the control plane uploads to the run's
  artifact store (`RewardSpec.store_path`) and the worker imports from there.

Standard library only: the contract imports it, and the control plane imports the contract without the
training stack.
"""

from __future__ import annotations

import re
from typing import Literal

BUILTIN_REWARD_PARAMS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "exact_match": (("column",), ("pattern",)),
    "normalized_match": (("column",), ("pattern",)),
    "numeric_match": (("column",), ("pattern", "tolerance")),
    "format": (("pattern",), ()),
    "length_penalty": (("target_length",), ()),
    "digit_fraction": ((), ()),
}
"""The worker's built-in rewards (`loraflow_worker.training.rewards`): name -> (required, optional) parameters."""

REWARD_STORE_PATH_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9_][A-Za-z0-9._-]*)*\.py$"
"""A reward file's path inside the artifact store: relative, plain characters, no `..` (no segment starts
with a dot), ending in `.py`."""

TOOLS_FILE_PATTERN = r"^.*\S\.py$"
"""A tools file's name (`grpo.tools`): a path ending in `.py`."""

ENVIRONMENT_NAME_PATTERN = r"^.*\S\.py:[A-Za-z_][A-Za-z0-9_]*$"
"""An environment's name (`grpo.environment`): `path/to/file.py:ClassName`."""

ENVIRONMENT_HOOKS = ("reset", "get_reward")
"""An environment's methods TRL calls itself (TRL 1.16 `GRPOTrainer.__init__`): never tools, though public."""

_MODULE_REWARD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")
# The path may hold anything a file name can (a Windows drive's colon too): the function is after the last colon.
_FILE_REWARD = re.compile(r"^(?P<path>.*\S\.py):(?P<function>[A-Za-z_][A-Za-z0-9_]*)$")

RewardKind = Literal["builtin", "module", "file", "unknown"]


def reward_kind(name: str) -> RewardKind:
    """Which form `name` has. A name whose part before the colon ends in `.py` is a file (`rewards.py:score`),
    never the module `py` of a package `rewards`."""
    if name in BUILTIN_REWARD_PARAMS:
        return "builtin"
    if _FILE_REWARD.match(name):
        return "file"
    if _MODULE_REWARD.match(name):
        return "module"
    return "unknown"


def split_file_reward(name: str) -> tuple[str, str]:
    """(file path, function name) of a reward file's name `path/to/file.py:function`."""
    match = _FILE_REWARD.match(name)
    if match is None:
        raise ValueError(f"`{name}` is not a reward file's name: use `path/to/file.py:function`")
    return match["path"], match["function"]
