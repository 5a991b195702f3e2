package incus

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strconv"
)

// PushFile writes content to path inside an instance (created or overwritten) with the
// given permission bits and owner.
func (c *Client) PushFile(ctx context.Context, inst, path string, content io.Reader, mode os.FileMode, uid, gid int) error {
	h := http.Header{}
	h.Set("X-Incus-type", "file")
	h.Set("X-Incus-write", "overwrite")
	h.Set("X-Incus-mode", fmt.Sprintf("%04o", mode.Perm()))
	h.Set("X-Incus-uid", strconv.Itoa(uid))
	h.Set("X-Incus-gid", strconv.Itoa(gid))
	if content == nil {
		content = http.NoBody
	}
	_, _, err := c.do(ctx, http.MethodPost, c.filePath(inst, path), nil,
		&reqOpts{body: content, contentType: "application/octet-stream", header: h})
	return err
}

// PullFile reads a regular file from inside an instance.
func (c *Client) PullFile(ctx context.Context, inst, path string) ([]byte, error) {
	p := c.filePath(inst, path)
	resp, err := c.raw(ctx, http.MethodGet, p, nil, nil)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		var r response
		if json.NewDecoder(resp.Body).Decode(&r) == nil && r.Error != "" {
			code := r.ErrorCode
			if code == 0 {
				code = resp.StatusCode
			}
			return nil, &StatusError{Code: code, Message: r.Error, Method: http.MethodGet, Path: p}
		}
		return nil, &StatusError{Code: resp.StatusCode, Message: http.StatusText(resp.StatusCode), Method: http.MethodGet, Path: p}
	}
	if t := resp.Header.Get("X-Incus-type"); t != "" && t != "file" {
		return nil, fmt.Errorf("incus: %s in %s is a %s, not a file", path, inst, t)
	}
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("incus: reading %s from %s: %w", path, inst, err)
	}
	return b, nil
}

func (c *Client) filePath(inst, path string) string {
	return "/1.0/instances/" + esc(inst) + "/files?path=" + url.QueryEscape(path)
}
