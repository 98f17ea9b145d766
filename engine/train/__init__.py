"""Training: the FSDP2 engine (fsdp.py) and the attention it plugs into transformers (varlen.py for
packed rows, ulysses.py for sequence parallelism).
"""
