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
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/gorilla/websocket"
)

// ExecRequest describes a command to run inside an instance.
type ExecRequest struct {
	Command []string
	Env     map[string]string
	User    uint32 // uid; 0 is root
	Group   uint32 // gid
	Cwd     string
	// Stdin feeds the command's standard input in Exec (nil: empty input). ExecInteractive
	// takes its stdin as an argument instead.
	Stdin io.Reader

	// Resize, for ExecInteractive with a tty: each value {width, height} resizes the
	// terminal. Closing it or leaving it nil is fine.
	Resize <-chan [2]int
	// Signal, for ExecInteractive: each value is sent to the command as that signal number.
	Signal <-chan int
}

// ExecResult is the captured outcome of Exec.
type ExecResult struct {
	Stdout, Stderr []byte
	ExitCode       int
}

type execPost struct {
	Command          []string          `json:"command"`
	Environment      map[string]string `json:"environment,omitempty"`
	WaitForWebsocket bool              `json:"wait-for-websocket"`
	Interactive      bool              `json:"interactive"`
	Width            int               `json:"width,omitempty"`
	Height           int               `json:"height,omitempty"`
	User             uint32            `json:"user"`
	Group            uint32            `json:"group"`
	Cwd              string            `json:"cwd,omitempty"`
}

// Exec runs a command in a running instance and captures its output and exit code. A
// command that runs and exits non-zero is not an error: see ExitCode.
func (c *Client) Exec(ctx context.Context, inst string, req ExecRequest) (ExecResult, error) {
	var out, errb bytes.Buffer
	code, err := c.execWS(ctx, inst, req, false, req.Stdin, &out, &errb, 0, 0)
	return ExecResult{Stdout: out.Bytes(), Stderr: errb.Bytes(), ExitCode: code}, err
}

// attachFailed is Incus's error for an exec whose process could not be attached to the
// instance: its forkexec never reported a PID, so the command never ran. Measured on 6.0.4:
// a box with syscall interception (security.syscalls.intercept.mknod/setxattr, which the
// docker template first set) failed about one exec in twenty this way under a dozen
// concurrent ones; a box without it, none.
const attachFailed = "Failed to retrieve PID of executing child process"

// neverStarted: the exec failed before its command ran.
func neverStarted(err error) bool {
	var se *StatusError
	return errors.As(err, &se) && strings.Contains(se.Message, attachFailed)
}

// rewinder returns a function that puts stdin back where it was now, reporting whether it
// could: always for no stdin, for a reader that seeks when the seek works, never otherwise.
func rewinder(stdin io.Reader) func() bool {
	if stdin == nil {
		return func() bool { return true }
	}
	s, ok := stdin.(io.Seeker)
	if !ok {
		return func() bool { return false }
	}
	at, err := s.Seek(0, io.SeekCurrent)
	return func() bool {
		if err != nil {
			return false
		}
		_, serr := s.Seek(at, io.SeekStart)
		return serr == nil
	}
}

// ExecInteractive runs a command wired to the given streams and returns its exit code.
// With tty the command gets a terminal of width×height (stderr is merged into stdout by the
// terminal, so the stderr writer is unused); req.Resize resizes it. Without tty stdin,
// stdout and stderr are separate streams. stdin may be nil. A stdin that never reaches EOF
// (a terminal) is read by a goroutine that outlives the call until its next Read returns.
//
// The exit code is the one a shell gives: Incus reports a command that ended with 127 or 126
// as a failed operation ("Command not found", "Command not executable"); here those are the
// codes again, not errors.
func (c *Client) ExecInteractive(ctx context.Context, inst string, req ExecRequest, stdin io.Reader, stdout io.Writer, stderr io.Writer, tty bool, width, height int) (int, error) {
	if stdout == nil {
		stdout = io.Discard
	}
	if stderr == nil {
		stderr = io.Discard
	}
	code, err := c.execWS(ctx, inst, req, tty, stdin, stdout, stderr, width, height)
	if err != nil && ctx.Err() == nil {
		if n, ok := shellCode(err); ok {
			return n, nil
		}
	}
	return code, err
}

// shellCode is the exit code behind an exec operation's failure that only reports how the
// command ended: 127 (not found) or 126 (not executable).
func shellCode(err error) (int, bool) {
	var se *StatusError
	if !errors.As(err, &se) {
		return 0, false
	}
	switch msg := se.Message; {
	case strings.HasSuffix(msg, "Command not found"):
		return 127, true
	case strings.HasSuffix(msg, "Command not executable"):
		return 126, true
	}
	return 0, false
}

// execWS runs one exec. One the daemon could not start (see neverStarted) is asked for
// again, up to execAttempts times, when its stdin can be given again: none, or a reader that
// seeks. Nothing was written to stdout or stderr then: the command never ran.
func (c *Client) execWS(ctx context.Context, inst string, req ExecRequest, tty bool, stdin io.Reader, stdout, stderr io.Writer, width, height int) (int, error) {
	rewind := rewinder(stdin)
	for attempt := 1; ; attempt++ {
		code, err := c.execOnce(ctx, inst, req, tty, stdin, stdout, stderr, width, height)
		if err != nil && neverStarted(err) && attempt < execAttempts && ctx.Err() == nil && rewind() {
			continue
		}
		return code, err
	}
}

// execOnce is one exec operation: its websockets (asked for again while they stall), the
// streams, the operation's end.
func (c *Client) execOnce(ctx context.Context, inst string, req ExecRequest, tty bool, stdin io.Reader, stdout, stderr io.Writer, width, height int) (int, error) {
	op, conns, err := c.startExec(ctx, inst, req, tty, width, height)
	for attempt := 1; err != nil && errors.Is(err, errControlStalled) && attempt < stallAttempts && ctx.Err() == nil; attempt++ {
		// The control socket is connected first and the command starts only once the data
		// sockets are: it never ran, so it is asked for again, after a pause that grows (a CI
		// run's daemon, loaded by the whole suite, took over 10 s to answer one handshake;
		// another let its own 5 s bound for the sockets run out three times in a row).
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(attempt) * 500 * time.Millisecond):
		}
		op, conns, err = c.startExec(ctx, inst, req, tty, width, height)
	}
	if err != nil {
		return -1, err
	}
	defer conns.closeAll()
	stopCtl := make(chan struct{})
	defer close(stopCtl)
	ctlClosed := untilClosed(conns["control"])
	go controlLoop(ctx, &lockedConn{c: conns["control"]}, req, stopCtl, conns.closeAll)
	in := conns["0"]
	go feedStdin(in, stdin, tty)

	// Wait for the operation alongside the output.
	var final *Operation
	var opErr error
	opDone := make(chan struct{})
	go func() {
		final, opErr = c.WaitOperation(ctx, op.ID, nil)
		close(opDone)
	}()

	var wg sync.WaitGroup
	var outErr, errErr error
	outEnded := make(chan struct{})
	var outEndedOnce sync.Once
	wg.Add(1)
	go func() {
		defer wg.Done()
		outErr = pump(conns[outFD(tty)], stdout, func() { outEndedOnce.Do(func() { close(outEnded) }) })
	}()
	if !tty {
		wg.Add(1)
		go func() { defer wg.Done(); errErr = pump(conns["2"], stderr, func() {}) }()
	}
	pumped := make(chan struct{})
	go func() { wg.Wait(); close(pumped) }()

	// Bound the wait for the data sockets once the command is known to have ended.
	watchdog := func() {
		select {
		case <-pumped:
		case <-time.After(5 * time.Second):
			conns.closeAll()
		}
	}
	ended, opCh := ctlClosed, (<-chan struct{})(opDone)
	for done := false; !done; {
		select {
		case <-pumped:
			done = true
		case <-ended:
			// The command has ended: close our side of the data socket; the daemon then
			// closes it. With a tty that socket carries the output too, and the daemon answers
			// our close with its own, after which output still in flight is dropped (a quick
			// command's whole output was lost that way): close only once the daemon has sent
			// its end-of-output barrier, or after a bound.
			ended = nil
			if tty {
				select {
				case <-outEnded:
				case <-time.After(5 * time.Second):
				}
			}
			_ = in.WriteControl(websocket.CloseMessage,
				websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""), time.Now().Add(time.Second))
			go watchdog()
		case <-opCh:
			opCh = nil
			go watchdog()
		}
	}
	<-opDone
	if ctx.Err() != nil {
		return -1, fmt.Errorf("incus: exec in %s: %w", inst, ctx.Err())
	}
	if opErr != nil {
		return -1, opErr
	}
	if outErr != nil {
		return -1, fmt.Errorf("incus: exec: writing stdout: %w", outErr)
	}
	if errErr != nil {
		return -1, fmt.Errorf("incus: exec: writing stderr: %w", errErr)
	}
	return exitCode(final.Metadata), nil
}

// wsConns are an exec's websockets by fd ("0", "1", "2", "control").
type wsConns map[string]*websocket.Conn

func (w wsConns) closeAll() {
	for _, cn := range w {
		cn.Close()
	}
}

// errControlStalled: the daemon did not answer a websocket's handshake in time (ours, or its
// own 5 s bound for them all) before the last socket. The command has not started then: it
// waits for every data socket, and the control socket is connected first.
var errControlStalled = errors.New("the exec's websockets did not connect in time")

// wsConnectTimeout is Incus's own message for an exec whose websockets did not all connect
// within its 5 s bound: the command never started.
const wsConnectTimeout = "Timed out waiting for websockets to connect"

func isRefusal(err error) bool {
	var se *StatusError
	return errors.As(err, &se) && strings.HasPrefix(se.Message, "websocket refused: ")
}

// refusedBecause explains a websocket the daemon refused ("Only running operations can be
// connected") by the operation's own end: a daemon loaded by a whole test suite let the exec's
// 5 s websocket bound run out before answering a handshake (the command never ran: asked for
// again, as a stalled handshake is), or the command already failed ("Command not found", which
// callers map to 127). Without this the refusal hid both.
func (c *Client) refusedBecause(ctx context.Context, opID string, refusal error) error {
	var op Operation
	if _, err := c.get(ctx, "/1.0/operations/"+esc(opID), &op); err != nil || !op.done() {
		return refusal
	}
	opErr := op.err()
	switch {
	case opErr == nil:
		return refusal
	case strings.Contains(op.Err, wsConnectTimeout):
		return fmt.Errorf("%w: %w", errControlStalled, opErr)
	}
	return opErr
}

// lastSocketTimedOut judges a handshake of the last data socket that timed out: the daemon
// may have connected it (the command then ran) while our read of its answer did not come in
// time, so the timeout alone does not say. The operation does: failed with the daemon's own
// 5 s bound for the sockets, the command never started, and the exec is asked for again as
// a stall is. Measured here: a drill of 8 boxes on a host kept busy had 3 probe runs end on
// "connecting fd 2: i/o timeout" at once, 72 rows check-failed. Anything else (the operation
// ran, or its end did not come within a few seconds) stays the timeout: never run twice.
func (c *Client) lastSocketTimedOut(ctx context.Context, opID string, timeout error) error {
	wctx, cancel := context.WithTimeout(ctx, 6*time.Second)
	defer cancel()
	_, err := c.WaitOperation(wctx, opID, nil)
	if err != nil && strings.Contains(err.Error(), wsConnectTimeout) {
		return fmt.Errorf("%w: %w", errControlStalled, timeout)
	}
	return timeout
}

// execAttempts bounds how often an exec the daemon could not attach is asked for, and
// stallAttempts one whose websockets did not connect in time (each may take the daemon's 5 s
// bound: 5 attempts and their pauses stay under 40 s).
const (
	execAttempts  = 3
	stallAttempts = 5
)

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// startExec posts the exec (wait-for-websocket) and connects every websocket it offers.
func (c *Client) startExec(ctx context.Context, inst string, req ExecRequest, tty bool, width, height int) (*Operation, wsConns, error) {
	if len(req.Command) == 0 {
		return nil, nil, errors.New("incus: exec: empty command")
	}
	body := execPost{
		Command: req.Command, Environment: req.Env, WaitForWebsocket: true, Interactive: tty,
		User: req.User, Group: req.Group, Cwd: req.Cwd,
	}
	if tty {
		body.Width, body.Height = width, height
		if body.Width <= 0 || body.Height <= 0 {
			body.Width, body.Height = 80, 24
		}
	}
	r, _, err := c.do(ctx, http.MethodPost, "/1.0/instances/"+esc(inst)+"/exec", body, nil)
	if err != nil {
		return nil, nil, err
	}
	op, err := decodeOp(r)
	if err != nil {
		return nil, nil, err
	}
	if c.beforeSockets != nil {
		c.beforeSockets()
	}
	fds := map[string]string{}
	if m, ok := op.Metadata["fds"].(map[string]any); ok {
		for k, v := range m {
			if s, ok := v.(string); ok {
				fds[k] = s
			}
		}
	}
	// The control socket first: Incus starts the command as soon as the data sockets are all
	// connected (control is optional to it), and a quick command can then end, and its
	// operation with it, before a control socket connected last gets there, which Incus refuses
	// ("Only running operations can be connected"): the exec failed with a bad handshake.
	want := []string{"control", "0", "1", "2"}
	if tty {
		want = []string{"control", "0"}
	}
	conns := wsConns{}
	for _, fd := range want {
		secret, ok := fds[fd]
		if !ok {
			conns.closeAll()
			return nil, nil, fmt.Errorf("incus: exec: operation %s offers no websocket for fd %s", op.ID, fd)
		}
		cn, err := c.websocket(ctx, op.ID, secret)
		if err != nil {
			conns.closeAll()
			switch {
			case isTimeout(err) && fd != want[len(want)-1]:
				// Not the last socket: the command waits for all the data sockets, so it has
				// not started (a CI run's daemon stalled on fd 0 after control connected).
				err = fmt.Errorf("%w: %w", errControlStalled, err)
			case isTimeout(err):
				err = c.lastSocketTimedOut(ctx, op.ID, err)
			case isRefusal(err):
				err = c.refusedBecause(ctx, op.ID, err)
			}
			_ = c.CancelOperation(context.WithoutCancel(ctx), op.ID)
			return nil, nil, fmt.Errorf("incus: exec: connecting fd %s: %w", fd, err)
		}
		conns[fd] = cn
	}
	return op, conns, nil
}

// untilClosed is closed once the daemon closes the control socket, which it does when the
// command has ended: with a tty that is the client's cue to close the data socket, which lets
// the operation finish.
func untilClosed(ctl *websocket.Conn) <-chan struct{} {
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		for {
			if _, _, err := ctl.NextReader(); err != nil {
				return
			}
		}
	}()
	return closed
}

// controlLoop passes resizes and signals to the control socket until stop; when ctx ends it
// kills the command (signal 9) and closes every socket.
func controlLoop(ctx context.Context, ctl *lockedConn, req ExecRequest, stop <-chan struct{}, closeAll func()) {
	resize, signal := req.Resize, req.Signal
	for {
		select {
		case <-stop:
			return
		case <-ctx.Done():
			_ = ctl.writeJSON(map[string]any{"command": "signal", "signal": 9})
			closeAll()
			return
		case wh, ok := <-resize:
			if !ok {
				resize = nil
				continue
			}
			_ = ctl.writeJSON(map[string]any{"command": "window-resize", "args": map[string]string{
				"width": strconv.Itoa(wh[0]), "height": strconv.Itoa(wh[1])}})
		case sig, ok := <-signal:
			if !ok {
				signal = nil
				continue
			}
			_ = ctl.writeJSON(map[string]any{"command": "signal", "signal": sig})
		}
	}
}

// feedStdin copies stdin to fd 0. Without a tty, EOF is passed on as a close message so the
// command sees EOF; with a tty the terminal stays open (the command decides when to end).
func feedStdin(in *websocket.Conn, stdin io.Reader, tty bool) {
	if stdin != nil {
		buf := make([]byte, 32*1024)
		for {
			n, err := stdin.Read(buf)
			if n > 0 {
				if werr := in.WriteMessage(websocket.BinaryMessage, buf[:n]); werr != nil {
					return
				}
			}
			if err != nil {
				break
			}
		}
	}
	if !tty {
		_ = in.WriteMessage(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""))
	}
}

func outFD(tty bool) string {
	if tty {
		return "0"
	}
	return "1"
}

// pump copies websocket messages to w until the socket closes. It returns only a write
// error: the socket closing is the normal end. A text message is the daemon's barrier: the
// end of what it mirrors onto this socket (Incus sends one, empty, when the command's output
// reached EOF); pump calls barrier for it.
func pump(cn *websocket.Conn, w io.Writer, barrier func()) error {
	var werr error
	for {
		mt, r, err := cn.NextReader()
		if err != nil {
			return werr
		}
		if mt == websocket.TextMessage {
			barrier()
			continue
		}
		if werr == nil {
			_, werr = io.Copy(w, r)
		}
	}
}

func exitCode(md map[string]any) int {
	switch v := md["return"].(type) {
	case float64:
		return int(v)
	case string:
		if n, err := strconv.Atoi(v); err == nil {
			return n
		}
	}
	return -1
}

// websocket dials /1.0/operations/<id>/websocket?secret=<secret>.
func (c *Client) websocket(ctx context.Context, opID, secret string) (*websocket.Conn, error) {
	return c.dialWS(ctx, "/1.0/operations/"+esc(opID)+"/websocket?secret="+url.QueryEscape(secret))
}

// dialWS upgrades a GET of path (with its query) to a websocket.
func (c *Client) dialWS(ctx context.Context, path string) (*websocket.Conn, error) {
	u := c.base
	switch {
	case strings.HasPrefix(u, "https://"):
		u = "wss://" + strings.TrimPrefix(u, "https://")
	case strings.HasPrefix(u, "http://"):
		u = "ws://" + strings.TrimPrefix(u, "http://")
	}
	u += path
	cn, resp, err := c.ws.DialContext(ctx, u, http.Header{"User-Agent": {"claudebox"}})
	var refused error
	if resp != nil && resp.Body != nil {
		if errors.Is(err, websocket.ErrBadHandshake) {
			refused = handshakeRefusal(resp, strings.SplitN(path, "?", 2)[0])
		}
		resp.Body.Close()
	}
	if err != nil {
		if isUnreachable(err) {
			return nil, &DaemonUnreachableError{Socket: c.socket, Remote: c.remoteAddr(), Err: err}
		}
		if refused != nil {
			return nil, refused
		}
		return nil, err
	}
	return cn, nil
}

// handshakeRefusal is the daemon's answer to a websocket upgrade it refused, as a StatusError
// with its own message ("Only running operations can be connected"), not the bare "bad
// handshake".
func handshakeRefusal(resp *http.Response, path string) error {
	var r response
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	msg := http.StatusText(resp.StatusCode)
	if json.Unmarshal(body, &r) == nil && r.Error != "" {
		msg = r.Error
	}
	return &StatusError{Code: resp.StatusCode, Message: "websocket refused: " + msg, Method: http.MethodGet, Path: path}
}

type lockedConn struct {
	mu sync.Mutex
	c  *websocket.Conn
}

func (l *lockedConn) writeJSON(v any) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.c.WriteJSON(v)
}
