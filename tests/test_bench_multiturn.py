"""``ppspec bench --multi-turn`` against a stub chat server: each turn sends the chat so
far (the record's user messages and the server's own replies), and the hit rate is the
stub's reported cached tokens over its prompt tokens."""
import json

from test_bench import Serve

from ppspec.bench.cli import main as bench_main


class ChatStub:
    """Replies ``n`` words ``w<turn>`` per request; prompt tokens = words of all messages,
    cached = words of all but the last message."""

    def __init__(self):
        self.bodies = []

    async def __call__(self, scope, receive, send):
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break

        async def reply(status, ctype, payload):
            await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", ctype)]})
            await send({"type": "http.response.body", "body": payload})

        if scope["path"] == "/v1/models":
            return await reply(200, b"application/json", b'{"object": "list", "data": [{"id": "stub"}]}')
        req = json.loads(body)
        self.bodies.append(req)
        msgs = req["messages"]
        turn = sum(m["role"] == "user" for m in msgs) - 1
        words = [len(m["content"].split()) for m in msgs]
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(req["max_tokens"]):
            chunk = {"choices": [{"index": 0, "delta": {"content": f"w{turn} "}}]}
            await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(), "more_body": True})
        usage = {"prompt_tokens": sum(words), "completion_tokens": req["max_tokens"],
                 "prompt_tokens_details": {"cached_tokens": sum(words[:-1])}}
        await send({"type": "http.response.body", "body": f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                    "data: [DONE]\n\n".encode()})


def test_multi_turn_replays_the_chat_so_far(tmp_path):
    recs = [{"conversations": [x for t in range(3) for x in (
        {"from": "human", "value": " ".join(f"c{i}t{t}u{j}" for j in range(4 + t))},
        {"from": "gpt", "value": " ".join(["r"] * (5 + i))})]} for i in range(3)]
    recs.append({"conversations": [{"from": "human", "value": "one turn only"}, {"from": "gpt", "value": "a b c d"}]})
    data = tmp_path / "sg.json"
    data.write_text(json.dumps(recs))
    stub = ChatStub()
    out = tmp_path / "r.json"
    with Serve(stub) as s:
        rc = bench_main(["--base-url", s.url, "--dataset-path", str(data), "--multi-turn", "--num-prompts", "3",
                         "--max-turns", "2", "--max-concurrency", "2", "--output", str(out), "--no-progress",
                         "--save-detailed"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["mode"] == "multi-turn" and r["completed"] == 6 and r["failed"] == 0
    second = [b["messages"] for b in stub.bodies if len(b["messages"]) == 3]
    assert len(second) == 3
    for m in second:  # user, the server's reply to it, the record's next user message
        assert [x["role"] for x in m] == ["user", "assistant", "user"]
        assert m[1]["content"] == "w0 " * len(m[1]["content"].split())
        assert m[2]["content"].split()[0].endswith("t1u0")
    later = [t for t in r["turns"] if t["turn"] == 1]
    assert r["hit_rate_later_turns"] == sum(t["cached_tokens"] for t in later) / sum(t["prompt_tokens"] for t in later)
    assert 0 < r["hit_rate"] < r["hit_rate_later_turns"] < 1
    assert r["ttft_later_turns_ms"]["mean"] > 0


def test_shared_prefix_is_one_system_message(tmp_path):
    from test_bench import write_dataset

    data = write_dataset(tmp_path / "sg.json")
    stub = ChatStub()
    out = tmp_path / "r.json"
    with Serve(stub) as s:
        rc = bench_main(["--base-url", s.url, "--dataset-path", str(data), "--endpoint", "chat", "--num-prompts", "4",
                         "--shared-prefix-len", "40", "--output", str(out), "--no-progress", "--skip-test-request"])
    assert rc == 0 and json.loads(out.read_text())["completed"] == 4
    systems = {b["messages"][0]["content"] for b in stub.bodies}
    assert len(systems) == 1 and all(b["messages"][0]["role"] == "system" for b in stub.bodies)
    assert len(systems.pop().split()) == 40  # whitespace counting: the fewest words that make 40
    assert len({b["messages"][1]["content"] for b in stub.bodies}) == 4


def test_round_trip_tokens_come_back_through_the_chat_template():
    """``prefix_served --round-trip-tokens``: replies of the chosen word tokens, as text in
    the next turn's chat (transformers' tokenizer and chat template, not the bench's
    ``tokenizers`` check), re-tokenize to the ids generated; a token outside the set
    (a byte-level piece) is not chosen."""
    import random

    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from ppspec.bench.multiturn import round_trip_tokens
    from ppspec.router.llm import DEMO_MODEL

    ids = round_trip_tokens(Tokenizer.from_file(f"{DEMO_MODEL}/tokenizer.json"), vocab_size=32000)
    ref = AutoTokenizer.from_pretrained(DEMO_MODEL)
    assert len(ids) > 1000 and max(ids) < ref.vocab_size
    assert ref.encode("Hello world", add_special_tokens=False)[0] not in ids  # no leading space: not a word token
    rng = random.Random(1)
    for _ in range(20):
        reply = [rng.choice(ids) for _ in range(rng.randint(1, 48))]
        msgs = [{"role": "user", "content": "Say something."}]
        first = ref.encode(ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                           add_special_tokens=False)
        chat = msgs + [{"role": "assistant", "content": ref.decode(reply)}, {"role": "user", "content": "More."}]
        nxt = ref.encode(ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)
        assert nxt[: len(first) + len(reply)] == first + reply
