"""Benchmarks: what the serving path costs, and how the program scales with the fleet.

Run everything with ``python -m benchmarks`` (or ``make bench``); see README.md.
"""
