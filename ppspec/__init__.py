"""ppspec: pipeline-parallel speculative decoding for hybrid linear-attention LMs.

The top-level folders of the repository are installed under this namespace:
``ppspec.proto``, ``ppspec.stage_server``, ``ppspec.router``, ``ppspec.kernels``,
``ppspec.bench``. ``ppspec.LLM`` is the single-process Python API.
"""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: importing ppspec must not pull torch into light processes (the bench client).
    if name in ("LLM", "SamplingParams"):
        from ppspec.router import llm, types

        return {"LLM": llm.LLM, "SamplingParams": types.SamplingParams}[name]
    raise AttributeError(name)
