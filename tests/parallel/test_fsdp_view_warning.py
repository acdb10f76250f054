"""The one FSDP2 warning the training step silences (a decoder layer hands back its AttnRes bank, whose
entries are views; they are only read): for the plain layer and the same layer under --ac (wrapped by
activation checkpointing), and no other warning."""

from __future__ import annotations

import warnings

import pytest

from deltamoe.parallel.data_parallel import fsdp_view_warning_ignored

TAIL = " returned a view tensor. This can produce wrong gradients."


@pytest.mark.parametrize("module", ["FSDPDecoderLayer", "FSDPCheckpointWrapper"])
def test_the_layers_view_warning_is_silenced(module):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with fsdp_view_warning_ignored():
            warnings.warn(f"FSDP2-wrapped module ({module}){TAIL}")
    assert seen == []


def test_another_modules_view_warning_still_shows():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with fsdp_view_warning_ignored():
            warnings.warn(f"FSDP2-wrapped module (FSDPLinear){TAIL}")
    assert len(seen) == 1
