"""MTP accept length under structured output.

``python -m ppspec.bench.structured_accept`` runs ``--num-prompts`` chat prompts greedily
with MTP (``--num-steps`` drafts per round), each constrained to a JSON schema (the
router's ``response_format`` grammar), and the same prompts unconstrained; it prints the
mean accept length (tokens emitted per verify round, drafts accepted + 1) of each, and
checks that every constrained answer parses. The constrained run's accept length is what
masking the MTP drafts with the grammar (``stage_server/grammar.py``) is for.

On a GPU: ``python -m ppspec.bench.structured_accept --model CKPT --device cuda --dtype bfloat16``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

from ppspec.argtypes import positive_int

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24}, "hobbies": {"type": "array", "items": {"type": "string",
                                                                                       "maxLength": 16},
                                                             "maxItems": 3}},
    "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
TOPICS = ["a teacher", "a painter", "a sailor", "a chef", "a doctor", "a pilot", "a farmer", "a poet",
          "a student", "a baker", "a nurse", "a writer", "a singer", "a miner", "a judge", "a tailor"]


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from ppspec.router.llm import DEMO_MODEL, LLM
    from ppspec.router.protocol import ChatCompletionRequest
    from ppspec.router.structured import request_grammar
    from ppspec.router.types import SamplingParams

    ap = argparse.ArgumentParser(prog="python -m ppspec.bench.structured_accept", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEMO_MODEL)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-steps", type=positive_int, default=3, help="MTP drafts per round")
    ap.add_argument("--num-prompts", type=positive_int, default=8)
    ap.add_argument("--max-tokens", type=positive_int, default=96)
    args = ap.parse_args(argv)

    tok = AutoTokenizer.from_pretrained(args.model)
    msgs = [[{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON."}]
            for i in range(args.num_prompts)]
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False) for m in msgs]
    grammar = request_grammar(ChatCompletionRequest(messages=msgs[0], response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}))
    llm = LLM(args.model, speculative_algorithm="mtp", num_speculative_steps=args.num_steps, device=args.device,
              dtype=args.dtype, max_rows=max(2, args.num_prompts))
    print(f"| run | prompts | tokens | verify rounds | mean accept length |\n|---|---|---|---|---|")
    for name, g in (("json_schema", grammar), ("unconstrained", None)):
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, grammar=g))
        acc = [a for o in outs for a in o.accept_lengths]
        if g is not None:
            for o in outs:
                if o.finish_reason == "stop":
                    json.loads(tok.decode(o.token_ids, skip_special_tokens=True))
        print(f"| {name} | {len(outs)} | {sum(len(o.token_ids) for o in outs)} | {len(acc)} | "
              f"{statistics.fmean(acc):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
