"""Reading by job id on a Redis Cluster, where a job's keys live in its model's hash slot
(docs/protocol.md, "Redis Cluster"): each model's view of the keys, and the view that holds a
given job. On one Redis there is one view, the keys as they are."""

from __future__ import annotations

from collections.abc import Sequence

import redis

from qworker_client.connect import is_cluster_client
from qworker_client.protocol import Keys


def slot_views(client: redis.Redis, keys: Keys, streams: Sequence[str]) -> list[Keys]:
    """The keys of each model's slot whose streams are among `streams` (on one Redis: `keys`)."""
    if not is_cluster_client(client):
        return [keys]
    models = dict.fromkeys(m for s in streams if (m := keys.stream_model(s)) is not None)
    return [keys.in_slot(model) for model in models]


def job_view(client: redis.Redis, keys: Keys, job_id: str, streams: Sequence[str]) -> Keys:
    """The keys of job `job_id`: on a Cluster, those of the first model (of `streams`) whose
    slot holds its output, submit marker or owner hash; `keys` when none does, or on one Redis."""
    if not is_cluster_client(client):
        return keys
    views = slot_views(client, keys, streams)
    pipe = client.pipeline(transaction=False)
    for view in views:
        pipe.exists(view.out(job_id), view.submitted(job_id), view.owner(job_id))
    return next((view for view, found in zip(views, pipe.execute(), strict=True) if found),
                keys)
