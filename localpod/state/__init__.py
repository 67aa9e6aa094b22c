"""The in-memory account of one localpod server: what it knows of its endpoints, jobs, workers and secrets.

- `records`: the records themselves (`EndpointRecord`, `JobRecord`, `WorkerRecord`, `SecretRecord`), and the ids
  (`new_id`) and timestamps (`iso`) RunPod gives them;
- `account`: `LocalpodState`, which holds them with the fault book, volumes and storage clock and makes every change
  of their states, and `get_state`, the routes' dependency on it.

Nothing here touches processes or sockets: the supervisor (`localpod.workers`) acts on what the state records.
"""
