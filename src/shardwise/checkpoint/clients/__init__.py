"""Other libraries' values in checkpoints: one module per client (Megatron-Core,
PhysicsNeMo), registered as value adapters.
"""
