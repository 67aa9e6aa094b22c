"""The key that fingerprints a namespace's secret values in their RunPod names (`tasks/runpod/secrets.py`), and the
run's checkpoint key derived from it (`run_checkpoint_key`).

A secret's name carries a fingerprint of its value so that two values are two secrets. A plain hash of the value
would let anyone who can list the account's secrets test a guess of a teammate's token against the name; an HMAC
keyed with a key they do not have cannot be tested. The key lives in the Prefect Secret block
`loraflow-secret-key-<namespace>`, made once with 32 random bytes and never replaced: a new key would name every
value's secret anew (the old ones would only be pruned once unused, as any unused secret is).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from tasks.settings import KEY_BLOCK_PREFIX, read_once_per_run

KEY_BYTES = 32
"""The random bytes of a key made here (stored as 64 hex digits): SHA-256's output length, the key length RFC 2104
asks of an HMAC."""
MIN_KEY_CHARS = 32
"""The shortest key a block may hold: one that an operator wrote by hand must still be beyond guessing."""


def key_block_name(namespace: str) -> str:
    """The Prefect Secret block that holds `namespace`'s key."""
    return f"{KEY_BLOCK_PREFIX}{namespace}"


def secret_name_key(namespace: str) -> bytes:
    """The key of `namespace`'s secret names, from its Prefect Secret block, created with a random key when missing
    (never overwritten: when two processes race to create it, both read back the winner). RuntimeError naming the
    block and the fix when it holds no usable key."""
    name = key_block_name(namespace)
    return read_once_per_run(f"block {name}", lambda: _read_or_make_key(name))


def _read_or_make_key(name: str) -> bytes:
    from prefect.blocks.system import Secret
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    try:
        block = Secret.load(name)
    except ValueError as e:
        if not isinstance(e.__cause__, ObjectNotFound):
            raise
        try:
            Secret(value=secrets.token_hex(KEY_BYTES)).save(name)
        except ValueError as exists:
            if not isinstance(exists.__cause__, ObjectAlreadyExists):
                raise
            # another process created it first: use theirs
        block = Secret.load(name)
    key = block.get()
    if not isinstance(key, str) or len(key) < MIN_KEY_CHARS:
        held = f"a JSON {type(key).__name__}" if not isinstance(key, str) else f"{len(key)} characters"
        raise RuntimeError(
            f"the Prefect Secret block {name!r} must hold a key of at least {MIN_KEY_CHARS} characters (it holds "
            f"{held}): delete the block and loraflow makes a new random one (existing secrets get new names; the old "
            "ones are pruned once unused)"
        )
    return key.encode()


def run_checkpoint_key(namespace_key: bytes, run_id: str) -> str:
    """The run's checkpoint key (`JobInput.checkpoint_key`, 64 hex digits): the same for every attempt of the run and
    every retry of its flow run, another for every other run, and none that someone who can merely write the store
    could make. The worker signs its record of each checkpoint with it and resumes only from one it signed."""
    return hmac.new(namespace_key, b"loraflow checkpoint key\0" + run_id.encode(), hashlib.sha256).hexdigest()
