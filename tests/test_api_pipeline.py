"""The official openai client against a running PP2 + MTP pipeline, and the metrics it leaves."""
import time

import httpx
import pytest
import torch
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from cluster import Cluster
from ppspec.router.llm import LLM
from ppspec.router.types import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(make_ckpt, tmp_path_factory):
    path = make_ckpt("qwen3_5_ratio2_7l")
    c = Cluster(path, 2, "mtp", log_dir=str(tmp_path_factory.mktemp("logs"))).start()
    yield path, c
    c.stop()


def metric_values(url):
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_openai_client_streaming_and_not(cluster):
    path, c = cluster
    torch.set_num_threads(1)
    client = OpenAI(base_url=c.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    prompt = "The quick brown fox"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = r.choices[0].model_extra["token_ids"]
    assert r.usage.completion_tokens == len(ids) == 20 and r.choices[0].finish_reason == "length"
    tok = LLM(path, max_rows=2).tokenizer
    ref = LLM(path, max_rows=2).generate([tok.encode(prompt)], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert ids == ref.token_ids
    assert r.choices[0].text == tok.decode(ref.token_ids)
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == r.choices[0].text
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=12, temperature=0.8, seed=7)
    chat2 = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                           max_tokens=12, temperature=0.8, seed=7)
    assert chat.choices[0].message.content == chat2.choices[0].message.content  # seeded sampling
    assert chat.usage.prompt_tokens > 0


def test_metrics_after_traffic(cluster):
    _, c = cluster
    client = OpenAI(base_url=c.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    for _ in range(3):
        client.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True})
    m = metric_values(c.url)
    drafts = m[("ppspec:spec_decode_num_drafts_total", ())]
    accepted = m[("ppspec:spec_decode_num_accepted_tokens_total", ())]
    assert drafts > 0 and 0 <= accepted <= 3 * drafts
    hist_sum = m[("ppspec:spec_decode_accept_length_sum", ())]
    hist_n = m[("ppspec:spec_decode_accept_length_count", ())]
    assert hist_n == drafts and abs(hist_sum / hist_n - (1 + accepted / drafts)) < 1e-9
    assert m[("ppspec:request_success_total", (("finished_reason", "length"),))] >= 3
    assert m[("ppspec:stage_forward_latency_seconds_count", (("mode", "verify"), ("stage", "1")))] > 0
    assert m[("ppspec:generation_tokens_total", ())] >= 48
    assert m[("ppspec:micro_batches_in_flight", ())] == 0  # idle after the traffic


def test_stop_string_finishes_count_as_stop(cluster):
    _, c = cluster
    client = OpenAI(base_url=c.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    full = client.completions.create(model=model, prompt="The quick brown", max_tokens=300, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[4:6]  # matched long before max_tokens: the engine is still running the request
    before = metric_values(c.url)
    r = client.completions.create(model=model, prompt="The quick brown", max_tokens=300, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[: full.index(stop)]
    key = lambda reason: ("ppspec:request_success_total", (("finished_reason", reason),))  # noqa: E731
    running = ("ppspec:num_requests_running", ())
    deadline = time.monotonic() + 60  # the engine finishes the stopped request in the background
    while True:
        after = metric_values(c.url)
        if after.get(key("stop"), 0) > before.get(key("stop"), 0) and after.get(running, 0) == 0:
            break
        assert time.monotonic() < deadline, "the stopped request never finished"
        time.sleep(0.05)
    assert after.get(key("stop"), 0) - before.get(key("stop"), 0) == 1
    assert after.get(key("abort"), 0) == before.get(key("abort"), 0)
