"""Checkpoints in one process, with no process group: open, inspect, verify,
convert and reshard.
"""
