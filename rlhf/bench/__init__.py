"""Benchmarks behind `rlhf bench NAME`: each prints JSON lines of measured figures."""
