"""An optimizer view over a plain module's parameters, for DiLoCo tests without Megatron.

Model and main parameter are the same tensor (an fp32 model, no distributed optimizer); the
step is read from ``clock["step"]``, which the test's training loop advances.
"""

from typing import Dict

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
