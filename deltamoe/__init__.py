"""deltamoe: the Kimi hybrid-attention MoE family in readable PyTorch."""
__version__ = "0.1.0"
