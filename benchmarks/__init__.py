"""Measurement scripts (not tests): hit-rate simulation and TTFT on a real model."""
