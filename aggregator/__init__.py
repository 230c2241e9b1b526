"""Aggregator service: ingests perturbed reports and publishes debiased estimates."""
