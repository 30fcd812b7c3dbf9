"""The in-process communicator tests run ranks on (`shardwise.comm.in_process`)."""

from shardwise.comm.in_process import ThreadedRank, ThreadedWorld

__all__ = ["ThreadedRank", "ThreadedWorld"]
