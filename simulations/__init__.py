"""Simulation and benchmark scripts for the mechanisms."""
