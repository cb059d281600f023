"""guidellm (a third-party load generator, the ``test`` extra) against ``ppspec serve`` on
the demo model, fully offline (the demo checkpoint's own tokenizer): its default streaming
chat benchmark and a completions benchmark, a handful of requests each. Every request must
succeed and come back with its TTFT and inter-token latency; the token counts guidellm read
from the streamed usage are checked against the server's access log."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from cluster import free_port, wait_health

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "qwen35-demo")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "GUIDELLM__MAX_WORKER_PROCESSES": "1"}  # one worker: each spawned one imports guidellm anew
PROMPT_TOKENS, OUTPUT_TOKENS, REQUESTS = 32, 12, 4

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ppspec.cli", "serve", "--model", DEMO, "--port", str(port),
                                 "--num-threads", "1"], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **OFFLINE})
    try:
        wait_health(f"http://127.0.0.1:{port}", 200, timeout=240)
        yield f"http://127.0.0.1:{port}", log
    finally:
        proc.terminate()
        proc.wait(30)


def _guidellm(url, tmp_path, backend_extra: str, profile: str) -> dict:
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "guidellm", "run",
           "--backend", f"kind=openai_http,target={url},model=qwen35-demo{backend_extra}",
           "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
           "--tokenizer", f"kind=huggingface_auto,model={DEMO}",
           "--profile", profile, "--constraint", f"kind=max_requests,count={REQUESTS}",
           "--output", f"kind=json,path={out}", "--disable-console"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env={**os.environ, **OFFLINE})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (bench,) = json.loads(out.read_text())["benchmarks"]
    return bench


def _completion_tokens_logged(log, path: str) -> list[int]:
    return [int(n) for n in re.findall(rf'"POST {re.escape(path)}" 200 prompt_tokens=\d+ completion_tokens=(\d+) ',
                                       log.read_text())]


@pytest.mark.parametrize("path,backend_extra,profile", [
    ("/v1/chat/completions", "", "kind=concurrent,streams=2"),  # guidellm's default request: streamed chat
    ("/v1/completions", ",request_format=/v1/completions", "kind=synchronous"),
])
def test_guidellm_benchmark(served, tmp_path, path, backend_extra, profile):
    url, log = served
    before = len(_completion_tokens_logged(log, path))
    bench = _guidellm(url, tmp_path, backend_extra, profile)
    requests = bench["requests"]
    assert (len(requests["errored"]), len(requests["incomplete"])) == (0, 0), requests["errored"][:1]
    ok = requests["successful"]
    # guidellm may cancel a queued request before sending it when its max_requests constraint
    # ends the run (seen once on a loaded host): such a request never reaches the server (the
    # access-log check below), and the rest must all have succeeded
    state = bench["scheduler_state"]
    assert len(ok) == state["successful_requests"] == REQUESTS - state["cancelled_requests"], state
    assert len(ok) >= REQUESTS - 1
    for r in ok:
        body = json.loads(r["request_args"])["body"]
        assert body["stream"] is True  # streamed, with vLLM's continuous usage stats
        assert body["stream_options"]["continuous_usage_stats"] is True
        assert r["output_tokens"] == OUTPUT_TOKENS and r["prompt_tokens"] > 0
        assert r["time_to_first_token_ms"] > 0 and r["inter_token_latency_ms"] > 0
        assert r["time_to_first_token_ms"] < r["request_latency"] * 1000
        assert r["info"]["timings"]["token_iterations"] >= 2
    # what guidellm counted is what the server generated (its access log, one line per request)
    served_tokens = _completion_tokens_logged(log, path)[before:]
    assert sorted(served_tokens) == sorted(r["output_tokens"] for r in ok)
