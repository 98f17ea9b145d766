"""Rollout: the `RolloutEngine` contract and the HF backend (base.py), the native backend (native.py:
a loop over scheduler.py, which decides what runs where, and runner.py, which runs it on model.py
with graphs.py's CUDA graphs, kernels.py's Triton kernels and vmm.py's stable buffers), vLLM
(vllm.py), and `build_rollout` (build.py), which picks one.
"""
