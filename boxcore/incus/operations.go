package incus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
)

// Operation is an Incus background operation (/1.0/operations/<id>).
type Operation struct {
	ID          string              `json:"id"`
	Class       string              `json:"class"`
	Description string              `json:"description"`
	CreatedAt   time.Time           `json:"created_at"`
	UpdatedAt   time.Time           `json:"updated_at"`
	Status      string              `json:"status"`
	StatusCode  int                 `json:"status_code"`
	Resources   map[string][]string `json:"resources"`
	Metadata    map[string]any      `json:"metadata"`
	MayCancel   bool                `json:"may_cancel"`
	Err         string              `json:"err"`
	Location    string              `json:"location"`
}

// opSuccess is Incus's status code of a finished, successful operation (shared/api/status_code.go).
const opSuccess = 200

func (op *Operation) done() bool { return op.StatusCode >= 200 }

// err returns the operation's failure as a *StatusError, or nil on success.
func (op *Operation) err() error {
	if op.StatusCode == opSuccess || op.StatusCode < 200 {
		return nil
	}
	msg := op.Err
	if msg == "" {
		msg = op.Status
	}
	return &StatusError{Code: op.StatusCode, Message: msg, Operation: op.ID}
}

// ProgressEvent reports an operation's progress as published in its metadata.
type ProgressEvent struct {
	Key     string // metadata key, e.g. "download_progress", "create_instance_from_image_unpack_progress"
	Text    string // the daemon's text, e.g. "rootfs: 42% (12.3MB/s)"
	Percent int    // parsed percentage, -1 when the text holds none
}

// WaitOperation waits for operation id to finish and returns it. A failed or cancelled
// operation returns its error text as a *StatusError. The wait honours ctx: each
// /wait call's timeout is capped by ctx's deadline, and cancelling ctx aborts the request.
// When progress is not nil the operation is polled about every 250 ms and each change of a
// progress-like metadata value is reported.
func (c *Client) WaitOperation(ctx context.Context, id string, progress func(ProgressEvent)) (*Operation, error) {
	seen := map[string]string{}
	for {
		secs := 30
		if progress != nil {
			secs = 1 // poll for progress; the wait returns early when the op ends
		}
		if dl, ok := ctx.Deadline(); ok {
			left := time.Until(dl)
			if left <= 0 {
				return nil, fmt.Errorf("incus: waiting for operation %s: %w", id, context.DeadlineExceeded)
			}
			if s := int(math.Ceil(left.Seconds())); s < secs {
				secs = s
			}
		}
		var op Operation
		_, err := c.get(ctx, "/1.0/operations/"+esc(id)+"/wait?timeout="+strconv.Itoa(secs), &op)
		if err != nil {
			if ctx.Err() != nil {
				return nil, fmt.Errorf("incus: waiting for operation %s: %w", id, ctx.Err())
			}
			// The daemon answers /wait for a failed operation with an error envelope
			// carrying the operation's err text (code 500 usually): report it as the
			// operation's failure. "Operation not found" is about the wait itself.
			var se *StatusError
			// A wait whose timeout ran out before the operation ended is answered with the
			// error "context deadline exceeded" (measured on 6.0.4): not the operation's
			// failure, just the end of this wait. Wait again.
			if errors.As(err, &se) && se.Operation == "" && se.Message == "context deadline exceeded" {
				continue
			}
			if errors.As(err, &se) && se.Operation == "" && se.Message != "Operation not found" {
				return nil, &StatusError{Code: se.Code, Message: se.Message, Operation: id}
			}
			return nil, err
		}
		if progress != nil {
			reportProgress(op.Metadata, seen, progress)
		}
		if op.done() {
			return &op, op.err()
		}
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("incus: waiting for operation %s: %w", id, err)
		}
	}
}

// RunningOperations lists the daemon's running operations (GET /1.0/operations, recursion 1).
func (c *Client) RunningOperations(ctx context.Context) ([]Operation, error) {
	var byStatus map[string][]Operation
	if _, err := c.get(ctx, "/1.0/operations?recursion=1", &byStatus); err != nil {
		return nil, err
	}
	return byStatus["running"], nil
}

// CancelOperation asks the daemon to cancel an operation (DELETE), for those that allow it.
func (c *Client) CancelOperation(ctx context.Context, id string) error {
	_, _, err := c.do(ctx, "DELETE", "/1.0/operations/"+esc(id), nil, nil)
	return err
}

func reportProgress(md map[string]any, seen map[string]string, progress func(ProgressEvent)) {
	for k, v := range md {
		var text string
		switch {
		case k == "progress":
			// Newer daemons: {"stage": ..., "percent": ..., "speed": ...}.
			m, ok := v.(map[string]any)
			if !ok {
				continue
			}
			b, _ := json.Marshal(m)
			text = string(b)
			if text == seen[k] {
				continue
			}
			seen[k] = text
			ev := ProgressEvent{Key: fmt.Sprint(m["stage"]), Text: text, Percent: -1}
			if p, err := strconv.Atoi(fmt.Sprint(m["percent"])); err == nil {
				ev.Percent = p
			}
			progress(ev)
			continue
		case strings.HasSuffix(k, "_progress"):
			s, ok := v.(string)
			if !ok {
				continue
			}
			text = s
		default:
			continue
		}
		if text == seen[k] {
			continue
		}
		seen[k] = text
		progress(ProgressEvent{Key: k, Text: text, Percent: parsePercent(text)})
	}
}

// parsePercent finds "NN%" in s.
func parsePercent(s string) int {
	i := strings.IndexByte(s, '%')
	if i <= 0 {
		return -1
	}
	j := i
	for j > 0 && s[j-1] >= '0' && s[j-1] <= '9' {
		j--
	}
	p, err := strconv.Atoi(s[j:i])
	if err != nil {
		return -1
	}
	return p
}
