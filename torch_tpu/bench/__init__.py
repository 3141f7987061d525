"""Benchmarks that print figures (never timed assertions): ``python -m torch_tpu.bench dispatch``."""
