"""Host-device synchronisations of a step on the graph path, counted on the CPU.

On CUDA a step that reads the device before its sampled tokens (``.tolist()``, ``.item()``,
``bool`` of a tensor, ``nonzero``...) or copies host values with a blocking copy (which
synchronises the stream) makes the host wait for the device in the middle of the step:
a mixed micro-batch of 32 decodes and a 512-token chunk took two reads, one per part
(docs/PERFORMANCE.md, "Prefill and the token budget"). A CPU has no device to wait for, so
the guard counts the calls that would wait on CUDA while ``StageRunner.step`` runs, outside
the forward a graph records (a capture refuses a synchronisation there) and the check of
hidden states that arrive as host tensors:

- reads: ``Tensor.tolist / item / cpu / numpy / __bool__ / __int__ / __float__ /
  __index__ / nonzero`` and ``torch.nonzero``;
- blocking copies: ``torch.tensor(..., device=...)``, ``Tensor.copy_`` and ``Tensor.to(device)``
  without ``non_blocking=True``.

A step on the graph path may read once, its sampled tokens at the end
(``tests/gpu/test_prefill_graphs_gpu.py::test_mixed_step_synchronises_once`` checks the
same on the H200 with ``torch.cuda.set_sync_debug_mode``).
"""
import contextlib

import pytest
import torch

from ppspec.proto.messages import StepInput
from ppspec.stage_server import graphs
from ppspec.stage_server.runner import StageRunner, split_layers
from ppspec.stage_server.validation import StepChecker

READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero")
# not counted: the forwards a graph records, and the check of hidden states that reads them
# only where they are host tensors (the bytes data plane; never a CUDA tensor)
NOT_COUNTED = ((graphs.StepGraphs, "_step"), (graphs.PrefillGraphs, "_forward"), (graphs.MixedGraphs, "_forward"),
               (StepChecker, "_check_hidden"))


@pytest.fixture(autouse=True)
def _long_buckets(monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.setattr(graphs.PrefillGraphs, "_long_tokens", staticmethod(lambda capture, max_kv_len: [192, 320]))


class SyncGuard:
    """Counts, while on, the calls that would wait for a CUDA device (module docstring)."""

    def __init__(self, monkeypatch):
        self.on, self.inside, self.calls = False, 0, []
        for name in READS:
            self._wrap(monkeypatch, torch.Tensor, name, lambda *a, **k: True)
        self._wrap(monkeypatch, torch, "nonzero", lambda *a, **k: True)
        self._wrap(monkeypatch, torch, "tensor", lambda *a, **k: k.get("device") is not None, "torch.tensor(device=)")
        self._wrap(monkeypatch, torch.Tensor, "copy_", lambda *a, **k: not k.get("non_blocking", a[2:3] == (True,)),
                   "copy_ (blocking)")
        self._wrap(monkeypatch, torch.Tensor, "to", self._blocking_to, "to(device) (blocking)")
        for cls, name in NOT_COUNTED:
            orig = getattr(cls, name)

            def recorded(*a, _orig=orig, **k):
                self.inside += 1
                try:
                    return _orig(*a, **k)
                finally:
                    self.inside -= 1
            monkeypatch.setattr(cls, name, recorded)

    @staticmethod
    def _blocking_to(self_t, *a, **k):
        device = k.get("device") or next((x for x in a if isinstance(x, (str, torch.device))), None)
        return device is not None and not k.get("non_blocking", False)

    def _wrap(self, monkeypatch, owner, name, counts, label=None):
        orig = getattr(owner, name)

        def wrapper(*a, **k):
            if self.on and not self.inside and counts(*a, **k):
                self.on = False  # the guard's own bookkeeping is not counted
                try:
                    self.calls.append(label or name)
                finally:
                    self.on = True
            return orig(*a, **k)
        monkeypatch.setattr(owner, name, wrapper)

    @contextlib.contextmanager
    def counting(self):
        self.calls, self.on = [], True
        try:
            yield self.calls
        finally:
            self.on = False


def _runners(path, pp, **kw):
    layers = split_layers(7, pp)
    return [StageRunner(path, k, pp, layer_range=layers[k], cuda_graph_max_bs=8, mixed_graph_tokens=128, max_rows=12,
                        **kw) for k in range(pp)]


def _step_counted(stages, inp, guard):
    """The micro-batch through the stages, each step counted: (each stage's calls, last output)."""
    h, calls = None, []
    for st in stages:
        with guard.counting() as c:
            out = st.step(StepInput(**{**vars(inp), "hidden_states": h}))
        calls.append(list(c))
        h = out.hidden_states
    return calls, out


@pytest.mark.parametrize("pp", [1, 2])
def test_mixed_graph_step_reads_the_device_once(make_ckpt, monkeypatch, pp):
    """Decodes of 5 requests beside a prompt's chunks (each a mixed graph replay): the chunk
    inside the prompt samples nothing, the prompt's last chunk samples with the decodes.
    Each step reads the device once, its tokens (the last stage; none on stage 0 of PP2),
    and copies no host value with a blocking copy. The tokens equal the eager stage's."""
    path = make_ckpt("qwen3_5_ratio2_7l")
    graphed, eager = _runners(path, pp), [StageRunner(path, max_rows=12, cuda_graph_max_bs=0)]
    guard = SyncGuard(monkeypatch)
    g = torch.Generator().manual_seed(3)
    rand = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    rows, lens = [4, 7, 2, 1, 3], [12, 9, 9, 5, 14]
    first = StepInput(0, 0, "prefill", rows, [0] * 5, lens, rand(sum(lens)))
    for st in (graphed, eager):
        _step_counted(st, first, guard)
    prompt = rand(278)
    for rnd, (seq, T) in enumerate([(0, 150), (150, 128)], start=1):
        last = seq + T == len(prompt)
        inp = StepInput(0, rnd, "decode", rows + [9], lens + [seq], [1] * 5 + [T], rand(5) + prompt[seq:seq + T],
                        sample=[True] * 5 + [last], next_token_ids=[-1] * 5 + [-1 if last else prompt[seq + T]],
                        num_prefill=1)
        forwards = [st.forwards["graph"] for st in graphed]
        calls, out = _step_counted(graphed, inp, guard)
        assert [st.forwards["graph"] for st in graphed] == [f + 1 for f in forwards]  # one mixed replay each
        assert calls == [[]] * (pp - 1) + [["tolist"]], calls
        _, want = _step_counted(eager, inp, guard)
        assert out.output_ids == want.output_ids
        assert [bool(t) for t in out.output_ids] == [True] * 5 + [last]
        lens = [n + 1 for n in lens]


def test_decode_and_prefill_graph_steps_read_the_device_once(make_ckpt, monkeypatch):
    """A short prompt's prefill graph and a decode graph step (PP1): one read each, no
    blocking copy; a chunk inside its prompt on its own (a long bucket) reads nothing."""
    path = make_ckpt("qwen3_5_ratio2_7l")
    (st,) = _runners(path, 1)
    guard = SyncGuard(monkeypatch)
    with guard.counting() as c:
        out = st.step(StepInput(0, 0, "prefill", [0, 1], [0, 0], [5, 7], list(range(1, 13))))
    assert c == ["tolist"] and st.forwards == {"graph": 1}
    with guard.counting() as c:
        st.step(StepInput(0, 1, "decode", [0, 1], [5, 7], [1, 1], [t[0] for t in out.output_ids]))
    assert c == ["tolist"] and st.forwards == {"graph": 2}
    prompt = list(range(20, 220))
    with guard.counting() as c:
        out = st.step(StepInput(0, 2, "prefill", [5], [0], [150], prompt[:150], sample=[False],
                                next_token_ids=[prompt[150]]))
    assert c == [] and out.output_ids == [[]] and st.forwards == {"graph": 3}


def test_sampling_in_a_mixed_step_reads_the_device_once(make_ckpt, monkeypatch):
    """The decodes of a mixed graph step sample with every logit rule that has no host read
    by design (temperature with top-k / top-p / min-p, repetition / presence / frequency
    penalties, logit bias, allowed ids, the min_tokens ban) beside a chunk inside its
    prompt: still one read (the rules' ids and values go to the device without a blocking
    copy), and the tokens equal the eager stage's (the same seeded picks)."""
    from ppspec.proto.messages import SamplingSpec

    path = make_ckpt("qwen3_5_ratio2_7l")
    (graphed,), eager = _runners(path, 1), StageRunner(path, max_rows=12, cuda_graph_max_bs=0)
    guard = SyncGuard(monkeypatch)
    g = torch.Generator().manual_seed(5)
    rand = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    rows, lens = [4, 7, 2, 1, 3], [12, 9, 9, 5, 14]
    first = StepInput(0, 0, "prefill", rows, [0] * 5, lens, rand(sum(lens)))
    for st in (graphed, eager):
        st.step(first)
    specs = [SamplingSpec(),
             SamplingSpec(temperature=0.7, seed=3, top_k=50, top_p=0.9, min_p=0.05),
             SamplingSpec(temperature=1.0, seed=4, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2,
                          output_token_ids=[5, 9], output_token_counts=[2, 1], prompt_token_ids=[1, 2, 3]),
             SamplingSpec(logit_bias_ids=[7, 11], logit_bias_values=[5.0, -3.0], allowed_token_ids=list(range(200))),
             SamplingSpec(min_tokens=3, banned_until_min=[2])]
    prompt = rand(200)
    inp = StepInput(0, 1, "decode", rows + [9], lens + [0], [1] * 5 + [150], rand(5) + prompt[:150],
                    sample=[True] * 5 + [False], next_token_ids=[-1] * 5 + [prompt[150]],
                    sampling=specs + [SamplingSpec()], output_lens=[1] * 5 + [0], num_prefill=1)
    calls, out = _step_counted([graphed], inp, guard)
    assert calls == [["tolist"]] and graphed.forwards["graph"] == 2  # the first prefill, then one mixed replay
    assert out.output_ids == eager.step(inp).output_ids
    assert out.output_ids[3][0] < 200 and out.output_ids[-1] == []
