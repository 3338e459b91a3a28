"""megatron_ext/quiet.py: the known-harmless warnings and rerun lines are filtered, nothing
else is, and MEGATRON_EXT_VERBOSE_WARNINGS=1 (or the user's -W) shows everything."""

import logging
import warnings

import pytest

from megatron_ext import quiet


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(quiet, "_installed", False)
    monkeypatch.setattr(quiet.sys, "warnoptions", [])
    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)
    logger = logging.getLogger("megatron.core.rerun_state_machine")
    before = list(logger.filters)
    # An install earlier in this test process (a driver's main() run in-process) left its
    # filter on the global logger: start without it.
    logger.filters[:] = [f for f in before if not isinstance(f, quiet._RerunLines)]
    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.simplefilter("always")
        yield logger
    logger.filters[:] = before


def _shown(messages):
    with warnings.catch_warnings(record=True) as caught:
        for category, text in messages:
            warnings.warn(text, category)
    return [str(w.message) for w in caught]


KNOWN = [
    (
        UserWarning,
        "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
    ),
    (UserWarning, "Apex is not installed. Falling back to Torch Norm"),
    (FutureWarning, "`load_state_dict` is deprecated and will be removed in future versions."),
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor."),
    (FutureWarning, "`torch.distributed.all_gather_into_tensor` is deprecated. Please use x"),
]
OTHER = [
    (UserWarning, "Apex fell over"),  # same library, another message: shown
    (FutureWarning, "`load_state_dict` is deprecated"[1:]),  # not at the start
    (DeprecationWarning, "Please use DTensor instead and we are deprecating ShardedTensor."),
]


def test_known_warnings_and_rerun_lines_are_filtered_and_nothing_else(fresh, caplog):
    assert quiet.install() and quiet.install()  # idempotent
    # catch_warnings(record=True) keeps the installed filters: only the unknown ones show.
    assert _shown(KNOWN + OTHER) == [text for _, text in OTHER]
    with caplog.at_level(logging.WARNING, logger="megatron.core.rerun_state_machine"):
        fresh.warning("RerunStateMachine initialized in mode RerunMode.DISABLED")
        fresh.warning("Implicit initialization of Rerun State Machine!")
        fresh.warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]


@pytest.mark.parametrize("how", ["env", "warnoptions"])
def test_verbose_shows_everything(fresh, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv(quiet.VERBOSE_ENV, "1")
    else:
        monkeypatch.setattr(quiet.sys, "warnoptions", ["default"])
    assert quiet.verbose() and not quiet.install()
    assert len(_shown(KNOWN)) == len(KNOWN)
    assert not any(isinstance(f, quiet._RerunLines) for f in fresh.filters)
