"""After training, on the worker that trained: how the base and the kept adapter score. The run's task evaluations
(`evaluation.tasks`: each prompt answered by both and graded, `tasks`) and its benchmarks (`benchmarks`), in that
order (`after_training`)."""
