"""Activation offload (parallel/offload.py) on one process: gradients equal the run without it, alone and
with activation checkpointing, and the hooks account for what they move. (Under the interleaved
pipeline schedule: tests/parallel/test_distributed.py, case pp2_interleaved_ac_offload.)"""

import pytest
import torch

from deltamoe.errors import ConfigError
from deltamoe.model.load import build_model
from deltamoe.parallel import ParallelDims, parallelize
from deltamoe.parallel.offload import SavedBytesCounter
from tests.parallel.dist_job import global_batch, k31_toy

CONFIG = k31_toy()


def step(dims: ParallelDims) -> tuple[dict[str, torch.Tensor], int, int, float]:
    """Gradients by published name, bytes moved by offload, bytes saved outside it, loss."""
    model = build_model(CONFIG, seed=0).train()
    params = [p for p in model.parameters()]
    pm = parallelize(model, dims, None)
    ids, labels = global_batch(CONFIG)
    with SavedBytesCounter(params) as counter:
        result = pm.forward_backward(ids, labels)
    moved = pm.offload_stats.take() if pm.offload_stats is not None else 0
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
    return grads, moved, counter.bytes, float(result.loss)


@pytest.fixture(scope="module")
def baseline():
    return step(ParallelDims())


@pytest.mark.parametrize("dims", [ParallelDims(offload_activations="layer"),
                                  ParallelDims(offload_activations="attn,mlp"),
                                  ParallelDims(activation_checkpointing=True),
                                  ParallelDims(activation_checkpointing=True, offload_activations="layer")],
                         ids=["layer", "attn_mlp", "ac", "ac_layer"])
def test_gradients_equal_the_run_without_offload(baseline, dims):
    ref_grads, _, resident, ref_loss = baseline
    grads, moved, kept, loss = step(dims)
    assert loss == ref_loss
    for name, g in ref_grads.items():
        if g is None:
            assert grads[name] is None or not grads[name].any(), name
        else:
            torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-7, msg=name)
    if dims.offload_activations == "layer" and not dims.activation_checkpointing:
        # Every trunk layer's saved tensors moved; what stays is the embedding, the heads and MTP.
        assert moved > 0.8 * resident and kept + moved == resident
    if dims.activation_checkpointing:
        assert kept + moved < 0.5 * resident  # checkpointing keeps only the layer inputs
    if dims.activation_checkpointing and dims.offload_activations:
        # ... and offload moves those: 8 layers x (h + AttnRes bank) of [4, 12, 32] fp32 at least
        assert moved >= 8 * 4 * 12 * 32 * 4


@pytest.mark.parametrize("fields, hint", [({"offload_activations": "kv"}, "subset"),
                                          ({"offload_activations": "attn", "activation_checkpointing": True},
                                           "inside a checkpointed layer")])
def test_bad_offload_settings_name_the_field(fields, hint):
    with pytest.raises(ConfigError, match=hint) as e:
        ParallelDims(**fields).check_fields()
    assert e.value.field == "offload_activations"
