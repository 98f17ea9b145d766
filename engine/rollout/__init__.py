"""Rollout: the `RolloutEngine` contract and the HF backend (base.py), the native backend (native.py
on model.py, with kernels.py's Triton kernels and vmm.py's stable buffers), vLLM (vllm.py), and
`build_rollout` (build.py), which picks one.
"""
