#!/usr/bin/env bash
# Cancel a qworker job (docs/protocol.md, "Cancelling"): a running job ends with finish_reason
# cancelled within one engine step.   ./cancel.sh JOB_ID     Env: REDIS_URL, QW_PREFIX.
# The flag lives no longer than the workers' result_ttl (3600 s by default): a flag that outlived
# the job's output would cancel a later job reusing the id.
set -euo pipefail
redis-cli -u "${REDIS_URL:-redis://127.0.0.1:6379/0}" SET "${QW_PREFIX:-qw}:cancel:${1:?usage: cancel.sh JOB_ID}" 1 EX "${QW_RESULT_TTL:-3600}" >/dev/null
