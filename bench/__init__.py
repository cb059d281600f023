"""``ppspec bench``: a serving benchmark for any OpenAI-compatible server.

Light client only: aiohttp (the timed requests), tqdm, prometheus_client (and matplotlib for ``--plot``).
Nothing here may import torch.

Modules: ``dataset`` (ShareGPT prompts), ``client`` (one streaming request and its
timings), ``metrics`` (latency statistics and the server's speculative-decoding
counters), ``runner`` (arrivals, concurrency, the whole run), ``plot`` (PNG figures),
``cli`` (``ppspec bench ...``).
"""


class BenchError(Exception):
    """A failure the user can act on; the CLI prints it as one line and exits with 1."""
