"""Global FQNs: local pipeline layer indices become global ones, wrappers are stripped."""

import torch

from megatron_ext.megatron.naming import global_module_names, global_param_names, unwrap


class _Layer(torch.nn.Module):
    def __init__(self, number):
        super().__init__()
        self.layer_number = number
        self.lin = torch.nn.Linear(2, 2)


class _Decoder(torch.nn.Module):
    def __init__(self, first):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer(first), _Layer(first + 1)])


class _Model(torch.nn.Module):
    def __init__(self, first):
        super().__init__()
        self.decoder = _Decoder(first)
        self.output_layer = torch.nn.Linear(2, 2)


class _Wrapper(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module


def test_second_stage_gets_global_layer_numbers():
    model = _Wrapper(_Wrapper(_Model(first=3)))  # layers 3, 4 (1-based) on this stage
    names = sorted(global_param_names(model).values())
    assert "decoder.layers.2.lin.weight" in names and "decoder.layers.3.lin.bias" in names
    assert "output_layer.weight" in names
    assert not any(n.startswith("module.") for n in names)
    modules = dict(global_module_names(model))
    assert "decoder.layers.3.lin" in modules
    assert isinstance(unwrap(model), _Model)
