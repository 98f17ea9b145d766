"""Rollout: the `RolloutEngine` protocol (base.py), its backends (native.py on model.py, vllm.py, and
the HF one in base.py) and `build_rollout` (build.py), which picks one.
"""
