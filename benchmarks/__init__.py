"""The benchmark suite behind `comera-compile bench`; installed as comera_compile.benchmarks.

Every figure is a median after warm-up, reported beside a baseline measured in the same run."""
