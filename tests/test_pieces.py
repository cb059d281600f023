"""``router/api/pieces.py``: a text's long pieces between added tokens encoded once. Whatever
the tokenizer, ``PieceCache.encode`` gives the ids of the whole text's encode (hits, misses,
tokenizers that do not encode piece by piece); and the HTTP server's chat rendering through
it gives the ids of ``apply_chat_template``."""
from __future__ import annotations

import asyncio
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ppspec.argtypes import DEMO_MODEL
from ppspec.router.api.pieces import PieceCache
from ppspec.router.api.tokenize import TokenizerPool

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
WORDS = ["the", "pipeline", "commits", " state", "of", "its", "micro-batch", "\n", "  ", "\t", "héllo", "naïve",
         "42", "3.14", "!", "?", "—", "日本", "emoji 🙂", "x", "don't", "we're"]


def random_text(rng: random.Random, n: int, specials: bool = True) -> str:
    out = []
    for _ in range(n):
        r = rng.random()
        if specials and r < 0.06:
            out.append(rng.choice(SPECIALS))
        else:
            out.append(rng.choice(WORDS) + (" " if rng.random() < 0.6 else ""))
    return "".join(out)


def trained(kind: str, rstrip: bool = False) -> PreTrainedTokenizerFast:
    """A small BPE tokenizer trained here: ``bytelevel`` (a prefix space added), or
    ``metaspace`` (sentencepiece-like, "▁" prepended to the first piece only), or ``lower``
    (a normalizer, and added tokens matched after it)."""
    from tokenizers import AddedToken

    tk = Tokenizer(models.BPE(unk_token="[UNK]" if kind != "bytelevel" else None))
    if kind == "bytelevel":
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tk.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tk.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tk.decoder = decoders.Metaspace(prepend_scheme="first")
        alphabet = []
        if kind == "lower":
            tk.normalizer = normalizers.Lowercase()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]"], initial_alphabet=alphabet)
    rng = random.Random(0)
    tk.train_from_iterator([random_text(rng, 200, specials=False) for _ in range(50)], trainer)
    tk.add_special_tokens([AddedToken(s, rstrip=rstrip, normalized=kind == "lower") for s in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=tk)


@pytest.fixture(scope="module")
def demo():
    return AutoTokenizer.from_pretrained(DEMO_MODEL)


@pytest.mark.parametrize("kind", ["demo", "bytelevel", "metaspace", "lower", "rstrip"])
def test_piecewise_encode_is_the_whole_encode(kind, demo):
    """Random texts with added tokens, their long pieces recurring (hits) or new (misses):
    always the whole text's ids. A tokenizer whose added tokens strip whitespace or are
    normalized is refused at start (it splits otherwise than at the tokens)."""
    tok = demo if kind == "demo" else trained("bytelevel" if kind == "rstrip" else kind, rstrip=kind == "rstrip")
    cache = PieceCache(tok, min_chars=40, check_every=1000)
    if kind in ("lower", "rstrip"):
        assert not cache.enabled and "strip" in cache.reason
    rng = random.Random(1)
    shared = [random_text(rng, 30, specials=False) for _ in range(4)]  # long pieces that recur
    for trial in range(120):
        parts = []
        for _ in range(rng.randint(1, 5)):
            parts.append(rng.choice(shared) if rng.random() < 0.6 else random_text(rng, rng.randint(0, 40)))
            parts.append(rng.choice(SPECIALS))
        text = rng.choice(["", " ", "\n", "x "]) + "".join(parts) + random_text(rng, rng.randint(0, 8))
        assert cache.encode(tok, text) == tok.encode(text, add_special_tokens=False), (kind, trial, text)
    if cache.enabled:
        assert cache.hits > 20 and cache.misses > 0


def test_a_conversations_next_turn_encodes_only_its_new_messages(demo):
    """Turn by turn, the earlier messages are hits and only the newest long ones are
    encoded (and kept); the ids are always the template's."""
    cache = PieceCache(demo, min_chars=40)
    rng = random.Random(4)
    msgs = [{"role": "system", "content": random_text(rng, 30, False)}]
    encoded: list[str] = []
    orig = demo.encode

    class Counting:  # the tokenizer, recording the texts it encodes
        def encode(self, text, add_special_tokens=True):
            encoded.append(text)
            return orig(text, add_special_tokens=add_special_tokens)

    for turn in range(4):
        msgs.append({"role": "user", "content": random_text(rng, 30, False)})
        text = demo.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        encoded.clear()
        assert cache.encode(Counting(), text) == demo.encode(text, add_special_tokens=False)
        if turn:  # the system prompt and earlier turns came from the cache
            assert all(m["content"] not in t for m in msgs[:-2] for t in encoded)
            assert any(msgs[-1]["content"] in t for t in encoded)
        msgs.append({"role": "assistant", "content": random_text(rng, 30, False)})
    assert cache.hits == 3 and cache.misses == 1


def test_a_difference_found_by_the_check_turns_the_cache_off(demo):
    cache = PieceCache(demo, min_chars=40, check_every=1)
    text = "<|im_start|>system\n" + "You are a careful assistant. " * 4 + "<|im_end|>\n<|im_start|>user\nHi"
    want = demo.encode(text, add_special_tokens=False)
    assert cache.encode(demo, text) == want and cache.misses == 1
    piece = next(iter(cache._lru))
    cache._lru[piece] = cache._lru[piece][:-1]  # a wrong cached piece
    assert cache.encode(demo, text) == want  # the check caught it: the whole encode
    assert not cache.enabled and "differed" in cache.reason
    assert cache.encode(demo, text) == want


def test_the_cache_stays_within_its_characters(demo):
    cache = PieceCache(demo, min_chars=40, max_chars=200)
    rng = random.Random(2)
    for _ in range(20):
        text = "<|im_start|>" + random_text(rng, 40, specials=False) + "<|im_end|>"
        assert cache.encode(demo, text) == demo.encode(text, add_special_tokens=False)
        assert cache._chars <= 200 and cache._chars == sum(map(len, cache._lru))


def test_chats_render_to_the_templates_ids_with_a_shared_system_prompt(demo):
    """The server's chat rendering (``TokenizerPool.render_chat``): a long system prompt
    shared by requests is a cache hit after the first, and every chat's ids are
    ``apply_chat_template``'s; a user who types an added token's text keeps it as text
    (the template's sanitizing path, no cache)."""
    pool = TokenizerPool(demo, workers=2)
    system = "You are the assistant of a serving system. Answer in full sentences.\n" * 40
    rng = random.Random(3)

    async def run():
        for q in range(6):
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": random_text(rng, 20, False)}]
            if q % 2:
                msgs += [{"role": "assistant", "content": random_text(rng, 10, False)},
                         {"role": "user", "content": "and then?"}]
            got = await pool.render_chat(msgs)
            assert got == demo.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False,
                                                   sanitize_control_tokens=True)
        typed = [{"role": "system", "content": system}, {"role": "user", "content": "say <|im_end|> please"}]
        got = await pool.render_chat(typed)
        want = demo.apply_chat_template(typed, add_generation_prompt=True, tokenize=True, return_dict=False,
                                        sanitize_control_tokens=True)
        assert got == want and want.count(demo.convert_tokens_to_ids("<|im_end|>")) == 2  # the typed one is text

    asyncio.run(run())
    assert pool.pieces.hits >= 5 and pool.pieces.misses == 1
    pool.executor.shutdown()
