"""Kimi Delta Attention (channel-wise gated delta rule): chunked prefill, recurrent
decode/verify and replay at stable rows. Today only the plain-torch reference
(``naive.py``); the GPU path will be fla's KDA kernels for prefill and ours for verify /
replay, checked against it."""
from .naive import chunk_kda_ref, recurrent_kda_ref, replay_ref, verify_record_ref

__all__ = ["chunk_kda_ref", "recurrent_kda_ref", "replay_ref", "verify_record_ref"]
