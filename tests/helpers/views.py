"""Optimizer views for tests without Megatron.

:class:`ParamsView` is over a plain module's parameters, for DiLoCo tests: model and main
parameter are the same tensor (an fp32 model, no distributed optimizer); the step is read
from ``clock["step"]``, which the test's training loop advances. :class:`SlicesView` is over
the parameters of a gradient bucket's layout, their state made by the test (the AdamW
moments a Radius selection reads).
"""

from typing import Callable, Dict, Sequence

import torch

from megatron_ext.protocols import OptimizerView, ParamOptimState


class ParamsView(OptimizerView):
    """:class:`~megatron_ext.protocols.OptimizerView` over ``params`` (FQN -> parameter)."""

    def __init__(self, params: Dict[str, torch.nn.Parameter], clock: Dict[str, int]):
        self.params = params
        self.clock = clock

    def fqns(self):
        return list(self.params)

    def param_state(self, fqn):
        p = self.params[fqn]
        return ParamOptimState(fqn=fqn, model_param=p.data, main_param=p.data, state={})

    @property
    def step(self):
        return self.clock["step"]


class SlicesView(OptimizerView):
    """:class:`~megatron_ext.protocols.OptimizerView` at ``step`` over the parameters
    ``slices`` (``ParamSlice`` objects, as ``param_slices`` of tests/helpers/reducers.py makes
    them); ``state(i, fqn, n)`` makes the ``i``-th parameter's :class:`ParamOptimState`
    (``n`` elements), each time it is asked for."""

    def __init__(
        self, slices: Sequence, step: int, state: Callable[[int, str, int], ParamOptimState]
    ):
        self.slices = slices
        self._step = step
        self._state = state

    def fqns(self):
        return [s.fqn for s in self.slices]

    def param_state(self, fqn):
        i, s = next((i, s) for i, s in enumerate(self.slices) if s.fqn == fqn)
        return self._state(i, fqn, s.end - s.start)

    @property
    def step(self):
        return self._step
