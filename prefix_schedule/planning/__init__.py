"""A step's data and how it is cut up: groups and trajectories, microbatch packing, data-parallel
placement, and the FLOP model that both use. No torch.distributed, no Megatron."""
