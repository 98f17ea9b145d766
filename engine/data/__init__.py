"""Data: prompt, example and pair files (prompts.py), the embedded task (task.py), raw-file
conversion (convert.py), and rewards: rule functions (rewards.py, sandbox.py) and a learned
reward model (reward_model.py).
"""
