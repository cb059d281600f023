"""``LLM.generate`` takes vLLM's ``include_stop_str_in_output``, as README's Python API
section says ``SamplingParams`` takes the HTTP API's fields: the text keeps the stop
string that ended it; the token ids are the same either way."""
from __future__ import annotations

import pytest

from ppspec import LLM, SamplingParams
from ppspec.router.types import InvalidRequestError


def test_include_stop_str_in_output_keeps_the_stop_string():
    llm = LLM()  # the demo model, one stage
    try:
        free = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=24))[0]
        text = free.text
        assert len(text) > 12, text
        stop = text[6:10]  # a stop string from the middle of the greedy text
        cut = text.index(stop)
        excl, incl = (llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                                              include_stop_str_in_output=include))[0]
                      for include in (False, True))
        assert excl.text == text[:cut]
        assert incl.text == text[:cut] + stop
        assert incl.token_ids == excl.token_ids and excl.token_ids == free.token_ids[:len(excl.token_ids)]
        assert excl.finish_reason == incl.finish_reason == "stop" and incl.stop_reason == stop
    finally:
        llm.close()


def test_include_stop_str_in_output_must_be_a_bool():
    with pytest.raises(InvalidRequestError, match="include_stop_str_in_output must be a bool"):
        SamplingParams(include_stop_str_in_output="yes").validate()
