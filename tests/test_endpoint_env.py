"""An endpoint's env, checked where it is built: only loraflow's own secret references reach an endpoint, whatever
a run's fields let through (RunPod replaces `{{ RUNPOD_SECRET_<name> }}` anywhere in a value when a worker boots)."""

from __future__ import annotations

import pytest

from tasks.lifecycle.worker_env import endpoint_env
from tasks.runpod.secrets import secret_reference

OURS = secret_reference("loraflow-hf-token-ab12cd-0123456789abcdef")


def test_plain_values_and_loraflows_own_references_make_the_env():
    assert endpoint_env({"HF_ENDPOINT": "https://hub.example", "JUDGE_URL": "https://judge.example"},
                        {"HF_TOKEN": OURS}) == {"HF_ENDPOINT": "https://hub.example",
                                                "JUDGE_URL": "https://judge.example", "HF_TOKEN": OURS}


@pytest.mark.parametrize("value", [OURS, f"Bearer {OURS}", "{{RUNPOD_SECRET_alice-token}}"])
def test_a_plain_value_holding_a_secret_reference_is_refused_naming_it(value):
    with pytest.raises(ValueError, match="worker.env.JUDGE_KEY"):
        endpoint_env({"JUDGE_KEY": value}, {})


@pytest.mark.parametrize("reference", ["{{ RUNPOD_SECRET_alice-token }}", f"x {OURS}", "plain"])
def test_a_reference_that_is_not_a_whole_reference_to_a_secret_loraflow_made_is_refused(reference):
    with pytest.raises(ValueError, match="HF_TOKEN is not one of loraflow's own secret references"):
        endpoint_env({}, {"HF_TOKEN": reference})
