"""Ops of the compute core, one folder per op: a plain-torch reference (``naive.py``, the
CPU path and the oracle) beside the GPU kernel, behind one dispatch function.

This package imports nothing else of ppspec.
"""
