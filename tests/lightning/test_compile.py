"""``torch.compile`` with the Trainer plugin, the ways Lightning documents it (issue 16).

Both get per-layer scales inside the compiled backward (``tests/scaling/test_compiled.py``): a compiled
submodule, and a LightningModule compiled whole, whose ``training_step`` Lightning wraps with dynamo.
``backend="aot_eager"`` builds the same compiled autograd Function as inductor without generating code,
so these stay fast on the CPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import Classifier, loader, make_trainer

from gs_lightning import GradientScalingPlugin


def _compile_module(model: Classifier) -> Classifier:
    return torch.compile(model, backend="aot_eager")


def _compile_submodule(model: Classifier) -> Classifier:
    model.net = torch.compile(model.net, backend="aot_eager")
    return model


@pytest.mark.parametrize("compile_", [_compile_module, _compile_submodule], ids=["LightningModule", "submodule"])
def test_a_compiled_model_trains_with_the_plugin_and_gets_per_layer_scales(compile_) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, reference = Classifier(), Classifier()
    reference.load_state_dict(model.state_dict())
    # emulate=False: under the emulation a CPU gets by default, torch.compile runs the model eagerly
    plugin, reference_plugin = GradientScalingPlugin(emulate=False), GradientScalingPlugin(emulate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(plugin, max_steps=3).fit(compile_(model), loader())
        make_trainer(reference_plugin, max_steps=3).fit(reference, loader())
    # The layers of the compiled net, named and scaled as in the eager model; no opaque unit.
    assert [layer.name for layer in plugin.scaler.layers()] == [
        layer.name for layer in reference_plugin.scaler.layers()
    ]
    (compiled,) = plugin.scaler.compiled_modules
    assert compiled.eager_reason is None and compiled._vectors
    assert plugin.scaler.skipped_steps == 0
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=1e-4)  # fp16: the two backward graphs round alike, not equally
