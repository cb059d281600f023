"""Prefix caching served: stage processes with ``--prefix-cache-gb`` behind a router left at
its default, which turns caching on because every stage has a cache, as ``ppspec serve``
starts them (PP2, MTP). Multi-turn conversations give the tokens of PP1
without speculation or cache, ``usage.prompt_tokens_details.cached_tokens`` says what the
cache held, ``POST /v1/cache/flush`` (behind the API key) while a request runs changes no
token, the metrics count queried and hit tokens, and afterwards every stage holds no row,
page or snapshot."""
import threading

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from cluster import Cluster
from ppspec.router.llm import LLM
from ppspec.router.types import SamplingParams

pytestmark = pytest.mark.slow
KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(make_ckpt, tmp_path_factory):
    path = make_ckpt("qwen3_5_ratio2_7l")
    c = Cluster(path, 2, "mtp", max_rows=8, kv_tokens=4096, log_dir=str(tmp_path_factory.mktemp("logs")),
                stage_args=["--prefix-cache-gb", "0.01"],
                router_args=["--api-key", KEY, "--chunk-size", "16"]).start()
    yield path, c
    c.stop()


def complete(url, prompt, max_tokens):
    r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=120, json=dict(
        prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, return_token_ids=True))
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["token_ids"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_multi_turn_served_with_cache(served):
    path, c = served
    torch.set_num_threads(1)
    ref_llm = LLM(path, max_rows=4, chunk_size=16)
    system = list(range(40, 85))
    convs = [system + [200 + i, 201, 202] for i in range(3)]
    cached_sum = 0  # the responses' cached_tokens: the server's hit counter counts the same
    for turn in range(2):
        results = [None] * len(convs)

        def run(i):
            results[i] = complete(c.url, convs[i], 8)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(convs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ref = ref_llm.generate(convs, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert [ids for ids, _ in results] == [o.token_ids for o in ref]
        if turn == 1:  # each conversation's previous turn, prompt and reply, but its last token
            assert [cached for _, cached in results] == [len(p) - 4 for p in convs]
        cached_sum += sum(cached for _, cached in results)
        convs = [p + ids + [210, 211, 212] for p, (ids, _) in zip(convs, results)]

    # each request's path to its first token, from the engine process (behind the API key)
    assert httpx.get(c.url + "/v1/trace/first_tokens", timeout=30).status_code == 401
    got = httpx.get(c.url + "/v1/trace/first_tokens", headers=AUTH, timeout=30).json()
    ix = {f: i for i, f in enumerate(got["fields"])}
    assert got["total"] == len(got["rows"]) == 6 and sum(x[ix["cached_tokens"]] for x in got["rows"]) == cached_sum
    for x in got["rows"]:
        stamps = [x[ix[k]] for k in ("arrival", "admitted", "formed", "sent", "back")]
        assert stamps == sorted(stamps) and x[ix["batches"]] >= 1
    later = httpx.get(c.url + "/v1/trace/first_tokens", params={"since": 4}, headers=AUTH, timeout=30).json()
    assert [x[0] for x in later["rows"]] == [4, 5]

    # a flush while a request runs: refused without the key, and the request's tokens stay
    long_prompt = convs[0]
    out = {}
    t = threading.Thread(target=lambda: out.update(r=complete(c.url, long_prompt, 40)))
    t.start()
    assert httpx.post(c.url + "/v1/cache/flush", timeout=30).status_code == 401
    r = httpx.post(c.url + "/v1/cache/flush", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["flushed_snapshots"] >= 0
    t.join()
    ref = ref_llm.generate([long_prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    assert out["r"][0] == ref.token_ids and out["r"][1] > 0

    metrics = {s.name: s.value for fam in text_string_to_metric_families(httpx.get(c.url + "/metrics").text)
               for s in fam.samples}
    assert 0 < metrics["ppspec:prefix_cache_hits_total"] < metrics["ppspec:prefix_cache_queries_total"]
    assert metrics["ppspec:prefix_cache_hits_total"] == cached_sum + out["r"][1]

    assert httpx.post(c.url + "/v1/cache/flush", headers=AUTH, timeout=30).status_code == 200
    infos = c.wait_rows_free()
    assert all(i.snapshot_slots > 0 for i in infos)
    assert [(i.rows_in_use, i.kv_pages_used, i.snapshots_in_use) for i in infos] == [(0, 0, 0)] * 2
    # the usage gauge says so at once, with no step after the flush to refresh it
    metrics = {s.name: s.value for fam in text_string_to_metric_families(httpx.get(c.url + "/metrics").text)
               for s in fam.samples}
    assert metrics["ppspec:prefix_cache_usage"] == 0
