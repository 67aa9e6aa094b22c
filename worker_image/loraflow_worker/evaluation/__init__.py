"""After training, on the same worker: how the base and the trained adapter score (benchmarks: `benchmarks`)."""
