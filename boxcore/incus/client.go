// Package incus is claudebox's small typed client for the Incus REST API.
//
// It speaks to the local daemon over its Unix socket, or to an HTTPS remote configured in
// the incus CLI's config.yml. Every call takes a context; asynchronous responses
// (operations) are waited on with /1.0/operations/<id>/wait, honouring the context's deadline.
//
// Errors: errors.Is(err, ErrNotFound) for 404, errors.Is(err, ErrConflict) for 409 and
// "already exists"; *StatusError for any other API error; *DaemonUnreachableError when the
// daemon's socket is missing or refuses connections.
//
// Only the endpoints claudebox needs are covered. JSON field names follow Incus's API.
package incus

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/gorilla/websocket"
)

// DefaultSocket is where the Incus daemon listens when neither INCUS_SOCKET nor INCUS_DIR is set.
const DefaultSocket = "/var/lib/incus/unix.socket"

// Client talks to one Incus server. It is safe for concurrent use.
type Client struct {
	base string // scheme://host, no trailing slash, e.g. "http://unix.socket"
	hc   *http.Client
	ws   *websocket.Dialer
	// beforeSockets, set only by tests, runs between an exec's POST and its websockets.
	beforeSockets func()
	remote        string // "local" or the remote's name
	socket        string // Unix socket path, "" for HTTP(S)

	// server is the last answer to GET /1.0 and when it came (Server).
	serverMu sync.Mutex
	server   Server
	serverAt time.Time
}

// LocalSocket returns the Unix socket path of the local daemon: $INCUS_SOCKET, else
// $INCUS_DIR/unix.socket, else DefaultSocket.
func LocalSocket() string {
	if s := os.Getenv("INCUS_SOCKET"); s != "" {
		return s
	}
	if d := os.Getenv("INCUS_DIR"); d != "" {
		return filepath.Join(d, "unix.socket")
	}
	return DefaultSocket
}

// NewUnixClient returns a client for the daemon listening on socketPath. It does not connect.
func NewUnixClient(socketPath string) *Client {
	dial := func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", socketPath)
	}
	tr := &http.Transport{
		DialContext:         dial,
		MaxIdleConns:        16,
		MaxIdleConnsPerHost: 16,
		IdleConnTimeout:     30 * time.Second,
		DisableCompression:  true,
	}
	return &Client{
		base:   "http://unix.socket",
		hc:     &http.Client{Transport: tr},
		ws:     &websocket.Dialer{NetDialContext: dial, HandshakeTimeout: 10 * time.Second},
		remote: "local",
		socket: socketPath,
	}
}

// NewHTTPClient returns a client for an Incus API served at baseURL (http:// or https://),
// using hc (nil means http.DefaultClient). Websockets reuse hc's transport TLS settings and
// dialer when it is an *http.Transport. Used for HTTPS remotes and for tests with httptest.
func NewHTTPClient(baseURL string, hc *http.Client) *Client {
	if hc == nil {
		hc = http.DefaultClient
	}
	d := &websocket.Dialer{HandshakeTimeout: 10 * time.Second, Proxy: http.ProxyFromEnvironment}
	if tr, ok := hc.Transport.(*http.Transport); ok {
		d.TLSClientConfig = tr.TLSClientConfig
		if tr.DialContext != nil {
			d.NetDialContext = tr.DialContext
		}
	}
	return &Client{
		base:   strings.TrimRight(baseURL, "/"),
		hc:     hc,
		ws:     d,
		remote: baseURL,
	}
}

// Remote returns "local" for the Unix socket client, the remote's name for a client made by
// Connect, or the base URL for one made by NewHTTPClient.
func (c *Client) Remote() string { return c.remote }

// response is Incus's standard envelope.
type response struct {
	Type       string          `json:"type"` // sync, async, error
	Status     string          `json:"status"`
	StatusCode int             `json:"status_code"`
	Operation  string          `json:"operation"`
	ErrorCode  int             `json:"error_code"`
	Error      string          `json:"error"`
	Metadata   json.RawMessage `json:"metadata"`
}

// reqOpts carries the optional parts of a request.
type reqOpts struct {
	body        io.Reader
	contentType string
	header      http.Header
	etag        string
}

// do sends a request and decodes Incus's envelope. A non-2xx status or an "error" envelope
// becomes an error. The ETag of the response is returned too.
func (c *Client) do(ctx context.Context, method, path string, in any, opts *reqOpts) (*response, string, error) {
	resp, err := c.raw(ctx, method, path, in, opts)
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	var r response
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
		if resp.StatusCode >= 300 {
			return nil, "", &StatusError{Code: resp.StatusCode, Message: http.StatusText(resp.StatusCode), Method: method, Path: path}
		}
		return nil, "", fmt.Errorf("incus: %s %s: decoding response: %w", method, path, err)
	}
	if r.Type == "error" || resp.StatusCode >= 300 {
		code := r.ErrorCode
		if code == 0 {
			code = resp.StatusCode
		}
		msg := r.Error
		if msg == "" {
			msg = http.StatusText(code)
		}
		return nil, "", &StatusError{Code: code, Message: msg, Method: method, Path: path}
	}
	return &r, resp.Header.Get("ETag"), nil
}

// raw sends a request and returns the HTTP response with its body unread. in, when not nil
// and opts.body is nil, is JSON-encoded as the body.
func (c *Client) raw(ctx context.Context, method, path string, in any, opts *reqOpts) (*http.Response, error) {
	if opts == nil {
		opts = &reqOpts{}
	}
	body := opts.body
	ctype := opts.contentType
	if body == nil && in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return nil, fmt.Errorf("incus: encoding %s %s: %w", method, path, err)
		}
		body = bytes.NewReader(b)
		ctype = "application/json"
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, body)
	if err != nil {
		return nil, fmt.Errorf("incus: %w", err)
	}
	for k, v := range opts.header {
		req.Header[k] = v
	}
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	if opts.etag != "" {
		req.Header.Set("If-Match", opts.etag)
	}
	req.Header.Set("User-Agent", "claudebox")
	start := time.Now()
	resp, err := c.hc.Do(req)
	if traceRequests {
		status := "error"
		if err == nil {
			status = resp.Status
		}
		fmt.Fprintf(os.Stderr, "incus: +%.3fs %s %s: %s in %.1f ms\n", start.Sub(traceStart).Seconds(), method, path, status, float64(time.Since(start).Microseconds())/1000)
	}
	if err != nil {
		return nil, c.transportError(ctx, method, path, err)
	}
	return resp, nil
}

// traceRequests (CLAUDEBOX_TRACE set) prints every API request with its status and how long
// the daemon took to answer it (an operation's wait request: how long the operation ran).
var traceRequests = os.Getenv("CLAUDEBOX_TRACE") != ""

// traceStart: trace lines say when each request started, from here (the process's start).
var traceStart = time.Now()

// TraceStep prints, when CLAUDEBOX_TRACE is set, a step of claudebox's own that began at
// start (the kernel work of a bind round), in the request trace's format.
func TraceStep(kind, what string, start time.Time) {
	if traceRequests {
		fmt.Fprintf(os.Stderr, "%s: +%.3fs %s in %.1f ms\n", kind, start.Sub(traceStart).Seconds(), what, float64(time.Since(start).Microseconds())/1000)
	}
}

// transportError maps a failed round trip: context errors stay context errors, a missing or
// refusing Unix socket becomes *DaemonUnreachableError.
func (c *Client) transportError(ctx context.Context, method, path string, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("incus: %s %s: %w", method, path, ctx.Err())
	}
	if c.socket != "" && errors.Is(err, os.ErrPermission) {
		return &SocketPermissionError{Socket: c.socket, Err: err}
	}
	if isUnreachable(err) {
		return &DaemonUnreachableError{Socket: c.socket, Remote: c.remoteAddr(), Err: err}
	}
	return fmt.Errorf("incus: %s %s: %w", method, path, err)
}

func (c *Client) remoteAddr() string {
	if c.socket != "" {
		return ""
	}
	return c.base
}

func isUnreachable(err error) bool {
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "dial" {
		return true
	}
	return errors.Is(err, os.ErrNotExist)
}

// get decodes the metadata of a sync GET into out and returns the ETag.
func (c *Client) get(ctx context.Context, path string, out any) (string, error) {
	r, etag, err := c.do(ctx, http.MethodGet, path, nil, nil)
	if err != nil {
		return "", err
	}
	if out != nil {
		if err := json.Unmarshal(r.Metadata, out); err != nil {
			return "", fmt.Errorf("incus: GET %s: decoding metadata: %w", path, err)
		}
	}
	return etag, nil
}

// call sends a request and, when the answer is an operation, waits for it. It returns the
// final operation (nil for a sync answer).
func (c *Client) call(ctx context.Context, method, path string, in any, opts *reqOpts) (*Operation, error) {
	id, err := c.start(ctx, method, path, in, opts)
	if err != nil || id == "" {
		return nil, err
	}
	return c.WaitOperation(ctx, id, nil)
}

// start sends a request and returns the id of the operation it started, without waiting; ""
// when the daemon answered synchronously (it is done).
func (c *Client) start(ctx context.Context, method, path string, in any, opts *reqOpts) (string, error) {
	r, _, err := c.do(ctx, method, path, in, opts)
	if err != nil {
		return "", err
	}
	if r.Type != "async" {
		return "", nil
	}
	op, err := decodeOp(r)
	if err != nil {
		return "", err
	}
	return op.ID, nil
}

func decodeOp(r *response) (*Operation, error) {
	var op Operation
	if err := json.Unmarshal(r.Metadata, &op); err != nil {
		return nil, fmt.Errorf("incus: decoding operation: %w", err)
	}
	if op.ID == "" && r.Operation != "" {
		op.ID = pathBase(r.Operation)
	}
	return &op, nil
}

func pathBase(p string) string {
	if i := strings.LastIndex(p, "/"); i >= 0 {
		return p[i+1:]
	}
	return p
}

// esc escapes one path segment (an instance, network or profile name).
func esc(s string) string { return url.PathEscape(s) }
