"""ExtState: versioned, fingerprinted per-rank state with exact key checks."""

import pytest
import torch

from megatron_ext.state import ExtState, StateMismatch


class _Obj:
    def __init__(self, value=0.0):
        self.t = torch.full((2,), value)

    def state_dict(self):
        return {"t": self.t.clone()}

    def load_state_dict(self, state):
        if set(state) != {"t"}:
            raise ValueError(sorted(state))
        self.t = state["t"].clone()


LAYOUT = {"tp": 1, "pp": 2, "dp": 2, "world": 4, "rank": 3}


def _state(value=0.0, settings=None, layout=LAYOUT, names=("a",)):
    s = ExtState(settings or {"grad_compression": "none"}, layout)
    for n in names:
        s.register(n, _Obj(value))
    return s


def test_round_trip():
    saved = _state(3.0).state_dict()
    target = _state(0.0)
    target.load_state_dict(saved)
    assert torch.equal(target.state_dict()["objects"]["a"]["t"], torch.full((2,), 3.0))


def test_layout_change_is_detected():
    saved = _state().state_dict()
    with pytest.raises(StateMismatch, match="layout"):
        _state(layout={**LAYOUT, "dp": 4}).load_state_dict(saved)


def test_settings_change_is_detected_and_reported():
    saved = _state().state_dict()
    with pytest.raises(StateMismatch, match="grad_compression"):
        _state(settings={"grad_compression": "separate"}).load_state_dict(saved)


def test_object_sets_must_match_exactly():
    saved = _state(names=("a", "b")).state_dict()
    with pytest.raises(StateMismatch, match="unexpected \\['b'\\]"):
        _state(names=("a",)).load_state_dict(saved)


def test_format_version_is_checked():
    saved = _state().state_dict()
    saved["format_version"] = 99
    with pytest.raises(StateMismatch, match="format"):
        _state().load_state_dict(saved)


def test_duplicate_registration_is_refused():
    s = _state()
    with pytest.raises(ValueError):
        s.register("a", _Obj())
