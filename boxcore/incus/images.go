package incus

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"
)

// Image is an image in the daemon's store.
type Image struct {
	Fingerprint  string            `json:"fingerprint"`
	Aliases      []string          `json:"-"`
	Size         int64             `json:"size"`
	Properties   map[string]string `json:"properties"`
	Type         string            `json:"type"` // "container" | "virtual-machine"
	Architecture string            `json:"architecture"`
	Public       bool              `json:"public"`
	CreatedAt    time.Time         `json:"created_at"`
	UploadedAt   time.Time         `json:"uploaded_at"`
}

type imageJSON struct {
	Image
	Aliases []struct {
		Name        string `json:"name"`
		Description string `json:"description"`
	} `json:"aliases"`
}

// ImageAlias is an alias pointing at an image.
type ImageAlias struct {
	Name        string `json:"name"`
	Target      string `json:"target"` // fingerprint
	Type        string `json:"type"`
	Description string `json:"description"`
}

// ImportImage uploads an image tarball (a unified tarball: metadata.yaml + rootfs/, plain
// or compressed), waits for the import and creates the given aliases. It returns the
// image's fingerprint. Importing an image already in the store fails with ErrConflict.
func (c *Client) ImportImage(ctx context.Context, tarball io.Reader, aliases []string) (string, error) {
	h := http.Header{}
	h.Set("X-Incus-public", "0")
	op, err := c.call(ctx, http.MethodPost, "/1.0/images", nil,
		&reqOpts{body: tarball, contentType: "application/octet-stream", header: h})
	if err != nil {
		return "", err
	}
	if op == nil {
		return "", fmt.Errorf("incus: image import returned no operation")
	}
	fp, _ := op.Metadata["fingerprint"].(string)
	if fp == "" {
		return "", fmt.Errorf("incus: image import finished without a fingerprint")
	}
	for _, a := range aliases {
		if err := c.CreateImageAlias(ctx, a, fp); err != nil {
			return fp, err
		}
	}
	return fp, nil
}

// Image returns an image by fingerprint (a unique prefix works too).
func (c *Client) Image(ctx context.Context, fingerprint string) (Image, error) {
	var j imageJSON
	if _, err := c.get(ctx, "/1.0/images/"+esc(fingerprint), &j); err != nil {
		return Image{}, err
	}
	img := j.Image
	for _, a := range j.Aliases {
		img.Aliases = append(img.Aliases, a.Name)
	}
	return img, nil
}

// ImageAlias returns an alias.
func (c *Client) ImageAlias(ctx context.Context, alias string) (ImageAlias, error) {
	var a ImageAlias
	_, err := c.get(ctx, "/1.0/images/aliases/"+esc(alias), &a)
	return a, err
}

// ImageByAlias resolves an alias and returns the image it points at.
func (c *Client) ImageByAlias(ctx context.Context, alias string) (Image, error) {
	a, err := c.ImageAlias(ctx, alias)
	if err != nil {
		return Image{}, err
	}
	return c.Image(ctx, a.Target)
}

// DeleteImage deletes an image (and its aliases).
func (c *Client) DeleteImage(ctx context.Context, fingerprint string) error {
	_, err := c.call(ctx, http.MethodDelete, "/1.0/images/"+esc(fingerprint), nil, nil)
	return err
}

// CreateImageAlias points a new alias at an image.
func (c *Client) CreateImageAlias(ctx context.Context, alias, fingerprint string) error {
	_, err := c.call(ctx, http.MethodPost, "/1.0/images/aliases",
		map[string]string{"name": alias, "target": fingerprint}, nil)
	return err
}

// DeleteImageAlias deletes an alias (the image stays).
func (c *Client) DeleteImageAlias(ctx context.Context, alias string) error {
	_, err := c.call(ctx, http.MethodDelete, "/1.0/images/aliases/"+esc(alias), nil, nil)
	return err
}

// Images lists all images in the store.
func (c *Client) Images(ctx context.Context) ([]Image, error) {
	var js []imageJSON
	if _, err := c.get(ctx, "/1.0/images?recursion=1", &js); err != nil {
		return nil, err
	}
	out := make([]Image, 0, len(js))
	for _, j := range js {
		img := j.Image
		for _, a := range j.Aliases {
			img.Aliases = append(img.Aliases, a.Name)
		}
		out = append(out, img)
	}
	return out, nil
}

// PublishOptions are the choices of PublishInstance.
type PublishOptions struct {
	Properties map[string]string // the image's descriptive properties
	// Compression is the daemon's compression_algorithm for the image ("" for its default,
	// "none" to skip compressing: the fastest for an image that never leaves the host).
	Compression string
}

// imagesPost is the body of POST /1.0/images that turns an instance into an image.
type imagesPost struct {
	Properties  map[string]string `json:"properties,omitempty"`
	Public      bool              `json:"public"`
	Compression string            `json:"compression_algorithm,omitempty"`
	Source      imagesPostSource  `json:"source"`
}

type imagesPostSource struct {
	Type string `json:"type"` // "instance" | "snapshot"
	Name string `json:"name"`
}

// PublishInstance makes a private image of a stopped instance (POST /1.0/images with an
// instance source), waits for it and returns the image's fingerprint.
func (c *Client) PublishInstance(ctx context.Context, inst string, o PublishOptions) (string, error) {
	body := imagesPost{Properties: o.Properties, Compression: o.Compression, Source: imagesPostSource{Type: "instance", Name: inst}}
	op, err := c.call(ctx, http.MethodPost, "/1.0/images", body, nil)
	if err != nil {
		return "", err
	}
	if op == nil {
		return "", fmt.Errorf("incus: publishing %s returned no operation", inst)
	}
	fp, _ := op.Metadata["fingerprint"].(string)
	if fp == "" {
		return "", fmt.Errorf("incus: publishing %s finished without a fingerprint", inst)
	}
	return fp, nil
}

// PointImageAlias makes alias name fingerprint: it creates the alias, or moves it there when it
// names another image (delete and create: the alias is missing for one round trip). An alias
// that a racing writer just made for the same image is not an error.
func (c *Client) PointImageAlias(ctx context.Context, alias, fingerprint string) error {
	switch a, err := c.ImageAlias(ctx, alias); {
	case err == nil && a.Target == fingerprint:
		return nil
	case err == nil:
		if err := c.DeleteImageAlias(ctx, alias); err != nil && !errors.Is(err, ErrNotFound) {
			return fmt.Errorf("moving alias %s: %w", alias, err)
		}
	case !errors.Is(err, ErrNotFound):
		return err
	}
	if err := c.CreateImageAlias(ctx, alias, fingerprint); err != nil {
		if errors.Is(err, ErrConflict) {
			if a, aerr := c.ImageAlias(ctx, alias); aerr == nil && a.Target == fingerprint {
				return nil
			}
		}
		return fmt.Errorf("aliasing %s: %w", alias, err)
	}
	return nil
}

// DeleteImageIfUnaliased deletes an image that no alias names any more (one an alias was
// just moved away from), and reports whether it did. An image it cannot read (already gone)
// is left alone without an error; the error is the delete's.
func (c *Client) DeleteImageIfUnaliased(ctx context.Context, fingerprint string) (bool, error) {
	img, err := c.Image(ctx, fingerprint)
	if err != nil || len(img.Aliases) > 0 {
		return false, nil
	}
	if err := c.DeleteImage(ctx, fingerprint); err != nil {
		return false, err
	}
	return true, nil
}
