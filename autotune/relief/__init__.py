"""Memory reliefs near the cap, one file each: autocast, activation checkpointing, channel pruning."""
