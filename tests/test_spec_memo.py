"""codec.SpecMemo: a step's sampling specs through the memo are the specs without it, a
row's changed spec is encoded and decoded anew, and an unchanged one is not."""
import dataclasses

from ppspec.proto.codec import SpecMemo, step_from_pb, step_to_pb
from ppspec.proto.messages import SamplingSpec, StepInput


def _step(rows, specs, round=1):
    n = len(rows)
    return StepInput(micro_batch_id=0, round=round, mode="decode", req_pool_indices=list(rows), seq_lens=[5] * n,
                     extend_lens=[1] * n, input_ids=[7] * n, sample=[True] * n, next_token_ids=[-1] * n,
                     sampling=specs, output_lens=[1] * n)


def test_memo_round_trip_equals_plain_codec():
    enc, dec = SpecMemo(), SpecMemo()
    a = SamplingSpec(seed=3)
    b = SamplingSpec(temperature=0.75, top_p=0.875, seed=4, logprobs=2, repetition_penalty=1.25,  # float32-exact
                     output_token_ids=[5, 9], output_token_counts=[1, 2], prompt_logprobs=0)
    for round, specs in enumerate([[a, b], [a, dataclasses.replace(b, output_token_ids=[5], output_token_counts=[3])],
                                   [b, a]], start=1):  # rows swap specs: each row's memo must follow
        s = _step([4, 2], specs, round)
        m = step_to_pb(s, enc)
        assert m == step_to_pb(s)
        got = step_from_pb(m, dec).sampling
        assert got == step_from_pb(m).sampling == specs


def test_unchanged_spec_is_converted_once_changed_one_again():
    enc, dec = SpecMemo(), SpecMemo()
    a = SamplingSpec(seed=3)
    first = enc.encode([0], [a])[0]
    assert enc.encode([0], [a])[0] is first  # the same spec object: its message again
    other = enc.encode([0], [dataclasses.replace(a, seed=4)])[0]  # a new request on the row
    assert other is not first and other.seed == 4
    x = dec.decode([0], [first])[0]
    assert dec.decode([0], [first])[0] is x
    y = dec.decode([0], [other])[0]
    assert y is not x and y.seed == 4 and x.seed == 3


def test_memo_stays_bounded_and_mismatched_lengths_decode_plainly():
    memo = SpecMemo(max_rows=4)
    specs = [SamplingSpec(seed=k) for k in range(10)]
    for k, x in enumerate(specs):
        memo.encode([k], [x])
    assert len(memo._encoded) <= 4
    msgs = memo.encode(list(range(3)), specs[:3])
    assert [x.seed for x in memo.decode([0], msgs)] == [0, 1, 2]  # rows and specs disagree: no memo


def test_long_id_lists_travel_packed_and_whole_and_a_torn_list_is_refused_by_name():
    """``allowed_token_ids`` and ``prompt_token_ids`` travel as packed little-endian int32
    (4 bytes an id, a copy to parse, where thousands of varints per request and step took
    milliseconds): every id comes back in order, the largest id a vocabulary can have too, and
    a byte count that is not whole ids is a ValueError naming the field (a stage answers it
    INVALID_ARGUMENT)."""
    import pytest

    from ppspec.proto.codec import _spec_to_pb

    ids = list(range(0, 32000, 7)) + [2**31 - 1]
    a = SamplingSpec(temperature=0.5, seed=1, allowed_token_ids=ids, prompt_token_ids=[3, 1, 2],
                     repetition_penalty=1.25)
    m = step_to_pb(_step([1], [a]))
    assert len(m.sampling[0].allowed_token_ids_le32) == 4 * len(ids)
    assert m.sampling[0].allowed_token_ids_le32[:8] == bytes([0, 0, 0, 0, 7, 0, 0, 0])  # little-endian on any host
    assert step_from_pb(m).sampling == [a]
    assert step_from_pb(m, SpecMemo()).sampling == [a]
    for field, name in (("allowed_token_ids_le32", "allowed_token_ids"), ("prompt_token_ids_le32", "prompt_token_ids")):
        torn = _spec_to_pb(a)
        setattr(torn, field, getattr(torn, field)[:-1])
        m.sampling[0].CopyFrom(torn)
        with pytest.raises(ValueError, match=f"sampling: {name} holds .* not a whole number of 4-byte ids"):
            step_from_pb(m)
