"""Deployment planner: costs from a ModelConfig, a hardware catalog, layout search and estimates.

Depends only on `deltamoe.config` and `deltamoe.errors` (DESIGN.md, dependency direction).
"""
