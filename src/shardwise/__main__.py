"""`python -m shardwise ...` is the `shardwise` command."""

from .cli import run

run()
