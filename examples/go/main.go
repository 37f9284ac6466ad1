// A qworker producer and consumer in Go (go-redis), following docs/protocol.md only.
//
//	go run . produce "Write a haiku about queues" [field=value ...]   # prints the job id
//	go run . consume JOB_ID                                           # streams its text
//	go run . run "Write a haiku about queues" [field=value ...]       # both
//
// Env: REDIS_URL (default redis://127.0.0.1:6379/0), QW_PREFIX (default qw), QW_TIMEOUT (s).
// Exit 0 on `done`, 1 on `error`, 2 on timeout or a usage error.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

const blockFor = 5 * time.Second

func env(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}

var prefix = env("QW_PREFIX", "qw")

// submit XADDs one job with our own id, so its output key is known before XADD returns.
func submit(ctx context.Context, rdb *redis.Client, prompt string, extra []string) (string, error) {
	buf := make([]byte, 16)
	if _, err := rand.Read(buf); err != nil {
		return "", err
	}
	id := "go" + hex.EncodeToString(buf)
	// Every value is a string on the wire: numbers in decimal, lists as JSON.
	values := []string{"id", id, "max_tokens", "64"}
	if prompt != "" {
		values = append(values, "prompt", prompt)
	}
	for _, arg := range extra {
		field, value, ok := strings.Cut(arg, "=")
		if !ok || field == "" {
			return "", fmt.Errorf("expected field=value, got %q", arg)
		}
		values = append(values, field, value)
	}
	err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: prefix + ":jobs", Values: dedupe(values)}).Err()
	return id, err
}

// dedupe keeps the last value of each field (a field given twice is an error on the wire).
func dedupe(pairs []string) []string {
	index := map[string]int{}
	var out []string
	for i := 0; i+1 < len(pairs); i += 2 {
		if at, seen := index[pairs[i]]; seen {
			out[at+1] = pairs[i+1]
			continue
		}
		index[pairs[i]] = len(out)
		out = append(out, pairs[i], pairs[i+1])
	}
	return out
}

// consume reads qw:out:<id> from the start until `done` or `error`, printing the text live.
func consume(ctx context.Context, rdb *redis.Client, id string, timeout time.Duration) int {
	key := prefix + ":out:" + id
	last := "0-0"
	// Token indices below next were printed. After Redis lost its last writes (AOF everysec, a
	// failover) the job runs again from what the stream still holds and re-appends indices we
	// have seen, maybe a second `done`: skip those, and stop at the first terminal event.
	next := 0
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		streams, err := rdb.XRead(ctx, &redis.XReadArgs{
			Streams: []string{key, last}, Count: 512, Block: blockFor,
		}).Result()
		if errors.Is(err, redis.Nil) {
			continue // nothing new within blockFor
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "redis:", err) // dropped connection: retry from `last`
			time.Sleep(500 * time.Millisecond)
			continue
		}
		for _, msg := range streams[0].Messages {
			last = msg.ID
			if field(msg.Values, "type") == "token" {
				i, err := strconv.Atoi(field(msg.Values, "i"))
				if err == nil && i < next {
					continue // seen before the stream rolled back
				}
				if err == nil {
					next = i + 1
				}
			}
			if code, end := handle(msg.Values); end {
				return code
			}
		}
	}
	fmt.Fprintf(os.Stderr, "no end of job %s within %s\n", id, timeout)
	return 2
}

func field(values map[string]interface{}, name string) string {
	s, _ := values[name].(string)
	return s
}

// handle prints one event; it says whether the job ended, and with which exit code.
func handle(values map[string]interface{}) (int, bool) {
	switch field(values, "type") {
	case "token":
		fmt.Print(field(values, "text"))
	case "done":
		fmt.Println()
		fmt.Fprintf(os.Stderr, "finish_reason=%s prompt_tokens=%s completion_tokens=%s "+
			"ttft_ms=%s total_ms=%s\n", field(values, "finish_reason"),
			field(values, "prompt_tokens"), field(values, "completion_tokens"),
			field(values, "ttft_ms"), field(values, "total_ms"))
		return 0, true
	case "error":
		fmt.Fprintf(os.Stderr, "error %s: %s\n", field(values, "code"), field(values, "message"))
		return 1, true
	}
	return 0, false
}

func main() {
	os.Exit(run(os.Args[1:]))
}

func run(args []string) int {
	if len(args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: go run . produce PROMPT [field=value ...] | consume JOB_ID | run PROMPT [field=value ...]")
		return 2
	}
	opts, err := redis.ParseURL(env("REDIS_URL", "redis://127.0.0.1:6379/0"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "REDIS_URL:", err)
		return 2
	}
	rdb := redis.NewClient(opts)
	defer rdb.Close()
	ctx := context.Background()
	seconds, err := strconv.Atoi(env("QW_TIMEOUT", "300"))
	if err != nil {
		seconds = 300
	}
	timeout := time.Duration(seconds) * time.Second

	switch args[0] {
	case "produce", "run":
		id, err := submit(ctx, rdb, args[1], args[2:])
		if err != nil {
			fmt.Fprintln(os.Stderr, "XADD:", err)
			return 1
		}
		if args[0] == "produce" {
			fmt.Println(id)
			return 0
		}
		return consume(ctx, rdb, id, timeout)
	case "consume":
		return consume(ctx, rdb, args[1], timeout)
	}
	fmt.Fprintln(os.Stderr, "unknown command", args[0])
	return 2
}
