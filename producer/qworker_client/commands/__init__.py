"""One module per client sub-command (`submit`, `tail`, `stats`, `batch`); each has
`register(subparsers)`. The worker's sub-commands come through `worker.py`."""
