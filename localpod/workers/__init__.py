"""localpod's workers: the supervisor that starts each endpoint's worker processes when it has work and stops
them when idle, deleted or over time (`supervisor`, the app's one background task); the `docker run` command of
a worker container (`containers`); and a worker process as the operating system sees it, its signals, log tail
and death with localpod (`processes`). Routes never touch processes: they change the state
(`localpod.state`), and the supervisor acts on it at its next pass."""
