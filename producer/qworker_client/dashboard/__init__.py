"""The web dashboard (docs/dashboard.md): the fleet's queues, workers, jobs and dead letters from
Redis alone, served by the gateway at `/dashboard` or alone by `qworker dashboard`."""
