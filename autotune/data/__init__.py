"""The data pipeline: the DataLoader AutoTrainer builds, or your own, resumed on the same samples.

`pipeline` (the DataLoader, input profiling, rebuilds), `cache` (decoded samples in shared memory),
`sampler` (one seeded permutation and a cursor), `tensors` (a TensorDataset fetched a batch at a time),
`user_loader` (your own DataLoader resumed).

Owns where the samples come from and which are done. May import the run folder and everything below;
`autotune.training` and `autotune.trainer` import it.
Touches nothing itself: the folder's modules say what each touches.
"""
