"""ExtState: versioned, fingerprinted per-rank state with exact key checks."""

import pytest
import torch

from megatron_ext.state import ExtState, StateMismatch


class _Obj:
    elastic_rules = {"t": "sum"}

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


def test_run_only_settings_do_not_stop_a_resume():
    """A torchft site restarted with another lighthouse, quorum size or timeout resumes: those
    options do not shape the state (RUN_ONLY), so they are not fingerprinted, and a checkpoint
    saved while they still were (its settings hold them) fits when it differs in them only.
    A setting that shapes the state still stops the load, named."""
    from megatron_ext.config import ext_config_from_flags

    site = ["--outer-method", "diloco", "--outer-transport", "torchft", "--outer-site-id", "0"]
    site += ["--outer-sites", "2"]
    a = ext_config_from_flags(site + ["--outer-lighthouse", "http://a:1", "--outer-min-sites", "2"])
    b = ext_config_from_flags(site + ["--outer-lighthouse", "http://b:2", "--outer-timeout", "9"])
    assert a.state_settings() == b.state_settings()
    assert "outer_lighthouse" not in a.state_settings()
    assert "outer_site_id" in a.state_settings() and "outer_interval" in a.state_settings()
    run_only = a.run_only_settings()
    assert set(run_only) >= {"outer_lighthouse", "outer_min_sites", "outer_timeout"}

    def state(cfg, settings=None):
        s = ExtState(settings or cfg.state_settings(), LAYOUT, run_only=cfg.run_only_settings())
        s.register("a", _Obj(1.0))
        return s

    state(b).load_state_dict(state(a).state_dict())
    # Saved by the earlier format of the settings (the run-only options fingerprinted).
    older = {**a.state_settings(), "outer_lighthouse": "http://a:1", "outer_min_sites": 2}
    state(b).load_state_dict(state(a, older).state_dict())
    # An option that shapes the state: named.
    other = ext_config_from_flags(site + ["--outer-interval", "7"])
    with pytest.raises(StateMismatch, match="outer_interval"):
        state(other).load_state_dict(state(a, older).state_dict())


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


class _Versioned(_Obj):
    """An object whose state gained the key ``n`` at format 2."""

    elastic_rules = {"t": "sum", "n": "same"}

    def __init__(self, value=0.0):
        super().__init__(value)
        self.n = 5

    def state_dict(self):
        return {"t": self.t.clone(), "n": self.n}

    def upgrade_state(self, state, version):
        return {"n": 0, **state} if version < 2 else state

    def load_state_dict(self, state):
        if set(state) != {"t", "n"}:
            raise ValueError(sorted(state))
        self.t, self.n = state["t"].clone(), state["n"]


def test_format_1_positional_hook_names_and_old_keys_are_upgraded():
    """A format-1 state as the code of that format wrote it: optimizer hooks named by
    position, an object without the key its class added later."""
    from megatron_ext.state import FORMAT_VERSION

    v1 = {
        "format_version": 1,
        **{
            k: v for k, v in _state().state_dict().items() if k not in ("format_version", "objects")
        },
        "objects": {
            "grad_reducer": {"t": torch.full((2,), 1.0)},
            "optimizer_hook.0.diloco": {"t": torch.full((2,), 2.0)},
            "optimizer_hook.1.grass": {"t": torch.full((2,), 3.0)},
        },
    }
    target = ExtState({"grad_compression": "none"}, LAYOUT)
    target.register("grad_reducer", _Obj())
    target.register("optimizer_hook.diloco", _Versioned())
    target.register("optimizer_hook.grass", _Obj())
    target.load_state_dict(v1)
    loaded = target.state_dict()
    assert loaded["format_version"] == FORMAT_VERSION == 2
    assert {name: obj["t"][0].item() for name, obj in loaded["objects"].items()} == {
        "grad_reducer": 1.0,
        "optimizer_hook.diloco": 2.0,
        "optimizer_hook.grass": 3.0,
    }
    assert loaded["objects"]["optimizer_hook.diloco"]["n"] == 0  # the format-1 default
    # A current-format state is strict: a missing key is not filled in.
    current = target.state_dict()
    del current["objects"]["optimizer_hook.diloco"]["n"]
    with pytest.raises(ValueError, match="'t'"):
        target.load_state_dict(current)
    # Two format-1 hooks of one name cannot be told apart.
    v1["objects"]["optimizer_hook.2.grass"] = v1["objects"]["optimizer_hook.1.grass"]
    with pytest.raises(StateMismatch, match="two objects named 'optimizer_hook.grass'"):
        target.load_state_dict(v1)
