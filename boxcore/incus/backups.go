package incus

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"time"
)

// BackupsPost is the body of POST /1.0/instances/<n>/backups (shared/api/instance_backup.go).
type BackupsPost struct {
	Name                 string    `json:"name"`
	ExpiresAt            time.Time `json:"expires_at"`
	InstanceOnly         bool      `json:"instance_only"`
	OptimizedStorage     bool      `json:"optimized_storage"`
	CompressionAlgorithm string    `json:"compression_algorithm,omitempty"`
}

// StartCreateBackup asks for a backup of an instance (with its snapshots unless
// InstanceOnly) and returns the operation making it, without waiting (WaitOperation). The
// daemon deletes the backup by itself once ExpiresAt passes.
func (c *Client) StartCreateBackup(ctx context.Context, inst string, req BackupsPost) (string, error) {
	return c.start(ctx, http.MethodPost, "/1.0/instances/"+esc(inst)+"/backups", req, nil)
}

// ExportBackup streams a backup's tarball into w and returns how many bytes it wrote.
func (c *Client) ExportBackup(ctx context.Context, inst, backup string, w io.Writer) (int64, error) {
	p := "/1.0/instances/" + esc(inst) + "/backups/" + esc(backup) + "/export"
	resp, err := c.raw(ctx, http.MethodGet, p, nil, nil)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		var r response
		if json.NewDecoder(resp.Body).Decode(&r) == nil && r.Error != "" {
			code := r.ErrorCode
			if code == 0 {
				code = resp.StatusCode
			}
			return 0, &StatusError{Code: code, Message: r.Error, Method: http.MethodGet, Path: p}
		}
		return 0, &StatusError{Code: resp.StatusCode, Message: http.StatusText(resp.StatusCode), Method: http.MethodGet, Path: p}
	}
	n, err := io.Copy(w, resp.Body)
	if err != nil {
		if ctx.Err() != nil {
			return n, fmt.Errorf("incus: exporting backup %s of %s: %w", backup, inst, ctx.Err())
		}
		return n, fmt.Errorf("incus: exporting backup %s of %s: %w", backup, inst, err)
	}
	return n, nil
}

// DeleteBackup deletes a backup of an instance.
func (c *Client) DeleteBackup(ctx context.Context, inst, backup string) error {
	_, err := c.call(ctx, http.MethodDelete, "/1.0/instances/"+esc(inst)+"/backups/"+esc(backup), nil, nil)
	return err
}

// StartImportInstance sends a backup tarball (body, read to its end) to POST /1.0/instances
// as application/octet-stream, to be made into instance name on pool (either may be "" for
// the tarball's own), and returns the import's operation id without waiting for it. The
// daemon stores the whole upload before it answers.
func (c *Client) StartImportInstance(ctx context.Context, body io.Reader, name, pool, target string) (string, error) {
	h := http.Header{}
	if name != "" {
		h.Set("X-Incus-name", name)
	}
	if pool != "" {
		h.Set("X-Incus-pool", pool)
	}
	return c.start(ctx, http.MethodPost, memberPath("/1.0/instances", target), nil,
		&reqOpts{body: body, contentType: "application/octet-stream", header: h})
}

// Backups lists the names of an instance's backups.
func (c *Client) Backups(ctx context.Context, inst string) ([]string, error) {
	var urls []string
	if _, err := c.get(ctx, "/1.0/instances/"+esc(inst)+"/backups", &urls); err != nil {
		return nil, err
	}
	out := make([]string, 0, len(urls))
	for _, u := range urls {
		out = append(out, pathBase(u))
	}
	return out, nil
}
