"""Frozen fp32 linears on a CPU as oneDNN products over prepacked weights (modeling/cpu_linear.py): the same numbers as
torch's own products, taken only where no gradient is wanted, refreshed when a weight changes, and off on request."""

from __future__ import annotations

import copy

import pytest
import torch

from modeling import cpu_linear
from modeling.target import vocab_logits

pytestmark = pytest.mark.skipif(not cpu_linear.enabled(), reason="this torch build has no oneDNN (mkldnn) backend")


def frozen_mlp(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 40, bias=False))
    return model.eval().requires_grad_(False)


def reference(model: torch.nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    first, _, last = model  # matmuls, not F.linear, which `no_torch_linear` refuses
    return torch.nn.functional.gelu(x @ first.weight.T + first.bias) @ last.weight.T


@pytest.fixture
def no_torch_linear(monkeypatch):
    """Makes torch's own product fail inside cpu_linear: a passing call took the oneDNN path."""

    def refuse(*args, **kwargs):
        raise AssertionError("F.linear called: the packed path was not taken")

    monkeypatch.setattr(cpu_linear.F, "linear", refuse)


@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (3, 5, 64)])
def test_packed_products_equal_torchs(shape, no_torch_linear):
    model = frozen_mlp()
    x = torch.randn(*shape)
    expected = reference(model, x)
    assert cpu_linear.pack_linears(model) == 2
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    # a strided input (a transposed view's rows) too
    wide = torch.randn(64, shape[0]).T
    with torch.no_grad():
        torch.testing.assert_close(model(wide), reference(model, wide), rtol=1e-5, atol=1e-5)


def test_gradients_of_frozen_and_trainable_weights_are_torchs(no_torch_linear):
    frozen, trainable = frozen_mlp(), frozen_mlp().requires_grad_(True)
    assert cpu_linear.pack_linears(frozen) == 2 and cpu_linear.pack_linears(trainable) == 2
    assert cpu_linear.packed_weight(trainable[0].weight) is None  # its weights change every step: never packed
    for model in (frozen, trainable):
        twin = copy.deepcopy(model)
        x = torch.randn(2, 3, 64, requires_grad=True)
        out = model(x)
        assert out.grad_fn is not None
        out.square().sum().backward()
        reference_x = x.detach().clone().requires_grad_(True)
        reference(twin, reference_x).square().sum().backward()
        torch.testing.assert_close(x.grad, reference_x.grad, rtol=1e-5, atol=1e-5)
        for param, expected in zip(model.parameters(), twin.parameters()):
            if param.requires_grad:
                torch.testing.assert_close(param.grad, expected.grad, rtol=1e-5, atol=1e-4)


def test_autocast_keeps_its_own_products():
    model = frozen_mlp()
    cpu_linear.pack_linears(model)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(torch.randn(4, 64)).dtype == torch.bfloat16  # autocast's bf16 product, as without packing


def test_a_weight_changed_in_place_is_repacked(no_torch_linear):
    model, other = frozen_mlp(0), frozen_mlp(1)
    cpu_linear.pack_linears(model)
    x = torch.randn(2, 64)
    with torch.no_grad():
        before = model(x)
        model.load_state_dict(other.state_dict())  # a checkpoint loaded after packing
        after = model(x)
    torch.testing.assert_close(after, reference(other, x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, after)


def test_copies_unpacking_and_the_switch(monkeypatch):
    model = frozen_mlp()
    cpu_linear.pack_linears(model)
    clone = copy.deepcopy(model)  # packed copies live outside the modules: a model still deep-copies
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(clone(x), reference(model, x), rtol=1e-5, atol=1e-5)
    assert cpu_linear.unpack_linears(model) == 2 and cpu_linear.packed_weight(model[0].weight) is None
    assert "forward" not in model[0].__dict__
    monkeypatch.setenv("DRAFTSMITH_ONEDNN", "0")
    assert cpu_linear.pack_linears(frozen_mlp()) == 0


@pytest.mark.parametrize("rows", [1, 7, 8, 40])
def test_vocab_logits_of_a_packed_head(rows, no_torch_linear):
    head = torch.nn.Linear(64, 5000, bias=False).requires_grad_(False)
    cpu_linear.pack_linears(head)
    hidden = torch.randn(rows, 64)
    with torch.no_grad():
        logits = vocab_logits(hidden, head.weight)
    torch.testing.assert_close(logits, hidden @ head.weight.T, rtol=1e-5, atol=1e-4)
    assert logits.argmax(-1).tolist() == (hidden @ head.weight.T).argmax(-1).tolist()
