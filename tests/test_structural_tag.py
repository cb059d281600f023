"""vLLM's ``structural_tag`` (``structured_outputs.structural_tag`` and ``response_format``
``{"type": "structural_tag"}``) through xgrammar's structural tags (``router/structured.py``):
the output is the tag, JSON following the schema inside it, the end; greedy tokens the same
with speculation as without; a malformed tag is a 400 naming the field."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from ppspec.router.llm import DEMO_MODEL, LLM
from ppspec.router.protocol import CompletionRequest
from ppspec.router.structured import request_grammar
from ppspec.router.types import InvalidRequestError, SamplingParams

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
TAG = {"type": "structural_tag",
       "format": {"type": "tag", "begin": "<r>", "content": {"type": "json_schema", "json_schema": SCHEMA}, "end": "</r>"}}


@pytest.mark.parametrize("body", [
    dict(structured_outputs={"structural_tag": json.dumps(TAG)}),
    dict(response_format={"type": "structural_tag", "format": TAG["format"]}),
], ids=["structured_outputs", "response_format"])
def test_structural_tag_output_follows_it_with_and_without_speculation(body):
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    g = request_grammar(CompletionRequest(prompt="x", **body))
    p = SamplingParams(temperature=0, max_tokens=40, grammar=g)
    prompt = [tok.encode("Where to?")]
    outs = [LLM(DEMO_MODEL, max_rows=2, **kw).generate(prompt, p)[0]
            for kw in ({}, dict(speculative_algorithm="ngram"))]
    assert outs[0].token_ids == outs[1].token_ids and outs[0].finish_reason == "stop"
    text = tok.decode(outs[0].token_ids, skip_special_tokens=True)
    assert text.startswith("<r>") and text.endswith("</r>"), text
    jsonschema.validate(json.loads(text[3:-4]), SCHEMA)


def test_legacy_structural_tag_and_bad_tags():
    legacy = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
              "triggers": ["<f"]}
    assert request_grammar(CompletionRequest(prompt="x", response_format=legacy))
    for body, param in ((dict(structured_outputs={"structural_tag": "{not json"}), "structured_outputs"),
                        (dict(structured_outputs={"structural_tag": {"type": "structural_tag",
                                                                     "format": {"type": "nonsense"}}}),
                         "structured_outputs"),
                        (dict(response_format={"type": "structural_tag", "format": {
                            "type": "tag", "begin": "<a>", "end": "</a>",
                            "content": {"type": "json_schema", "json_schema": {"not": {"type": "string"}}}}}),
                         "response_format")):
        with pytest.raises(InvalidRequestError) as e:
            request_grammar(CompletionRequest(prompt="x", **body))
        assert e.value.param == param
