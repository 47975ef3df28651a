"""What runs inside a prefix-reuse step: executor, stage runner, p2p, hooks, layer and MoE handling, the agreed refusal."""
