"""Helpers shared by tests and benchmarks (timing, result files). Not used by the engine."""
