"""Helpers for the lent GPU machine (the device tool): its shell drivers, the carry builder and
checker, and `collect.py`, which sorts what a call brought back into bench/results and runs/."""
