"""Benchmarks: scripts anyone can run; each reports a same-run reference beside its figures."""
