package testcluster

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
)

// rawAPI speaks Incus's REST envelope over a member's unix socket, for the few calls
// boxcore/incus does not cover (cluster members, a create with ?target=).
type rawAPI struct {
	hc *http.Client
}

func newRawAPI(socket string) *rawAPI {
	return &rawAPI{hc: &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", socket)
		},
		DisableKeepAlives: true,
	}}}
}

type envelope struct {
	Type      string          `json:"type"`
	ErrorCode int             `json:"error_code"`
	Error     string          `json:"error"`
	Operation string          `json:"operation"`
	Metadata  json.RawMessage `json:"metadata"`
}

// do sends method path with body (JSON-encoded when not nil). A sync answer's metadata is
// decoded into out (when not nil); an async answer returns its operation id.
func (a *rawAPI) do(ctx context.Context, method, path string, body, out any) (opID string, err error) {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return "", err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://unix.socket"+path, rd)
	if err != nil {
		return "", err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := a.hc.Do(req)
	if err != nil {
		return "", fmt.Errorf("%s %s: %w", method, path, err)
	}
	defer resp.Body.Close()
	var env envelope
	if err := json.NewDecoder(resp.Body).Decode(&env); err != nil {
		return "", fmt.Errorf("%s %s: HTTP %d: decoding: %w", method, path, resp.StatusCode, err)
	}
	if env.Type == "error" || resp.StatusCode >= 300 {
		return "", fmt.Errorf("%s %s: %d %s", method, path, env.ErrorCode, env.Error)
	}
	if env.Type == "async" {
		id, _, _ := strings.Cut(env.Operation, "?")
		if i := strings.LastIndexByte(id, '/'); i >= 0 {
			id = id[i+1:]
		}
		return id, nil
	}
	if out != nil && len(env.Metadata) > 0 {
		if err := json.Unmarshal(env.Metadata, out); err != nil {
			return "", fmt.Errorf("%s %s: decoding metadata: %w", method, path, err)
		}
	}
	return "", nil
}

// ClusterMember is one entry of GET /1.0/cluster/members?recursion=1.
type ClusterMember struct {
	ServerName string   `json:"server_name"`
	URL        string   `json:"url"`
	Database   bool     `json:"database"`
	Status     string   `json:"status"` // "Online", "Offline", "Evacuated", ...
	Message    string   `json:"message"`
	Roles      []string `json:"roles"`
}

// ClusterMembers asks member i (0-based) for the cluster's members.
func (c *Cluster) ClusterMembers(ctx context.Context, i int) ([]ClusterMember, error) {
	var out []ClusterMember
	_, err := newRawAPI(c.members[i].Socket).do(ctx, http.MethodGet, "/1.0/cluster/members?recursion=1", nil, &out)
	return out, err
}

// API sends one request to member i's socket (0-based): a sync answer's metadata goes into
// out, an async one returns its operation id (wait with Client(i).WaitOperation). For calls
// boxcore/incus lacks, e.g. POST /1.0/instances?target=m2.
func (c *Cluster) API(ctx context.Context, i int, method, path string, body, out any) (opID string, err error) {
	return newRawAPI(c.members[i].Socket).do(ctx, method, path, body, out)
}
