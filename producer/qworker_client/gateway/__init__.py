"""An OpenAI-compatible HTTP gateway over the queue (`qworker gateway`, extra `[gateway]`).

Just another producer: a request becomes jobs on `<prefix>:jobs`, their output streams come back
as OpenAI responses or server-sent events. It holds no model and keeps no state of its own beyond
Redis, so any number run side by side. See docs/gateway.md.
"""
