package incus_test

// Unit tests against fake Incus servers (httptest, also on a Unix socket): error mapping,
// operation waiting, remote resolution, the exec websocket protocol.

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	gosync "sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/claudebox/claudebox/boxcore/incus"
)

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

func sync(md any) map[string]any {
	return map[string]any{"type": "sync", "status": "Success", "status_code": 200, "metadata": md}
}

func apiErr(code int, msg string) map[string]any {
	return map[string]any{"type": "error", "error_code": code, "error": msg}
}

func async(id string, md map[string]any) map[string]any {
	return map[string]any{"type": "async", "status": "Operation created", "status_code": 100,
		"operation": "/1.0/operations/" + id,
		"metadata":  map[string]any{"id": id, "status": "Running", "status_code": 103, "metadata": md}}
}

func op(id string, code int, errText string, md map[string]any) map[string]any {
	status := map[int]string{103: "Running", 200: "Success", 400: "Failure"}[code]
	return sync(map[string]any{"id": id, "status": status, "status_code": code, "err": errText, "metadata": md})
}

// cancelledOrNotFound answers an exec test's operation cancel (DELETE) and nothing else.
func cancelledOrNotFound(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodDelete {
		writeJSON(w, 200, map[string]any{"type": "sync", "status_code": 200})
		return
	}
	writeJSON(w, 404, apiErr(404, "not found"))
}

func fakeServer(t *testing.T, h http.HandlerFunc) *incus.Client {
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return incus.NewHTTPClient(srv.URL, srv.Client())
}

func TestErrorMapping(t *testing.T) {
	c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/1.0/instances/missing":
			writeJSON(w, 404, apiErr(404, "Instance not found"))
		case "/1.0/instances/dup":
			writeJSON(w, 409, apiErr(409, "Instance \"dup\" already exists"))
		case "/1.0/instances/boom":
			writeJSON(w, 500, apiErr(500, "Failed to frobnicate"))
		case "/1.0/instances/proxy":
			w.WriteHeader(502)
			fmt.Fprint(w, "<html>bad gateway</html>")
		default:
			writeJSON(w, 404, apiErr(404, "not found"))
		}
	})
	ctx := context.Background()
	_, _, err := c.Instance(ctx, "missing")
	if !errors.Is(err, incus.ErrNotFound) || errors.Is(err, incus.ErrConflict) {
		t.Errorf("404: %v", err)
	}
	_, _, err = c.Instance(ctx, "dup")
	if !errors.Is(err, incus.ErrConflict) || errors.Is(err, incus.ErrNotFound) {
		t.Errorf("409: %v", err)
	}
	_, _, err = c.Instance(ctx, "boom")
	var se *incus.StatusError
	if !errors.As(err, &se) || se.Code != 500 || !strings.Contains(err.Error(), "Failed to frobnicate") {
		t.Errorf("500: %#v", err)
	}
	if errors.Is(err, incus.ErrNotFound) || errors.Is(err, incus.ErrConflict) {
		t.Errorf("500 matches a sentinel: %v", err)
	}
	_, _, err = c.Instance(ctx, "proxy")
	if !errors.As(err, &se) || se.Code != 502 {
		t.Errorf("502 without JSON: %#v", err)
	}
	if (&incus.StatusError{Code: 400, Message: "UNIQUE constraint failed: instances.name"}).Is(incus.ErrConflict) != true {
		t.Errorf("database duplicate is not a conflict")
	}
	busy := &incus.StatusError{Code: 400, Operation: "x", Message: `Instance is busy running a "update" operation`}
	if !errors.Is(busy, incus.ErrBusy) || errors.Is(busy, incus.ErrConflict) {
		t.Errorf("busy instance: not ErrBusy")
	}
	if errors.Is(&incus.StatusError{Code: 400, Message: "Instance is running"}, incus.ErrBusy) {
		t.Errorf("a running instance is not a busy one")
	}
}

// unixServer serves h on a Unix socket in a temp dir.
func unixServer(t *testing.T, h http.Handler) string {
	sock := filepath.Join(t.TempDir(), "unix.socket")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(h)
	srv.Listener = l
	srv.Start()
	t.Cleanup(srv.Close)
	return sock
}

func TestUnixSocket(t *testing.T) {
	sock := unixServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/1.0" {
			writeJSON(w, 404, apiErr(404, "not found"))
			return
		}
		writeJSON(w, 200, sync(map[string]any{"api_version": "1.0", "environment": map[string]any{
			"server_version": "6.0.4", "kernel": "Linux", "driver": "lxc | qemu", "firewall": "nftables",
			"storage_supported_drivers": []map[string]any{{"Name": "dir"}, {"Name": "zfs"}}}}))
	}))
	c := incus.NewUnixClient(sock)
	s, err := c.Server(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if s.Version != "6.0.4" || !s.VMSupported || len(s.InstanceTypes) != 2 || s.StorageDrivers[1] != "zfs" || c.Remote() != "local" {
		t.Errorf("server: %+v", s)
	}
}

// RecentServer answers from the last read while it is fresh; Server always asks.
func TestRecentServer(t *testing.T) {
	var reads atomic.Int32
	sock := unixServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		reads.Add(1)
		writeJSON(w, 200, sync(map[string]any{"api_version": "1.0", "environment": map[string]any{"server_name": "m1", "server_clustered": true}}))
	}))
	c := incus.NewUnixClient(sock)
	ctx := context.Background()
	for i, f := range []func(context.Context) (incus.Server, error){c.RecentServer, c.RecentServer, c.Server, c.RecentServer} {
		if s, err := f(ctx); err != nil || s.ServerName != "m1" || !s.Clustered {
			t.Fatalf("call %d: %+v %v", i, s, err)
		}
	}
	if n := reads.Load(); n != 2 {
		t.Errorf("GET /1.0 %d times, want 2 (the first RecentServer and Server)", n)
	}
}

func TestDaemonUnreachable(t *testing.T) {
	dir := t.TempDir()
	missing := filepath.Join(dir, "missing.socket")
	_, err := incus.NewUnixClient(missing).Server(context.Background())
	var de *incus.DaemonUnreachableError
	if !errors.As(err, &de) || de.Socket != missing {
		t.Fatalf("missing socket: %#v", err)
	}
	want := "the Incus daemon is not answering at " + missing + ": start it with 'make setup' (or 'systemctl start incus')"
	if err.Error() != want {
		t.Errorf("message:\n got %q\nwant %q", err.Error(), want)
	}
	// A socket file nobody listens on: connection refused.
	refused := filepath.Join(dir, "refused.socket")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: refused, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	l.SetUnlinkOnClose(false)
	l.Close()
	_, err = incus.NewUnixClient(refused).Instances(context.Background(), nil, false)
	if !errors.As(err, &de) || !strings.Contains(err.Error(), "make setup") {
		t.Errorf("refused socket: %#v", err)
	}
	// Connect("") honours INCUS_SOCKET, then INCUS_DIR.
	t.Setenv("INCUS_SOCKET", missing)
	c, err := incus.Connect(context.Background(), "")
	if err != nil || c.Remote() != "local" {
		t.Fatalf("Connect: %v", err)
	}
	if _, err := c.Server(context.Background()); !errors.As(err, &de) || de.Socket != missing {
		t.Errorf("INCUS_SOCKET not used: %v", err)
	}
	t.Setenv("INCUS_SOCKET", "")
	t.Setenv("INCUS_DIR", dir)
	if got := incus.LocalSocket(); got != filepath.Join(dir, "unix.socket") {
		t.Errorf("INCUS_DIR: %s", got)
	}
}

func TestOperations(t *testing.T) {
	var waits atomic.Int32
	var lastTimeout atomic.Int64
	c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.Method == "POST" && r.URL.Path == "/1.0/instances":
			var req incus.InstancesPost
			_ = json.NewDecoder(r.Body).Decode(&req)
			writeJSON(w, 202, async("op-"+req.Name, nil))
		case r.URL.Path == "/1.0/operations/op-ok/wait":
			n := waits.Add(1)
			if n == 1 {
				writeJSON(w, 200, op("op-ok", 103, "", map[string]any{"download_progress": "rootfs: 42% (1.2MB/s)"}))
				return
			}
			writeJSON(w, 200, op("op-ok", 200, "", map[string]any{"download_progress": "rootfs: 100% (1.2MB/s)"}))
		case r.URL.Path == "/1.0/operations/op-fail/wait":
			// What the daemon does for a failed operation: an error envelope with its err.
			writeJSON(w, 500, apiErr(500, "Failed creating instance from image: no space left"))
		case r.URL.Path == "/1.0/operations/op-fail2/wait":
			writeJSON(w, 200, op("op-fail2", 400, "Failed something", nil))
		case r.URL.Path == "/1.0/operations/op-slow/wait":
			s, _ := strconv.ParseInt(r.URL.Query().Get("timeout"), 10, 64)
			lastTimeout.Store(s)
			select {
			case <-r.Context().Done():
			case <-time.After(time.Duration(s) * time.Second):
				// What the daemon answers when the wait's own timeout runs out.
				writeJSON(w, 500, apiErr(500, "context deadline exceeded"))
			}
		case r.URL.Path == "/1.0/operations/op-long/wait":
			if waits.Add(1) < 4 {
				writeJSON(w, 500, apiErr(500, "context deadline exceeded"))
				return
			}
			writeJSON(w, 200, op("op-long", 200, "", nil))
		default:
			writeJSON(w, 404, apiErr(404, "Operation not found"))
		}
	})
	var events []incus.ProgressEvent
	err := c.CreateInstance(context.Background(), incus.InstancesPost{Name: "ok"}, func(e incus.ProgressEvent) { events = append(events, e) })
	if err != nil {
		t.Fatal(err)
	}
	if len(events) != 2 || events[0].Percent != 42 || events[0].Key != "download_progress" || events[1].Percent != 100 {
		t.Errorf("progress: %+v", events)
	}
	// An operation outlasting a (progress-polling) wait is waited on again, not failed.
	if err := c.CreateInstance(context.Background(), incus.InstancesPost{Name: "long"}, func(incus.ProgressEvent) {}); err != nil {
		t.Errorf("long operation: %v", err)
	}
	for _, name := range []string{"fail", "fail2"} {
		err = c.CreateInstance(context.Background(), incus.InstancesPost{Name: name}, nil)
		var se *incus.OperationError
		if !errors.As(err, &se) || se.Operation != "op-"+name || !strings.Contains(err.Error(), "Failed") {
			t.Errorf("%s: %#v", name, err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	err = c.CreateInstance(ctx, incus.InstancesPost{Name: "slow"}, nil)
	if !errors.Is(err, context.DeadlineExceeded) || time.Since(start) > 2*time.Second {
		t.Errorf("deadline: %v after %v", err, time.Since(start))
	}
	if s := lastTimeout.Load(); s < 1 || s > 1 {
		t.Errorf("wait timeout %d s for a 300 ms deadline, want 1", s)
	}
	_, err = c.WaitOperation(context.Background(), "nope", nil)
	if !errors.Is(err, incus.ErrNotFound) {
		t.Errorf("missing operation: %v", err)
	}
}

func TestFilterExpr(t *testing.T) {
	got := incus.FilterExpr(map[string]string{"user.claudebox": "1", "user.b": "two words", "user.a": ""})
	want := `config.user.a eq "" and config.user.b eq "two words" and config.user.claudebox eq 1`
	if got != want {
		t.Errorf("got %s\nwant %s", got, want)
	}
	var seen string
	c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
		seen = r.URL.RawQuery
		writeJSON(w, 200, sync([]map[string]any{{"name": "x", "config": map[string]string{"user.claudebox": "1"}}}))
	})
	in, err := c.Instances(context.Background(), map[string]string{"user.claudebox": "1"}, true)
	if err != nil || len(in) != 1 || in[0].Name != "x" {
		t.Fatal(in, err)
	}
	if seen != "filter=config.user.claudebox+eq+1&recursion=2" {
		t.Errorf("query %q", seen)
	}
}

// selfSigned returns a PEM certificate and key for 127.0.0.1.
func selfSigned(t *testing.T, cn string) (certPEM, keyPEM []byte, cert tls.Certificate) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: cn},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certPEM = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	keyPEM = pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder})
	cert, err = tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	return certPEM, keyPEM, cert
}

func TestConnectRemote(t *testing.T) {
	srvPEM, _, srvCert := selfSigned(t, "server")
	cliPEM, cliKey, _ := selfSigned(t, "client")
	var peer atomic.Value
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if len(r.TLS.PeerCertificates) > 0 {
			peer.Store(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: r.TLS.PeerCertificates[0].Raw}))
		}
		writeJSON(w, 200, sync(map[string]any{"api_version": "1.0", "auth": "trusted",
			"environment": map[string]any{"server_version": "6.0.4", "driver": "lxc"}}))
	}))
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{srvCert}, ClientAuth: tls.RequireAnyClientCert}
	srv.StartTLS()
	t.Cleanup(srv.Close)

	dir := t.TempDir()
	t.Setenv("INCUS_CONF", dir)
	cfg := fmt.Sprintf(`default-remote: local
remotes:
  r1:
    addr: %s
    protocol: incus
  r2:
    addr: %s
  images:
    addr: https://images.example.org
    protocol: simplestreams
    public: true
  local:
    addr: unix://
`, srv.URL, srv.URL)
	must := func(err error) {
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.WriteFile(filepath.Join(dir, "config.yml"), []byte(cfg), 0o600))
	must(os.WriteFile(filepath.Join(dir, "client.crt"), cliPEM, 0o600))
	must(os.WriteFile(filepath.Join(dir, "client.key"), cliKey, 0o600))
	must(os.MkdirAll(filepath.Join(dir, "servercerts"), 0o755))
	must(os.WriteFile(filepath.Join(dir, "servercerts", "r1.crt"), srvPEM, 0o644))
	ctx := context.Background()

	_, err := incus.Connect(ctx, "nope")
	var ue *incus.UnknownRemoteError
	if !errors.As(err, &ue) || ue.Name != "nope" || !strings.Contains(err.Error(), `"nope"`) || !strings.Contains(err.Error(), "incus remote list") {
		t.Errorf("unknown remote: %v", err)
	}
	if _, err := incus.Connect(ctx, "images"); err == nil || !strings.Contains(err.Error(), "simplestreams") {
		t.Errorf("simplestreams remote: %v", err)
	}
	c, err := incus.Connect(ctx, "r1")
	if err != nil {
		t.Fatal(err)
	}
	if c.Remote() != "r1" {
		t.Errorf("Remote() = %q", c.Remote())
	}
	s, err := c.Server(ctx)
	if err != nil || s.Version != "6.0.4" {
		t.Fatalf("HTTPS remote: %+v %v", s, err)
	}
	if got, _ := peer.Load().([]byte); string(got) != string(cliPEM) {
		t.Errorf("server saw client certificate %q", got)
	}
	// r2 has no pinned certificate: the self-signed server fails system verification.
	c2, err := incus.Connect(ctx, "r2")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c2.Server(ctx); err == nil {
		t.Errorf("unpinned self-signed server accepted")
	}
	// A pinned certificate that is not the server's is refused.
	other, _, _ := selfSigned(t, "other")
	must(os.WriteFile(filepath.Join(dir, "servercerts", "r2.crt"), other, 0o644))
	c2, _ = incus.Connect(ctx, "r2")
	if _, err := c2.Server(ctx); err == nil {
		t.Errorf("wrong pinned certificate accepted")
	}
	// "local" in the config is the Unix socket.
	if c, err := incus.Connect(ctx, "local"); err != nil || c.Remote() != "local" {
		t.Errorf("local: %v", err)
	}
	// No config file at all: unknown remote.
	t.Setenv("INCUS_CONF", t.TempDir())
	if _, err := incus.Connect(ctx, "r1"); !errors.As(err, &ue) {
		t.Errorf("no config: %v", err)
	}
}

// TestExecProtocol plays the daemon's side of a non-interactive exec.
func TestExecProtocol(t *testing.T) {
	up := websocket.Upgrader{}
	conns := make(chan [2]any, 8)
	var stdinGot atomic.Value
	c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.URL.Path == "/1.0/instances/x/exec":
			var req map[string]any
			_ = json.NewDecoder(r.Body).Decode(&req)
			if req["wait-for-websocket"] != true || req["interactive"] != false {
				writeJSON(w, 400, apiErr(400, "bad request"))
				return
			}
			writeJSON(w, 202, async("ex", map[string]any{"fds": map[string]string{"0": "s0", "1": "s1", "2": "s2", "control": "sc"}}))
		case r.URL.Path == "/1.0/operations/ex/websocket":
			ws, err := up.Upgrade(w, r, nil)
			if err != nil {
				return
			}
			conns <- [2]any{r.URL.Query().Get("secret"), ws}
		case r.URL.Path == "/1.0/operations/ex/wait":
			writeJSON(w, 200, op("ex", 200, "", map[string]any{"return": 3}))
		default:
			writeJSON(w, 404, apiErr(404, "not found"))
		}
	})
	go func() {
		byName := map[string]*websocket.Conn{}
		for len(byName) < 4 {
			x := <-conns
			byName[x[0].(string)] = x[1].(*websocket.Conn)
		}
		// stdin until the client's close message.
		var in []byte
		for {
			_, b, err := byName["s0"].ReadMessage()
			if err != nil {
				break
			}
			in = append(in, b...)
		}
		stdinGot.Store(string(in))
		_ = byName["s1"].WriteMessage(websocket.BinaryMessage, []byte("out:"+string(in)))
		_ = byName["s2"].WriteMessage(websocket.BinaryMessage, []byte("err"))
		for _, k := range []string{"s1", "s2", "control"} {
			if k == "control" {
				k = "sc"
			}
			_ = byName[k].WriteMessage(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""))
			byName[k].Close()
		}
		byName["s0"].Close()
	}()
	r, err := c.Exec(context.Background(), "x", incus.ExecRequest{Command: []string{"cat"}, Stdin: strings.NewReader("hello")})
	if err != nil {
		t.Fatal(err)
	}
	if string(r.Stdout) != "out:hello" || string(r.Stderr) != "err" || r.ExitCode != 3 {
		t.Errorf("result: %q %q %d", r.Stdout, r.Stderr, r.ExitCode)
	}
	if _, err := c.Exec(context.Background(), "x", incus.ExecRequest{}); err == nil {
		t.Errorf("empty command accepted")
	}
}

// Incus 6.0.4 fails a network's create and delete, not only its update, with "Failed to delete
// bridge children interfaces" (500) when a veth vanishes while it brings the bridge up or down:
// CreateNetwork and DeleteNetwork retry it, as a test stack's setup and teardown need.
func TestNetworkCreateDeleteRetryBridgeChildrenRace(t *testing.T) {
	const race = "Failed to delete bridge children interfaces: route ip+net: no such network interface"
	var posts, deletes atomic.Int32
	var created atomic.Bool
	c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.Method == http.MethodPost && r.URL.Path == "/1.0/networks":
			n := posts.Add(1)
			if n <= 2 {
				writeJSON(w, 500, apiErr(500, race))
				return
			}
			if created.Load() {
				writeJSON(w, 409, apiErr(409, "The network already exists"))
				return
			}
			created.Store(true)
			writeJSON(w, 200, sync(nil))
		case r.Method == http.MethodGet && r.URL.Path == "/1.0/networks/n1":
			writeJSON(w, 200, sync(map[string]any{"name": "n1", "type": "bridge", "managed": true,
				"config": map[string]string{"ipv4.address": "10.9.9.1/24", "volatile.x": "y"}}))
		case r.Method == http.MethodDelete && r.URL.Path == "/1.0/networks/n1":
			if deletes.Add(1) == 1 {
				writeJSON(w, 500, apiErr(500, race))
				return
			}
			writeJSON(w, 200, sync(nil))
		case r.Method == http.MethodDelete && r.URL.Path == "/1.0/networks/gone":
			if deletes.Add(1) <= 3 {
				writeJSON(w, 500, apiErr(500, race))
				return
			}
			writeJSON(w, 404, apiErr(404, "Network not found"))
		case r.Method == http.MethodDelete && r.URL.Path == "/1.0/networks/missing":
			writeJSON(w, 404, apiErr(404, "Network not found"))
		default:
			writeJSON(w, 404, apiErr(404, "not found"))
		}
	})
	ctx := context.Background()
	cfg := map[string]string{"ipv4.address": "10.9.9.1/24"}
	if err := c.CreateNetwork(ctx, "n1", "bridge", cfg, ""); err != nil || posts.Load() != 3 {
		t.Fatalf("create raced twice: err %v after %d POSTs, want success on the third", err, posts.Load())
	}
	// A create whose raced attempt left the network there anyway: the conflict on the retry is
	// the network asked for.
	posts.Store(1)
	if err := c.CreateNetwork(ctx, "n1", "bridge", cfg, ""); err != nil {
		t.Fatalf("create raced, then found its network: %v", err)
	}
	// Without a race first, a duplicate stays a conflict; another config is not ours either.
	if err := c.CreateNetwork(ctx, "n1", "bridge", cfg, ""); !errors.Is(err, incus.ErrConflict) {
		t.Fatalf("duplicate create: %v, want ErrConflict", err)
	}
	posts.Store(1)
	if err := c.CreateNetwork(ctx, "n1", "bridge", map[string]string{"ipv4.address": "10.9.8.1/24"}, ""); !errors.Is(err, incus.ErrConflict) {
		t.Fatalf("create raced, then found another network of that name: %v, want ErrConflict", err)
	}
	if err := c.DeleteNetwork(ctx, "n1"); err != nil || deletes.Load() != 2 {
		t.Fatalf("delete raced once: err %v after %d DELETEs", err, deletes.Load())
	}
	deletes.Store(0)
	if err := c.DeleteNetwork(ctx, "gone"); err != nil || deletes.Load() != 4 {
		t.Fatalf("delete raced, then the network was gone: err %v after %d DELETEs", err, deletes.Load())
	}
	if err := c.DeleteNetwork(ctx, "missing"); !errors.Is(err, incus.ErrNotFound) {
		t.Fatalf("delete of a network that never was: %v, want ErrNotFound", err)
	}
}

// Incus runs a non-interactive exec's command once stdin, stdout and stderr are connected (the
// control socket is optional to it) and refuses any websocket once the operation has ended. A
// quick command (cat /etc/machine-id) on a loaded host ended before a control socket connected
// last got there: "connecting fd control: websocket: bad handshake". Exec connects control first.
func TestExecControlBeforeTheCommandStarts(t *testing.T) {
	up := websocket.Upgrader{}
	var mu gosync.Mutex
	conns := map[string]*websocket.Conn{}
	done := make(chan struct{})
	c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/1.0/instances/x/exec":
			writeJSON(w, 202, async("ex", map[string]any{"fds": map[string]string{"0": "s0", "1": "s1", "2": "s2", "control": "sc"}}))
		case "/1.0/operations/ex/websocket":
			mu.Lock()
			defer mu.Unlock()
			select {
			case <-done:
				writeJSON(w, 400, apiErr(400, "Only running operations can be connected"))
				return
			default:
			}
			ws, err := up.Upgrade(w, r, nil)
			if err != nil {
				return
			}
			conns[r.URL.Query().Get("secret")] = ws
			if conns["s0"] == nil || conns["s1"] == nil || conns["s2"] == nil {
				return
			}
			// The command runs and ends at once; the operation is over.
			_ = conns["s1"].WriteMessage(websocket.BinaryMessage, []byte("0123abcd\n"))
			for _, k := range []string{"s1", "s2", "sc"} {
				if cn := conns[k]; cn != nil {
					_ = cn.WriteMessage(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""))
					cn.Close()
				}
			}
			conns["s0"].Close()
			close(done)
		case "/1.0/operations/ex/wait":
			<-done
			writeJSON(w, 200, op("ex", 200, "", map[string]any{"return": 0}))
		default:
			writeJSON(w, 404, apiErr(404, "not found"))
		}
	})
	r, err := c.Exec(context.Background(), "x", incus.ExecRequest{Command: []string{"cat", "/etc/machine-id"}})
	if err != nil {
		t.Fatal(err)
	}
	if string(r.Stdout) != "0123abcd\n" || r.ExitCode != 0 {
		t.Errorf("result: %q exit %d", r.Stdout, r.ExitCode)
	}
}

// A daemon too loaded to answer the control socket's handshake in time has not started the
// command (it waits for the data sockets): the exec is asked for again, and its output is the
// second exec's. A stall on every attempt is an error, and the command never ran.
func TestExecControlStallRetried(t *testing.T) {
	up := websocket.Upgrader{}
	for _, stallEvery := range []bool{false, true} {
		var execs, ran atomic.Int32
		c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
			switch r.URL.Path {
			case "/1.0/instances/x/exec":
				n := execs.Add(1)
				id := fmt.Sprintf("ex%d", n)
				writeJSON(w, 202, async(id, map[string]any{"fds": map[string]string{"0": "s0", "1": "s1", "2": "s2", "control": "sc"}}))
			case "/1.0/operations/ex1/websocket", "/1.0/operations/ex2/websocket", "/1.0/operations/ex3/websocket",
				"/1.0/operations/ex4/websocket", "/1.0/operations/ex5/websocket":
				if r.URL.Path == "/1.0/operations/ex1/websocket" || stallEvery {
					time.Sleep(400 * time.Millisecond) // the handshake stalls
					return
				}
				ws, err := up.Upgrade(w, r, nil)
				if err != nil {
					return
				}
				if r.URL.Query().Get("secret") == "s1" {
					ran.Add(1)
					_ = ws.WriteMessage(websocket.BinaryMessage, []byte("ok\n"))
				}
				_ = ws.WriteMessage(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""))
			case "/1.0/operations/ex2/wait", "/1.0/operations/ex3/wait", "/1.0/operations/ex4/wait", "/1.0/operations/ex5/wait":
				time.Sleep(50 * time.Millisecond)
				writeJSON(w, 200, op("ex2", 200, "", map[string]any{"return": 0}))
			default:
				cancelledOrNotFound(w, r)
			}
		})
		c.SetHandshakeTimeout(100 * time.Millisecond)
		r, err := c.Exec(context.Background(), "x", incus.ExecRequest{Command: []string{"true"}})
		switch {
		case stallEvery && (err == nil || !strings.Contains(err.Error(), "did not connect in time") || ran.Load() != 0 || execs.Load() != 5):
			t.Errorf("a stall on every attempt: %v after %d execs, command ran %d times; want an error after 5, never run", err, execs.Load(), ran.Load())
		case !stallEvery && (err != nil || string(r.Stdout) != "ok\n" || execs.Load() != 2):
			t.Errorf("one stall: %q, %v after %d execs; want ok after 2", r.Stdout, err, execs.Load())
		}
	}
}

// The last data socket's handshake timing out does not say whether the command ran (the
// daemon may have connected it while the answer was late): the operation says. Failed with
// the daemon's own bound for the sockets, it never started and is asked for again (a drill of
// 8 boxes on a busy host: "connecting fd 2: i/o timeout", 72 rows check-failed); one that ran
// is an error, never run twice.
func TestExecLastSocketTimeout(t *testing.T) {
	up := websocket.Upgrader{}
	for _, ran := range []bool{false, true} {
		var execs, runs atomic.Int32
		c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
			switch r.URL.Path {
			case "/1.0/instances/x/exec":
				n := execs.Add(1)
				writeJSON(w, 202, async(fmt.Sprintf("ex%d", n), map[string]any{"fds": map[string]string{"0": "s0", "1": "s1", "2": "s2", "control": "sc"}}))
			case "/1.0/operations/ex1/websocket", "/1.0/operations/ex2/websocket":
				if r.URL.Path == "/1.0/operations/ex1/websocket" && r.URL.Query().Get("secret") == "s2" {
					time.Sleep(400 * time.Millisecond) // the last handshake's answer is late
					return
				}
				ws, err := up.Upgrade(w, r, nil)
				if err != nil {
					return
				}
				if r.URL.Query().Get("secret") == "s1" && r.URL.Path == "/1.0/operations/ex2/websocket" {
					runs.Add(1)
					_ = ws.WriteMessage(websocket.BinaryMessage, []byte("ok\n"))
				}
				if r.URL.Query().Get("secret") != "s0" {
					_ = ws.WriteMessage(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""))
				}
			case "/1.0/operations/ex1/wait":
				if ran {
					writeJSON(w, 200, op("ex1", 200, "", map[string]any{"return": 0}))
				} else {
					writeJSON(w, 200, op("ex1", 400, "Timed out waiting for websockets to connect", nil))
				}
			case "/1.0/operations/ex2/wait":
				time.Sleep(50 * time.Millisecond)
				writeJSON(w, 200, op("ex2", 200, "", map[string]any{"return": 0}))
			default:
				cancelledOrNotFound(w, r)
			}
		})
		c.SetHandshakeTimeout(100 * time.Millisecond)
		r, err := c.Exec(context.Background(), "x", incus.ExecRequest{Command: []string{"true"}})
		switch {
		case !ran && (err != nil || string(r.Stdout) != "ok\n" || execs.Load() != 2 || runs.Load() != 1):
			t.Errorf("the daemon's bound ran out: %q, %v after %d execs; want ok from the second", r.Stdout, err, execs.Load())
		case ran && (err == nil || !strings.Contains(err.Error(), "connecting fd 2") || execs.Load() != 1):
			t.Errorf("the command ran: %v after %d execs; want the timeout after 1", err, execs.Load())
		}
	}
}

// PublishInstance sends an instance source with the properties and compression asked for,
// returns the operation's fingerprint, and reports a failed publish and a publish that names
// no image.
func TestPublishInstance(t *testing.T) {
	var body map[string]any
	mode := "ok"
	c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.Method == http.MethodPost && r.URL.Path == "/1.0/images":
			_ = json.NewDecoder(r.Body).Decode(&body)
			writeJSON(w, 202, async("pub", nil))
		case r.URL.Path == "/1.0/operations/pub/wait":
			switch mode {
			case "ok":
				writeJSON(w, 200, op("pub", 200, "", map[string]any{"fingerprint": "abc123"}))
			case "fail":
				writeJSON(w, 200, op("pub", 400, "Failed creating image: no space left on device", nil))
			default:
				writeJSON(w, 200, op("pub", 200, "", map[string]any{}))
			}
		default:
			writeJSON(w, 404, apiErr(404, "not found"))
		}
	})
	ctx := context.Background()
	fp, err := c.PublishInstance(ctx, "builder", incus.PublishOptions{Properties: map[string]string{"k": "v"}, Compression: "none"})
	if err != nil || fp != "abc123" {
		t.Fatalf("publish: %q %v", fp, err)
	}
	src, _ := body["source"].(map[string]any)
	props, _ := body["properties"].(map[string]any)
	if src["type"] != "instance" || src["name"] != "builder" || body["compression_algorithm"] != "none" || props["k"] != "v" || body["public"] != false {
		t.Fatalf("publish request body: %v", body)
	}
	mode = "fail"
	if _, err := c.PublishInstance(ctx, "builder", incus.PublishOptions{}); err == nil || !strings.Contains(err.Error(), "no space left") {
		t.Fatalf("failed publish: %v", err)
	}
	mode = "nofp"
	if _, err := c.PublishInstance(ctx, "builder", incus.PublishOptions{}); err == nil || !strings.Contains(err.Error(), "without a fingerprint") {
		t.Fatalf("publish without a fingerprint: %v", err)
	}
}

// A websocket the daemon refuses because the operation already ended is explained by the
// operation's own error. Incus's 5 s bound for an exec's websockets ran out on a CI run's
// loaded daemon ("Timed out waiting for websockets to connect": the command never ran) and
// the refusal of the control socket hid it: such an exec is asked for again. A command that
// already failed ("Command not found") reports that, the exit code 127 to ExecInteractive.
func TestExecRefusedSocketExplained(t *testing.T) {
	up := websocket.Upgrader{}
	for _, firstEnd := range []string{"Timed out waiting for websockets to connect", "Command not found"} {
		var execs atomic.Int32
		c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
			switch r.URL.Path {
			case "/1.0/instances/x/exec":
				n := execs.Add(1)
				writeJSON(w, 202, async(fmt.Sprintf("ex%d", n), map[string]any{"fds": map[string]string{"0": "s0", "1": "s1", "2": "s2", "control": "sc"}}))
			case "/1.0/operations/ex1/websocket":
				writeJSON(w, 400, apiErr(400, "Only running operations can be connected"))
			case "/1.0/operations/ex1":
				writeJSON(w, 200, op("ex1", 400, firstEnd, nil))
			case "/1.0/operations/ex2/websocket":
				ws, err := up.Upgrade(w, r, nil)
				if err != nil {
					return
				}
				if r.URL.Query().Get("secret") == "s1" {
					_ = ws.WriteMessage(websocket.BinaryMessage, []byte("ok\n"))
				}
				_ = ws.WriteMessage(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""))
			case "/1.0/operations/ex2/wait":
				time.Sleep(50 * time.Millisecond)
				writeJSON(w, 200, op("ex2", 200, "", map[string]any{"return": 0}))
			default:
				cancelledOrNotFound(w, r)
			}
		})
		if firstEnd == "Command not found" {
			code, err := c.ExecInteractive(context.Background(), "x", incus.ExecRequest{Command: []string{"nosuch"}}, nil, nil, nil, false, 0, 0)
			if err != nil || code != 127 || execs.Load() != 1 {
				t.Errorf("a command that failed before its sockets: exit %d, %v after %d execs; want 127 after 1", code, err, execs.Load())
			}
			continue
		}
		r, err := c.Exec(context.Background(), "x", incus.ExecRequest{Command: []string{"true"}})
		if err != nil || string(r.Stdout) != "ok\n" || execs.Load() != 2 {
			t.Errorf("sockets timed out on the daemon's side: %q, %v after %d execs; want ok after 2", r.Stdout, err, execs.Load())
		}
	}
}

// An exec the daemon could not attach ("Failed to retrieve PID of executing child process":
// the command never ran) is asked for again when its stdin can be given again, and its
// output is the second exec's; with a stdin that cannot be rewound the error stands.
func TestExecAttachFailureRetried(t *testing.T) {
	up := websocket.Upgrader{}
	for _, stdin := range []io.Reader{nil, strings.NewReader("in"), io.MultiReader(strings.NewReader("in"))} {
		var execs atomic.Int32
		c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
			switch {
			case r.URL.Path == "/1.0/instances/x/exec":
				n := execs.Add(1)
				writeJSON(w, 202, async(fmt.Sprintf("ex%d", n), map[string]any{"fds": map[string]string{"0": "s0", "1": "s1", "2": "s2", "control": "sc"}}))
			case strings.HasSuffix(r.URL.Path, "/websocket"):
				ws, err := up.Upgrade(w, r, nil)
				if err != nil {
					return
				}
				if r.URL.Query().Get("secret") == "s1" && strings.Contains(r.URL.Path, "ex2") {
					_ = ws.WriteMessage(websocket.BinaryMessage, []byte("ok\n"))
				}
				if r.URL.Query().Get("secret") != "s0" {
					_ = ws.WriteMessage(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""))
				}
			case r.URL.Path == "/1.0/operations/ex1/wait":
				time.Sleep(50 * time.Millisecond)
				writeJSON(w, 200, op("ex1", 400, "Failed to retrieve PID of executing child process", nil))
			case r.URL.Path == "/1.0/operations/ex2/wait":
				time.Sleep(50 * time.Millisecond)
				writeJSON(w, 200, op("ex2", 200, "", map[string]any{"return": 0}))
			default:
				writeJSON(w, 404, apiErr(404, "not found"))
			}
		})
		res, err := c.Exec(context.Background(), "x", incus.ExecRequest{Command: []string{"true"}, Stdin: stdin})
		_, seeks := stdin.(io.Seeker)
		switch {
		case stdin == nil || seeks:
			if err != nil || string(res.Stdout) != "ok\n" || execs.Load() != 2 {
				t.Errorf("stdin %T: %q, %v after %d execs; want ok after 2", stdin, res.Stdout, err, execs.Load())
			}
		case err == nil || execs.Load() != 1:
			t.Errorf("stdin that cannot be rewound: %v after %d execs; want the error after 1", err, execs.Load())
		}
	}
}

// A data socket that stalls before the last one has connected stalls an exec whose command
// has not started (it waits for them all): asked for again, it runs once. A CI run's daemon
// answered the control socket, then let fd 0's handshake run past the client's bound.
func TestExecDataSocketStallRetried(t *testing.T) {
	up := websocket.Upgrader{}
	var execs, ran atomic.Int32
	c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.URL.Path == "/1.0/instances/x/exec":
			n := execs.Add(1)
			writeJSON(w, 202, async(fmt.Sprintf("ex%d", n), map[string]any{"fds": map[string]string{"0": "s0", "1": "s1", "2": "s2", "control": "sc"}}))
		case strings.HasSuffix(r.URL.Path, "/websocket"):
			if strings.Contains(r.URL.Path, "ex1") && r.URL.Query().Get("secret") == "s0" {
				time.Sleep(400 * time.Millisecond) // fd 0's handshake stalls
				return
			}
			ws, err := up.Upgrade(w, r, nil)
			if err != nil {
				return
			}
			if r.URL.Query().Get("secret") == "s1" {
				ran.Add(1)
				_ = ws.WriteMessage(websocket.BinaryMessage, []byte("ok\n"))
			}
			if r.URL.Query().Get("secret") != "s0" {
				_ = ws.WriteMessage(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""))
			}
		case r.URL.Path == "/1.0/operations/ex2/wait":
			time.Sleep(50 * time.Millisecond)
			writeJSON(w, 200, op("ex2", 200, "", map[string]any{"return": 0}))
		default:
			cancelledOrNotFound(w, r)
		}
	})
	c.SetHandshakeTimeout(100 * time.Millisecond)
	res, err := c.Exec(context.Background(), "x", incus.ExecRequest{Command: []string{"true"}})
	if err != nil || string(res.Stdout) != "ok\n" || execs.Load() != 2 || ran.Load() != 1 {
		t.Errorf("fd 0 stalled once: %q, %v after %d execs, ran %d times; want ok after 2, once", res.Stdout, err, execs.Load(), ran.Load())
	}
}
