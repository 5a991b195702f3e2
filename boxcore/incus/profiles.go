package incus

import (
	"context"
	"net/http"
)

// Profile is an Incus profile.
type Profile struct {
	Name        string                       `json:"name"`
	Description string                       `json:"description"`
	Config      map[string]string            `json:"config"`
	Devices     map[string]map[string]string `json:"devices"`
	UsedBy      []string                     `json:"used_by,omitempty"`
}

type profilePut struct {
	Description string                       `json:"description"`
	Config      map[string]string            `json:"config"`
	Devices     map[string]map[string]string `json:"devices"`
}

func (p Profile) put() profilePut {
	out := profilePut{Description: p.Description, Config: p.Config, Devices: p.Devices}
	if out.Config == nil {
		out.Config = map[string]string{}
	}
	if out.Devices == nil {
		out.Devices = map[string]map[string]string{}
	}
	return out
}

// Profile returns one profile and its ETag.
func (c *Client) Profile(ctx context.Context, name string) (Profile, string, error) {
	var p Profile
	etag, err := c.get(ctx, "/1.0/profiles/"+esc(name), &p)
	return p, etag, err
}

// Profiles lists all profiles.
func (c *Client) Profiles(ctx context.Context) ([]Profile, error) {
	var out []Profile
	if _, err := c.get(ctx, "/1.0/profiles?recursion=1", &out); err != nil {
		return nil, err
	}
	return out, nil
}

// CreateProfile creates a profile.
func (c *Client) CreateProfile(ctx context.Context, p Profile) error {
	body := struct {
		Name string `json:"name"`
		profilePut
	}{p.Name, p.put()}
	_, err := c.call(ctx, http.MethodPost, "/1.0/profiles", body, nil)
	return err
}

// UpdateProfile replaces a profile's config, devices and description (PUT).
func (c *Client) UpdateProfile(ctx context.Context, p Profile, etag string) error {
	_, err := c.call(ctx, http.MethodPut, "/1.0/profiles/"+esc(p.Name), p.put(), &reqOpts{etag: etag})
	return err
}

// DeleteProfile deletes a profile (it must be unused).
func (c *Client) DeleteProfile(ctx context.Context, name string) error {
	_, err := c.call(ctx, http.MethodDelete, "/1.0/profiles/"+esc(name), nil, nil)
	return err
}
