"""OpenAI's Files and Batch APIs on qworker's batch runner."""
