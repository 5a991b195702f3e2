package incus

import (
	"context"
	"net/http"
)

// StoragePool is an Incus storage pool.
type StoragePool struct {
	Name        string            `json:"name"`
	Driver      string            `json:"driver"`
	Description string            `json:"description"`
	Status      string            `json:"status"`
	Config      map[string]string `json:"config"`
	UsedBy      []string          `json:"used_by"`
}

// StoragePools lists all storage pools.
func (c *Client) StoragePools(ctx context.Context) ([]StoragePool, error) {
	var out []StoragePool
	if _, err := c.get(ctx, "/1.0/storage-pools?recursion=1", &out); err != nil {
		return nil, err
	}
	return out, nil
}

// StoragePool returns one storage pool and its ETag.
func (c *Client) StoragePool(ctx context.Context, name string) (StoragePool, string, error) {
	var p StoragePool
	etag, err := c.get(ctx, "/1.0/storage-pools/"+esc(name), &p)
	return p, etag, err
}

// CreateStoragePool creates a storage pool (driver "dir" needs no config).
func (c *Client) CreateStoragePool(ctx context.Context, name, driver string, config map[string]string) error {
	if config == nil {
		config = map[string]string{}
	}
	_, err := c.call(ctx, http.MethodPost, "/1.0/storage-pools",
		map[string]any{"name": name, "driver": driver, "config": config}, nil)
	return err
}

// CreateStoragePoolPending defines a pool on one cluster member only (POST ?target=MEMBER)
// with that member's own keys (size, source); then CreateStoragePool, without them, makes it.
func (c *Client) CreateStoragePoolPending(ctx context.Context, member, name, driver string, memberConfig map[string]string) error {
	return c.createOnMember(ctx, "/1.0/storage-pools", member, map[string]any{"name": name, "driver": driver}, memberConfig)
}

// DeleteStoragePool deletes an (unused) storage pool.
func (c *Client) DeleteStoragePool(ctx context.Context, name string) error {
	_, err := c.call(ctx, http.MethodDelete, "/1.0/storage-pools/"+esc(name), nil, nil)
	return err
}

// StoragePoolResources is the space a storage pool has and uses, in bytes.
type StoragePoolResources struct {
	Space struct {
		Used  uint64 `json:"used"`
		Total uint64 `json:"total"`
	} `json:"space"`
}

// StoragePoolResources reads a pool's space (for a loop-backed pool, its loop file's size;
// for a dir pool, the filesystem it lives on).
func (c *Client) StoragePoolResources(ctx context.Context, name string) (StoragePoolResources, error) {
	var r StoragePoolResources
	_, err := c.get(ctx, "/1.0/storage-pools/"+esc(name)+"/resources", &r)
	return r, err
}
