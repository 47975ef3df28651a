"""The declared source patches to megatron-core, their registry and operations."""
