"""Mamba2 (SSD) state-space scan: chunked prefill, recurrent decode/verify and replay at
stable rows. Today only the plain-torch reference (``naive.py``) exists; it is the oracle
the GPU kernels will be checked against."""
from .naive import chunk_scan_ref, discretize, gated_rms_norm_ref, recurrent_ref, replay_ref

__all__ = ["chunk_scan_ref", "discretize", "gated_rms_norm_ref", "recurrent_ref", "replay_ref"]
