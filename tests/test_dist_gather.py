"""RNG states travel between ranks as NumPy arrays and come back as the same tensors."""

from __future__ import annotations

import pickle

import torch

from spot_callbacks._dist import _to_arrays, _to_tensors
from spot_callbacks.staging import capture_rng_state


def test_rng_states_cross_the_gather_as_arrays_and_come_back_equal() -> None:
    state = (capture_rng_state(), {"cuda": [torch.arange(8, dtype=torch.uint8)], "step": 3})
    wire = pickle.dumps(_to_arrays(state))
    assert b"_rebuild" not in wire and b"_load_from_bytes" not in wire  # no torch.save/torch.load per tensor
    back = _to_tensors(pickle.loads(wire))
    expected, got = state[0], back[0]
    for key in ("torch",):
        assert got[key].dtype == expected[key].dtype and torch.equal(got[key], expected[key])
    assert torch.equal(got["python"]["state"], expected["python"]["state"])
    assert (
        got["python"]["state"].dtype == torch.int64 and got["python"]["gauss"] == expected["python"]["gauss"]
    )
    assert torch.equal(got["numpy"]["keys"], expected["numpy"]["keys"]) and got["numpy"]["kind"] == "MT19937"
    assert torch.equal(back[1]["cuda"][0], state[1]["cuda"][0]) and back[1]["step"] == 3
    torch.manual_seed(5)
    from spot_callbacks.staging import restore_rng_state

    restore_rng_state(got)
    assert torch.equal(torch.rand(3), (restore_rng_state(expected), torch.rand(3))[1])
