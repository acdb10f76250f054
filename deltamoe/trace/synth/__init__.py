"""Synthetic multi-rank Kineto traces with known ground truth (stragglers, bubbles, breakdown)."""

from deltamoe.trace.synth.generate import generate
from deltamoe.trace.synth.layout import SynthConfig

__all__ = ["SynthConfig", "generate"]
