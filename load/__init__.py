"""Load generation and benchmarks for Sluice."""
