"""The chaos catalogue: each fault kind loraflow must survive, how to inject it into one run, and what
that run must end as. Shared by the short chaos test (`tests/test_chaos_e2e.py`) and the long
benchmark (`bench/chaos.py`); `bench/chaos_lib.py` runs and checks them.

A scenario's faults are scoped to its own run by endpoint name (`loraflow-<run name>-`), so many
scenarios can run at once; only `list_endpoints` names no endpoint, so its faults hit whichever run
lists next (every run tolerates them the same way).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

OUT_OF_STOCK_POOL = "ADA_32_PRO"
"""The RTX 5090's pool, kept out of stock while a no-capacity scenario runs. Only that scenario asks for
it (first on its list), so no other run waits on it."""

FAULT_INJECTION_DIR = Path(__file__).resolve().parent.parent / "worker_image" / "tests" / "fault_injection"
"""The worker tests' fault module (its `sitecustomize`): on a worker's PYTHONPATH, it fails the training
process as `CRASH_AT_STEP` and `CRASH_KIND` say. The image ships no such switch."""
CRASH_AT_STEP = "LORAFLOW_TEST_CRASH_AT_STEP"
CRASH_KIND = "LORAFLOW_TEST_CRASH_KIND"
STEP_SECONDS = "LORAFLOW_TEST_STEP_SECONDS"
RACE_WINDOW_S = 8
"""How long the volume race's billing read is held: the window in which the attaching endpoint is made."""


def route(route_name: str, action: str, **rule: Any) -> dict[str, Any]:
    """A `POST /_localpod/faults` body, without its endpoint scope (added per run)."""
    return {"route": route_name, "action": action, **rule}


def worker(action: str, **rule: Any) -> dict[str, Any]:
    """A `POST /_localpod/worker-faults` body, without its endpoint scope (added per run)."""
    return {"action": action, **rule}


def training_fault(kind: str, at_step: int, times: int = 1) -> dict[str, Any]:
    """A worker fault that fails the training process at the end of step `at_step`, as `kind` says (kill,
    oom, error, hang, ...): the next `times` workers started get the fault module on their PYTHONPATH, and the
    switches."""
    return worker("env", env={"PYTHONPATH": str(FAULT_INJECTION_DIR), CRASH_AT_STEP: str(at_step), CRASH_KIND: kind},
                  times=times)


@dataclass(frozen=True)
class Scenario:
    """One run with faults, and what must be true of it afterwards."""

    kind: str
    """Short name, part of the run name: lowercase letters, digits, dashes."""
    summary: str
    expect_state: Literal["COMPLETED", "FAILED"] = "COMPLETED"
    retried: tuple[str, ...] = ()
    """Outcome kinds of the attempts given up before the last one, in order (the flow logs
    `Attempt N ended <kind>`); () means the run finished on its first attempt."""
    route_faults: tuple[dict[str, Any], ...] = ()
    route_faults_at_step: int | None = None
    """Add `route_faults` only once the first attempt's job reports this training step, not before the run starts:
    for a fault that must meet the job in a given state (training)."""
    worker_faults: tuple[dict[str, Any], ...] = ()
    gpus: tuple[str, ...] = ("RTX 4090",)
    final_gpu: str | None = None
    """The GPU of the last attempt, when the faults must move the run (no capacity, out of memory)."""
    may_adopt: bool = False
    """The last attempt given up may still have stored complete results (`DONE`), which the flow then
    adopts instead of starting another attempt."""
    failure_text: tuple[str, ...] = ()
    """Substrings the FAILED state's message must hold: the real reason."""
    log_says: tuple[str, ...] = ()
    """Substrings the flow run's log must hold (each in some message): what the run must have said it did."""
    log_never_says: tuple[str, ...] = ()
    """Substrings no message of the flow run's log may hold: a wrong reading the faults could cause."""
    out_of_stock: str | None = None
    """A GPU pool that must be out of stock while this runs."""
    broken_model: bool = False
    """Train a folder that holds no model: the worker's code fails."""
    checkpoint_every_steps: int | None = None
    resumes: bool = False
    """The last attempt must resume from a stored checkpoint."""
    queue_minutes: float = 20
    startup_minutes: float = 30
    stall_minutes: float = 15
    delete_endpoint_at_step: int | None = None
    """Delete the first attempt's endpoint through RunPod's API once its job reports this training step, as a
    person in RunPod's console, a teammate's script or RunPod itself could."""
    tight_reconcile_at_step: int | None = None
    """Run the reconcile flow with `tight_reconcile_minutes` once the first attempt's job reports this training
    step: it must be refused, naming the setting and the heartbeat, and delete nothing."""
    tight_reconcile_minutes: float = 0.5
    flow: Literal["train", "preload", "volumes", "serve", "study"] = "train"
    """The flow the scenario runs: a train run, a preload sweep of a Hub model (`preload_data_centers`), the
    volumes flow's retention (`race_data_center`), a serve of the tiny model and one adapter on localpod's vLLM
    stand-in (`bench/chaos_serve.py`), or a study of deployment children whose process is killed and which is
    resumed (`bench/chaos_study.py`)."""
    preload_data_centers: tuple[str, ...] = ()
    stale_warm_record: str | None = None
    """A datacenter whose weight-cache record says the run's model is warm on a network volume that was deleted
    behind it (by hand, in RunPod's console): the run must go cold, complete, and clear the record."""
    own_token: bool = False
    """Start the run with a Hub token of its own (`HF_TOKEN` of its flow process), while the batch's other runs
    carry the stack's: every worker of this run must boot with this run's token, never another's."""
    requeues: int = 0
    """Times the job must go back to RunPod's queue after it started (its worker lost) and be taken by another
    worker of the same endpoint, the run waiting on the same attempt. With `resumes`, every worker after the first
    must resume from the checkpoint (or return the stored results), never train from the start again: one training
    per store."""
    serve_hours: float = 0.2
    """flow `serve`: the serve's `hours` (its endpoint's expiry, from the start of the serve)."""
    delete_while_serving: bool = False
    """flow `serve`: delete the serve's endpoint through RunPod's API once the serve has said it answers (its OpenAI
    base URL), as a teammate in RunPod's console could."""
    reconcile_while_serving: bool = False
    """flow `serve`: run the reconcile flow (its default policy, any age) once the serve has said it answers: it must
    keep the endpoint, its expiry not reached, and say until when it serves."""
    kill_while_serving: bool = False
    """flow `serve`: SIGKILL the serve's process once it has said it answers (the kernel's OOM killer, a `kill -9`: no
    teardown, no hook),
    then run the reconcile flow (its default policy, any age) at once, which must keep the endpoint, and again once
    the expiry in its name has passed, by when the endpoint must be deleted (by that reconcile, or the team's
    reconcile deployment before it), never before its expiry. The run ends Crashed (the team setup's zombie
    automation; without it, the harness marks it so once it has judged the endpoint)."""
    serve_ends: str | None = None
    """flow `serve`: how the serve's watch must say it ended (`Serving ends: <this>...`), when it must reach it."""
    race_data_center: str | None = None
    """flow `volumes`: a datacenter where the scenario makes this control plane's volume, unused for a month by its
    weight-cache record, then attaches it to a new endpoint while the volumes flow reads billing (its hang fault),
    after the inventory listed the endpoints and before the delete: the volume must be kept, reported as attached,
    and nothing lost."""


SCENARIOS: dict[str, Scenario] = {
    s.kind: s
    for s in (
        Scenario(
            "clean", "no fault: the baseline run",
        ),
        Scenario(
            "api-faults",
            "429 (with Retry-After), 500 and dropped connections on create, get, delete and list, and dropped or "
            "slow status polls: task retries and the watch loop absorb them, one attempt",
            route_faults=(
                route("create_endpoint", "status_429", retry_after_s=1),
                route("create_endpoint", "drop"),
                route("get_endpoint", "status_500"),
                route("delete_endpoint", "status_429"),
                route("delete_endpoint", "drop"),
                route("list_endpoints", "status_500"),
                route("list_endpoints", "drop"),
                route("status", "drop", times=2),
                route("status", "hang", hang_s=3),
            ),
        ),
        Scenario(
            "api-storm",
            "a storm on one run: about a third of its status polls answer 429 (Retry-After 1 s), 500 or drop and "
            "a fifth of the rest answer a second late, half its /health reads fail, and its create, get and delete calls fail twice each: one attempt, the storm "
            "absorbed by the watch loop's time budget and the tasks' retries",
            route_faults=(
                route("status", "status_429", retry_after_s=1, probability=0.15, seed=11),
                route("status", "status_500", probability=0.12, seed=12),
                route("status", "drop", probability=0.08, seed=13),
                route("status", "hang", hang_s=1, probability=0.2, seed=14),
                route("health", "status_500", probability=0.5, seed=15),
                route("create_endpoint", "status_500", times=2),
                route("get_endpoint", "status_429", retry_after_s=1, times=2),
                route("delete_endpoint", "drop", times=2),
            ),
        ),
        Scenario(
            "ambiguous-create",
            "create answers 500 after making the endpoint: found by name, exactly one endpoint, one attempt",
            route_faults=(route("create_endpoint", "act_then_500"),),
        ),
        Scenario(
            "run-500", "`/run` answers 500: not retried blindly; the endpoint is given up for a new attempt",
            retried=("submit_failed",), route_faults=(route("run", "status_500"),),
        ),
        Scenario(
            "run-act-500", "`/run` queues the job, then answers 500: that endpoint and its job are deleted, a new attempt",
            retried=("submit_failed",), route_faults=(route("run", "act_then_500"),),
        ),
        Scenario(
            "run-drop", "`/run`'s connection drops: whether a job started is unknown, so a new attempt",
            retried=("submit_failed",), route_faults=(route("run", "drop"),),
        ),
        Scenario(
            "worker-crash", "the worker dies mid-job without a result and RunPod fails its job (localpod's "
            "--dead-worker-jobs fail): worker_lost, retried on a new endpoint",
            retried=("worker_lost",), worker_faults=(worker("crash", dead_worker_jobs="fail"),),
        ),
        Scenario(
            "worker-crash-requeue",
            "the worker dies at training step 3, after the step-2 checkpoint, and RunPod hands its job to another "
            "worker (localpod's --dead-worker-jobs requeue): the run waits on the same endpoint and completes on its "
            "first attempt, the new worker resuming from the checkpoint: one training per store",
            # Steps of 2 s on the first worker only: step 3 is reported after the step-2 checkpoint was stored.
            worker_faults=(worker("crash", at_step=3, dead_worker_jobs="requeue"),
                           worker("env", env={"PYTHONPATH": str(FAULT_INJECTION_DIR), STEP_SECONDS: "2"})),
            checkpoint_every_steps=2, resumes=True, requeues=1,
        ),
        Scenario(
            "preempt", "the worker is killed and the job requeued (RunPod preempting the host): another worker of "
            "the same endpoint takes it, and the run completes on its first attempt",
            worker_faults=(worker("preempt"),), requeues=1,
        ),
        Scenario(
            "worker-hang", "the worker freezes (SIGSTOP) as the job starts: stalled after the startup allowance",
            # Two minutes: on a loaded 2-core machine a healthy worker takes about one to import the
            # training stack and reach its first step, and the next attempt must not look frozen too.
            retried=("stalled",), worker_faults=(worker("hang"),), startup_minutes=2, stall_minutes=1,
            # The training process runs in its own session, which SIGSTOP does not reach: it may finish and store
            # its results meanwhile, which the flow then adopts.
            may_adopt=True,
        ),
        Scenario(
            "stall-resume",
            "training hangs at step 3 after the step-2 checkpoint was stored: stalled, and the next attempt "
            "resumes from the checkpoint",
            retried=("stalled",), worker_faults=(training_fault("hang", at_step=3),),
            checkpoint_every_steps=2, resumes=True, stall_minutes=1,
        ),
        Scenario(
            "no-capacity",
            f"the first GPU's pool ({OUT_OF_STOCK_POOL}) is out of stock: no_capacity after the queue allowance, "
            "then the next GPU of the list",
            retried=("no_capacity",), gpus=("RTX 5090", "A100 SXM"), final_gpu="A100 SXM",
            out_of_stock=OUT_OF_STOCK_POOL, queue_minutes=1,  # the spec's minimum
        ),
        Scenario(
            "oom", "the worker reports CUDA out of memory: the same GPU again, with gradient checkpointing on and half "
            "the micro-batch (the out-of-memory ladder's first rung)",
            retried=("out_of_memory",), gpus=("RTX 4090", "A100 SXM"), final_gpu="RTX 4090",
            worker_faults=(training_fault("oom", at_step=1),),
        ),
        Scenario(
            "oom-twice", "out of memory again with checkpointing on and half the micro-batch: the ladder's next step "
            "is a GPU with more memory",
            retried=("out_of_memory", "out_of_memory"), gpus=("RTX 4090", "A100 SXM"), final_gpu="A100 SXM",
            worker_faults=(training_fault("oom", at_step=1, times=2),),
        ),
        Scenario(
            "oom-no-bigger", "out of memory on the largest GPU of the list, again after the ladder's first rung "
            "(checkpointing on, half the micro-batch): fails, saying what to change",
            expect_state="FAILED", gpus=("A100 SXM",), retried=("out_of_memory",),
            worker_faults=(training_fault("oom", at_step=1, times=2),),
            failure_text=("out_of_memory", "no GPU with more memory"),
        ),
        Scenario(
            "oom-cuda-error",
            "the training process prints `CUDA error: out of memory` and exits: out_of_memory (GPU) whatever the "
            "prefix, and on the largest GPU of the list the run fails saying what to change",
            expect_state="FAILED", gpus=("A100 SXM",), retried=("out_of_memory",),
            worker_faults=(training_fault("cuda-error-oom", at_step=0, times=2),),
            failure_text=("out_of_memory", "out of memory (GPU)", "CUDA error: out of memory", "no GPU with more memory"),
        ),
        Scenario(
            "oom-cublas", "cuBLAS cannot allocate its handle (CUBLAS_STATUS_ALLOC_FAILED): out of memory (GPU)",
            expect_state="FAILED", gpus=("A100 SXM",), retried=("out_of_memory",),
            worker_faults=(training_fault("cublas-alloc", at_step=0, times=2),),
            failure_text=("out_of_memory", "CUBLAS_STATUS_ALLOC_FAILED", "no GPU with more memory"),
        ),
        Scenario(
            "oom-vllm-kv", "vLLM finds no memory for its KV cache at start-up: out of memory (vLLM KV cache)",
            expect_state="FAILED", gpus=("A100 SXM",), retried=("out_of_memory",),
            worker_faults=(training_fault("vllm-kv-cache", at_step=0, times=2),),
            failure_text=("out_of_memory", "out of memory (vLLM KV cache)", "no GPU with more memory"),
        ),
        Scenario(
            "oom-host",
            "the kernel's OOM killer ends the training process (host RAM), twice: its own outcome, retried with half "
            "the micro-batch on the same GPU, never moved to a GPU with more memory, then the run fails naming host "
            "memory",
            expect_state="FAILED", gpus=("RTX 4090", "A100 SXM"), final_gpu="RTX 4090",
            retried=("host_out_of_memory",), worker_faults=(training_fault("oom-killer", at_step=0, times=2),),
            failure_text=("host_out_of_memory", "out of memory (host RAM)", "host's RAM"),
        ),
        Scenario(
            "cuda-unavailable",
            "CUDA does not start on the host (LORAFLOW_REQUIRE_CUDA=1 on a CPU): the worker trains nothing and fails "
            "at once; retried once on a new endpoint, then the run fails naming the driver",
            expect_state="FAILED", retried=("cuda_unavailable",),
            worker_faults=(worker("env", env={"LORAFLOW_REQUIRE_CUDA": "1"}, times=2),),
            failure_text=("cuda_unavailable", "CUDA unavailable", "driver"),
        ),
        Scenario(
            "endpoint-deleted",
            "the endpoint is deleted through RunPod's API mid-training: the attempt is lost, not the run, which "
            "completes on a new endpoint",
            # The first worker's steps last 2 s (progress is sent every 2 s): the deletion lands mid-training, after
            # the step-2 checkpoint was stored, and the deleted worker cannot finish in localpod's 5 s kill grace.
            retried=("lost",), checkpoint_every_steps=2, delete_endpoint_at_step=3, resumes=True,
            worker_faults=(worker("env", env={"PYTHONPATH": str(FAULT_INJECTION_DIR), STEP_SECONDS: "2"}),),
        ),
        Scenario(
            "tight-policy",
            "an operator runs reconcile with silent_after_minutes = 0.5 while the run trains, below 3 × the heartbeat "
            "intervals in force: the reconcile is refused naming both, deletes nothing, and the run completes on its "
            "first attempt",
            # Steps of 2 s: the job is still training when the reconcile flow has started and decided.
            tight_reconcile_at_step=1,
            worker_faults=(worker("env", env={"PYTHONPATH": str(FAULT_INJECTION_DIR), STEP_SECONDS: "2"}),),
        ),
        Scenario(
            "own-token",
            "a second person starts a run with their own Hub token while others run with the first's: the run's "
            "workers boot with its own token (one account secret per token, never rotated under a teammate)",
            own_token=True,
        ),
        Scenario(
            "volume-deleted",
            "the weight-cache record of EU-RO-1 names a network volume deleted by hand: the run goes cold at once "
            "(same attempt), completes, and the record is cleared; a record is a hint, never a requirement",
            stale_warm_record="EU-RO-1",
        ),
        Scenario(
            "volume-refused",
            "a preload sweep's volume create in US-CA-2 is refused (500, as RunPod was seen to answer in US-MO-1), "
            "every time: that datacenter is reported, the sweep fails after the others, nothing is rented there and "
            "no volume is left",
            flow="preload", expect_state="FAILED", preload_data_centers=("US-CA-2",),
            route_faults=(route("create_network_volume", "status_500", probability=1.0, times=50,
                                data_center_id="US-CA-2"),),
            failure_text=("US-CA-2",),
        ),
        Scenario(
            "volume-race",
            "an endpoint attaching this control plane's unused volume in EU-CZ-1 appears while the volumes flow reads "
            "billing, between the inventory and the delete (RunPod would delete an attached volume): the endpoints "
            "are listed again right before the delete, the volume is kept and reported as attached, nothing lost",
            flow="volumes", race_data_center="EU-CZ-1",
            route_faults=(route("network_volume_billing", "hang", hang_s=RACE_WINDOW_S),),
        ),
        Scenario(
            "unknown-status",
            "`/status` answers a status loraflow does not know (PAUSED; RUNNING, which RunPod's job-states page "
            "lists, is known) three times: logged once, treated as running, one attempt",
            route_faults=(route("status", "unknown_status", job_status="PAUSED", times=3),),
        ),
        Scenario(
            "quota-refusal-500",
            "the run's create is refused twice with the account's worker quota as REST v1 answered it (500, "
            "RunPod's text in `{\"error\": ...}`): recognised by its text, never retried as a server error; the run "
            "waits for room (15 s, then 30 s) and completes on its first attempt",
            # The text names no quota figure: a named figure is kept in a Prefect Variable for the preflight, which
            # the batch's other runs must not see changed by one scenario.
            route_faults=(route("create_endpoint", "answer", status_code=500, times=2, answer_body={
                "error": "create endpoint: graphql: Max workers across all endpoints must not exceed your workers "
                         "quota"}),),
            log_says=("Waiting 15 s for room in RunPod's worker quota (try 1)",
                      "Waiting 30 s for room in RunPod's worker quota (try 2)"),
        ),
        Scenario(
            "create-refused-400",
            "RunPod refuses the run's create on its first GPU class (A100 SXM) with 400: that class is skipped in the "
            "same attempt, never asked again, and the run completes on its second class (RTX 4090), first attempt",
            gpus=("A100 SXM", "RTX 4090"), final_gpu="RTX 4090",
            route_faults=(route("create_endpoint", "status_400"),),
            log_says=("RunPod refused the endpoint on A100 SXM; trying RTX 4090",),
        ),
        Scenario(
            "create-mismatch",
            "RunPod makes the run's endpoint unlike the request (workers.max 0, asked 1: no worker would ever take "
            "its job): the endpoint is deleted at once and the run fails naming the difference (the same request "
            "would be answered the same way); no endpoint left",
            # Fewer workers than asked, not more: with every run of a batch holding an endpoint, one more worker
            # could pass the account's quota and turn the fault into a quota wait.
            expect_state="FAILED", route_faults=(route("create_endpoint", "create_patched",
                                                       create_patch={"workers": {"max": 0}}),),
            failure_text=("unlike the request", "workers.max: asked 1, got 0"),
        ),
        Scenario(
            "running-status",
            "`/status` answers RUNNING (RunPod's job-states page lists it beside IN_PROGRESS) for three polls while the "
            "job trains: in progress, not unknown, no requeue counted; one attempt",
            # Added once the job reports training step 1 (steps of 2 s leave it running some ten polls more): a
            # RUNNING answered while the job is still queued, followed by the real IN_QUEUE, would read as a requeue.
            route_faults=(route("status", "unknown_status", job_status="RUNNING", times=3),),
            route_faults_at_step=1, log_never_says=("which loraflow does not know", "went back to RunPod's queue"),
            worker_faults=(worker("env", env={"PYTHONPATH": str(FAULT_INJECTION_DIR), STEP_SECONDS: "2"}),),
        ),
        Scenario(
            "health-partial",
            "the job reads as queued for its first 20 polls (about 40 s, so /health is read more than once) and "
            "/health answers as RunPod's official example, the workers' idle and running only: the run waits on, "
            "no diagnosis from the missing counters, and completes on its first attempt",
            # The IN_QUEUE answers come first, before any IN_PROGRESS: the run never sees the job go back to the
            # queue, so no requeue is counted.
            route_faults=(route("status", "unknown_status", job_status="IN_QUEUE", times=20),
                          route("health", "answer", status_code=200, times=10, answer_body={
                              "jobs": {"completed": 0, "failed": 0, "inProgress": 0, "inQueue": 1, "retried": 0},
                              "workers": {"idle": 0, "running": 0}})),
            log_never_says=("no stock", "image pull failing", "went back to RunPod's queue"),
        ),
        Scenario(
            "delete-outage",
            "every delete answers 500 for longer than the delete task's retries (6 times), after the job stored "
            "its results: the endpoint must still go, and the run complete",
            route_faults=(route("delete_endpoint", "status_500", times=6),),
        ),
        Scenario(
            "delete-act-500",
            "RunPod deletes the run's endpoint, then answers the delete with 500 (the answer lost after the act): the "
            "retried delete finds it gone, which is the delete done; the run completes on its first attempt",
            route_faults=(route("delete_endpoint", "act_then_500"),),
        ),
        Scenario(
            "status-429-burst",
            "five `/status` polls in a row answer 429 with Retry-After 2 s while the job trains: the watch waits as "
            "told, no attempt lost, the run completes on its first attempt",
            route_faults=(route("status", "status_429", retry_after_s=2, times=5),),
        ),
        Scenario(
            "serve-deleted",
            "a serving endpoint is deleted through RunPod's API (a teammate in the console) while its serve lives: "
            "the serve's watch notices at its next reading, says so, and ends; no endpoint, worker or slot left",
            flow="serve", delete_while_serving=True, serve_ends="the endpoint was deleted behind the serve",
        ),
        Scenario(
            "serve-crash",
            "every worker of a serving endpoint boots with MAX_LORA_RANK 4, below its adapter's rank 8: `vllm serve` "
            "dies while it starts and RunPod starts another, a crash loop; the serve ends at once (well within its "
            "10-minute allowance) naming the crash loop and MAX_LORA_RANK, its endpoint deleted, nothing left",
            flow="serve", expect_state="FAILED",
            # Every worker the scenario could start: localpod starts the next some 3 s after one dies (about 1 s in),
            # and the serve reads the workers every 5 s, so it may take ten crashes to see two; a worker booting
            # without the fault would serve, and the loop would not be one.
            worker_faults=(worker("env", env={"MAX_LORA_RANK": "4"}, times=100),),
            failure_text=("crash while they start", "MAX_LORA_RANK"),
        ),
        Scenario(
            "serve-expiry",
            "a serve of 0.06 hours (216 s): the reconcile flow run beside it while it serves keeps its endpoint "
            "(serving until its expiry), and at its expiry the serve deletes the endpoint and ends; nothing left",
            flow="serve", serve_hours=0.06, reconcile_while_serving=True, serve_ends="its time ran out",
        ),
        Scenario(
            "serve-lost",
            "a serve's process is SIGKILLed once it answers (no teardown, no hook): without a worker the reconcile keeps "
            "its endpoint until the expiry its name carries (0.05 hours, 180 s from the serve's start) and deletes it "
            "after, saying its time ran out; on a worker, which marks the run Crashed at once and runs its on_crashed "
            "hook, the hook deletes the endpoint; the serve's run ends Crashed, nothing left",
            flow="serve", serve_hours=0.05, kill_while_serving=True,
        ),
        Scenario(
            "serve-faults",
            "a serve's create answers 500 after making the endpoint, its first `/status` polls drop or answer 500, "
            "and its workers' listing fails: the endpoint found by name (exactly one), the readings retried or "
            "skipped, the serve answers and is deleted at its expiry",
            flow="serve", serve_hours=0.05, serve_ends="its time ran out",
            route_faults=(route("create_endpoint", "act_then_500"), route("status", "drop", times=2),
                          route("status", "status_500", times=2), route("get_endpoint", "status_500"),
                          route("list_endpoint_workers", "status_500", times=3)),
        ),
        Scenario(
            "study-resume",
            "a study of three learning rates whose children are runs of a train deployment on the workers, one at a "
            "time: the first child's workers find no CUDA (it fails, at a cost), the study's process is SIGKILLed "
            "while the second trains (its host lost), and the study is resumed in its own flow run: the running child "
            "adopted, the failed one started again with its earlier cost counted, no child handed a run of other "
            "values, none trained twice, the study completes, nothing left",
            flow="study",
            # The first two workers of the study's endpoints (the first child's two attempts) boot without CUDA; every
            # worker's steps last 2 s, so that the kill meets the second child training.
            worker_faults=(worker("env", env={"LORAFLOW_REQUIRE_CUDA": "1"}, times=2),
                           worker("env", env={"PYTHONPATH": str(FAULT_INJECTION_DIR), STEP_SECONDS: "2"}, times=100)),
        ),
        Scenario(
            "code-failure", "the model folder holds no model: the worker's code fails, not retried, reason shown",
            expect_state="FAILED", broken_model=True, failure_text=("ValueError", "[failed: not retried]"),
        ),
    )
}

SHORT_FORM: tuple[str, ...] = (
    "api-faults", "ambiguous-create", "run-500", "worker-crash", "worker-crash-requeue", "preempt", "worker-hang",
    "stall-resume", "no-capacity", "oom", "oom-twice", "oom-cuda-error", "oom-cublas", "oom-vllm-kv", "oom-host",
    "cuda-unavailable", "endpoint-deleted", "unknown-status", "code-failure", "tight-policy", "own-token",
    "volume-deleted", "volume-refused", "volume-race", "quota-refusal-500", "create-refused-400", "create-mismatch",
    "running-status", "health-partial",
)
"""The scenarios the CI test runs, one run each: every fault kind of the issue, at the cost of about one
queue allowance (the no-capacity run) of wall time."""


UNSCOPED_ROUTES = frozenset({"list_endpoints", "create_network_volume", "list_network_volumes", "get_network_volume",
                             "patch_network_volume", "delete_network_volume", "network_volume_billing"})
"""Routes that name no endpoint: a rule on them stays global (a volume create's may name its datacenter)."""


def scoped(rule: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The rule limited to endpoints named with `prefix`; routes that name no endpoint stay global."""
    if rule.get("route") in UNSCOPED_ROUTES:
        return dict(rule)
    return {**rule, "endpoint_name_prefix": prefix}
