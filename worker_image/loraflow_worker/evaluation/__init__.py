"""After training, on the worker that trained: the run's task evaluations (`evaluation.tasks`), each prompt answered by
the base and by the kept adapter and graded, and where the run's benchmarks join them (`after_training`)."""
