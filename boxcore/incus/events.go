package incus

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"strings"
	"time"
)

// Event is one message of /1.0/events. Lifecycle events carry their action ("instance-started")
// and source ("/1.0/instances/NAME") in Metadata; Location is the cluster member it happened on.
type Event struct {
	Type      string          `json:"type"`
	Timestamp time.Time       `json:"timestamp"`
	Location  string          `json:"location"`
	Project   string          `json:"project"`
	Metadata  json.RawMessage `json:"metadata"`
}

// Lifecycle is a lifecycle event's metadata.
type Lifecycle struct {
	Action  string         `json:"action"`
	Source  string         `json:"source"`
	Context map[string]any `json:"context"`
}

// Lifecycle decodes the metadata of a lifecycle event (ok false for other types).
func (e Event) Lifecycle() (Lifecycle, bool) {
	var l Lifecycle
	if e.Type != "lifecycle" || json.Unmarshal(e.Metadata, &l) != nil {
		return Lifecycle{}, false
	}
	return l, true
}

// Instance is the instance a lifecycle event's source names ("" for other sources).
func (l Lifecycle) Instance() string {
	rest, ok := strings.CutPrefix(l.Source, "/1.0/instances/")
	if !ok {
		return ""
	}
	name, _, _ := strings.Cut(rest, "?")
	name, _, _ = strings.Cut(name, "/") // a snapshot's or a log's source: still the instance
	if n, err := url.PathUnescape(name); err == nil {
		return n
	}
	return name
}

// EventStream is a subscription to /1.0/events.
type EventStream struct {
	C    <-chan Event // closed when the stream ends; Err says why
	err  error
	done chan struct{}
	stop func()
}

// Err is why the stream ended (nil while it runs, or when Close ended it).
func (s *EventStream) Err() error {
	select {
	case <-s.done:
		return s.err
	default:
		return nil
	}
}

// Close ends the subscription.
func (s *EventStream) Close() { s.stop(); <-s.done }

// Events subscribes to the daemon's events of the given types (e.g. "lifecycle"). The
// subscription is live once Events returns: what happens after that is delivered.
func (c *Client) Events(ctx context.Context, types ...string) (*EventStream, error) {
	path := "/1.0/events"
	if len(types) > 0 {
		path += "?type=" + url.QueryEscape(strings.Join(types, ","))
	}
	cn, err := c.dialWS(ctx, path)
	if err != nil {
		return nil, fmt.Errorf("subscribing to %s: %w", path, err)
	}
	ch := make(chan Event, 64)
	s := &EventStream{C: ch, done: make(chan struct{})}
	stopped := make(chan struct{})
	s.stop = func() {
		select {
		case <-stopped:
		default:
			close(stopped)
		}
		cn.Close()
	}
	go func() {
		select {
		case <-ctx.Done():
		case <-stopped:
		case <-s.done:
		}
		cn.Close()
	}()
	go func() {
		defer close(s.done)
		defer close(ch)
		for {
			var e Event
			if err := cn.ReadJSON(&e); err != nil {
				select {
				case <-stopped:
				default:
					if ctx.Err() != nil {
						s.err = ctx.Err()
					} else {
						s.err = fmt.Errorf("event stream: %w", err)
					}
				}
				return
			}
			select {
			case ch <- e:
			case <-stopped:
				return
			case <-ctx.Done():
				s.err = ctx.Err()
				return
			}
		}
	}()
	return s, nil
}
