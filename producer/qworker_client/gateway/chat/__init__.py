"""Chat and text completions: an OpenAI request body as jobs, and the jobs' output as OpenAI's
bodies and chunks."""
