"""Multi-device replicas in plain torch.distributed: the replica's process group (`group`), Ulysses sequence
parallelism for diffusers' MiniMax-H3 transformer (`sequence`), rank-consistent Cache-DiT decisions
(`cache_decision`), the rank-sharded AdaLN rebuild (`adaln`) and a local multi-process launcher (`launch`).
Nothing here knows about Ray: the GPU worker actors call these."""
