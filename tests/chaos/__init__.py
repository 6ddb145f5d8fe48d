"""Reliability tests: the worker under injected network and server faults."""
