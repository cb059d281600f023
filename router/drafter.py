"""N-gram (prompt lookup) drafter: the router owns it because it holds the token history.

For the last ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``) find their most
recent earlier occurrence in prompt + output and propose the tokens that followed it
(Saxena, "Prompt Lookup Decoding", 2023; vLLM's ``[ngram]`` speculative method).
"""
from __future__ import annotations


def ngram_draft(tokens: list[int], num_draft: int, min_ngram: int = 1, max_ngram: int = 4) -> list[int]:
    """Up to ``num_draft`` draft tokens for the sequence ``tokens`` (may be empty).

    Args:
        tokens: prompt + generated tokens so far (the last one is the input of the next round).
        num_draft: drafts wanted (tokens).
    """
    n_tok = len(tokens)
    if num_draft <= 0 or n_tok < 2:
        return []
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        tail = tokens[n_tok - n :]
        # latest match strictly before the tail itself
        for start in range(n_tok - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                follow = tokens[start + n : start + n + num_draft]
                if follow:
                    return follow
    return []
