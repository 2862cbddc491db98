"""Memory reliefs near the cap, one file each: autocast, activation checkpointing, channel pruning.

Owned by the ladder (ladder.py), which is the only caller; each file touches what its docstring says.
"""
