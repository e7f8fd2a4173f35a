"""The twin a CPU engine loads the next version into, and the hand-over in the pause, on plain torch modules.

vLLM's side (its loaders and packing run on the twin, the engine untouched
until the swap, three architectures) is tests/generator/test_architectures.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.generator.prepack import _handover, _own_copy, _twin


def model() -> nn.Module:
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    return nn.Sequential(shared, nn.LayerNorm(4), nn.Sequential(shared), nn.Linear(4, 2))


def test_a_twin_has_registries_of_its_own_holding_the_live_tensors() -> None:
    live = model()
    twins: dict[int, nn.Module] = {}
    twin = _twin(live, twins)
    pairs = list(zip(live.modules(), twin.modules(), strict=True))
    assert len(twins) == len(pairs) == 5
    for a, b in pairs:
        assert a is not b and type(a) is type(b)
        assert a._parameters is not b._parameters and a._buffers is not b._buffers and a._modules is not b._modules
        assert all(b._parameters[n] is p for n, p in a._parameters.items())
    # A module the tree holds twice has one twin, held twice.
    assert twin[2][0] is twin[0]
    # Replacing a twin's parameter leaves the live module's.
    before = live[1].weight
    twin[1].weight = nn.Parameter(torch.zeros(4))
    assert live[1].weight is before and float(live[1].weight.detach().sum()) == 4.0


def test_the_hand_over_copies_into_the_live_tensors_and_hands_over_what_the_reload_set() -> None:
    live = model()
    twins: dict[int, nn.Module] = {}
    _twin(live, twins)
    reloaded = [(live[0], twins[id(live[0])]), (live[1], twins[id(live[1])])]
    linear, norm = reloaded[0][1], reloaded[1][1]
    linear.weight = nn.Parameter(torch.full((4, 4), 2.0))
    linear.bias = _own_copy(live[0].bias, live[0], linear)
    linear.bias.data.fill_(3.0)

    def packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return x

    linear.cpu_linear = packed  # what vLLM's CPU processing sets
    held = (live[0].weight, live[0].bias, live[1].weight)
    prepared = _handover(reloaded, {id(live[0]): "0", id(live[1]): "1"})
    # The norm's twin was not changed: nothing of it is handed over.
    assert norm.weight is live[1].weight
    assert len(prepared.tensors) == 2 and prepared.num_layers == 2
    assert float(live[0].weight.detach().sum()) != 32.0  # nothing changes before apply
    prepared.apply()
    assert (live[0].weight, live[0].bias, live[1].weight) == held  # the same tensors, new values
    assert torch.equal(live[0].weight, torch.full((4, 4), 2.0)) and torch.equal(live[0].bias, torch.full((4,), 3.0))
    assert live[0].cpu_linear is packed and "cpu_linear" not in live[1].__dict__
    assert prepared.tensors == [] and prepared.attributes == []


def test_a_reload_that_changes_a_shape_is_refused_by_name_before_anything_changes() -> None:
    live = model()
    twins: dict[int, nn.Module] = {}
    _twin(live, twins)
    twin = twins[id(live[3])]
    twin.weight = nn.Parameter(torch.zeros(3, 4))
    before = live[3].weight.detach().clone()
    with pytest.raises(
        RuntimeError, match=r"^head\.weight: the reload made \(3, 4\) torch.float32, the engine holds \(2, 4\)"
    ):
        _handover([(live[3], twin)], {id(live[3]): "head"})
    assert torch.equal(live[3].weight, before)


def test_an_own_copy_has_the_attributes_and_loaders_bound_to_the_twin() -> None:
    live = model()
    twins: dict[int, nn.Module] = {}
    twin = _twin(live, twins)[0]
    bias = live[0].bias
    bias.output_dim = 0  # type: ignore[attr-defined]
    bias.weight_loader = live[0].forward  # type: ignore[attr-defined]  # a method of the live layer, as vLLM's
    copy = _own_copy(bias, live[0], twin)
    assert copy is not bias and copy.shape == bias.shape and isinstance(copy, nn.Parameter)
    assert copy.data_ptr() != bias.data_ptr()
    assert copy.output_dim == 0  # type: ignore[attr-defined]
    assert copy.weight_loader.__self__ is twin  # type: ignore[attr-defined]
