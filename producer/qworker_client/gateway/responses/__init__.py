"""OpenAI's Responses API (`/v1/responses`), kept in Redis: a response is a chat job and a record
beside it, so any gateway serves it, and a background one outlives the gateway that made it."""
