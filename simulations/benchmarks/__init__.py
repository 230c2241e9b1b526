"""Benchmarks: speed and accuracy, side by side in one run."""
