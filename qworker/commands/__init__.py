"""One module per `qworker` sub-command; each has `register(subparsers)` and imports heavy
dependencies (torch, the engine) only inside the function that runs the command."""
