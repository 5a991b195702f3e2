package incus

import (
	"context"
	"net/http"
	"slices"
	"strings"
	"time"
)

// Server describes the Incus daemon (GET /1.0).
type Server struct {
	APIVersion     string
	APIExtensions  []string
	Auth           string // "trusted" | "untrusted"
	Version        string // server_version, e.g. "6.0.4"
	Kernel         string
	KernelVersion  string
	ServerName     string
	Firewall       string // "nftables" | "xtables"
	Driver         string // e.g. "lxc" or "lxc | qemu"
	StorageDrivers []string
	Architectures  []string
	// InstanceTypes lists the instance types the daemon's drivers can run:
	// "container" (lxc) and/or "virtual-machine" (qemu).
	InstanceTypes []string
	// VMSupported is true when the daemon's drivers include qemu.
	VMSupported bool
	// Clustered: the daemon is a member of an Incus cluster (ServerName is its member name).
	Clustered bool
}

type serverJSON struct {
	APIVersion    string   `json:"api_version"`
	APIExtensions []string `json:"api_extensions"`
	Auth          string   `json:"auth"`
	Environment   struct {
		Architectures           []string `json:"architectures"`
		Driver                  string   `json:"driver"`
		Firewall                string   `json:"firewall"`
		Kernel                  string   `json:"kernel"`
		KernelVersion           string   `json:"kernel_version"`
		ServerName              string   `json:"server_name"`
		ServerClustered         bool     `json:"server_clustered"`
		ServerVersion           string   `json:"server_version"`
		StorageSupportedDrivers []struct {
			Name string `json:"Name"`
		} `json:"storage_supported_drivers"`
	} `json:"environment"`
}

// Server returns the daemon's description, read now. It is also the cheapest reachability
// check.
func (c *Client) Server(ctx context.Context) (Server, error) {
	s, err := c.readServer(ctx)
	if err == nil {
		c.serverMu.Lock()
		c.server, c.serverAt = s, time.Now()
		c.serverMu.Unlock()
	}
	return s, err
}

// serverFresh is how long RecentServer takes an answer to GET /1.0 to stand: `new` asks
// where it is three times within a few milliseconds (placement, the NIC plan, where the box
// landed), each a round trip the daemon answers while it creates the box. A second is too
// short for cluster membership or a member's name to change in a way a caller could tell
// from a race.
const serverFresh = time.Second

// RecentServer is Server, or its last answer if younger than serverFresh: for what the
// daemon is (a cluster member, which), never for whether it is up.
func (c *Client) RecentServer(ctx context.Context) (Server, error) {
	c.serverMu.Lock()
	if !c.serverAt.IsZero() && time.Since(c.serverAt) < serverFresh {
		s := c.server
		c.serverMu.Unlock()
		return s, nil
	}
	c.serverMu.Unlock()
	return c.Server(ctx)
}

func (c *Client) readServer(ctx context.Context) (Server, error) {
	var s serverJSON
	if _, err := c.get(ctx, "/1.0", &s); err != nil {
		return Server{}, err
	}
	e := s.Environment
	out := Server{
		APIVersion: s.APIVersion, APIExtensions: s.APIExtensions, Auth: s.Auth,
		Version: e.ServerVersion, Kernel: e.Kernel, KernelVersion: e.KernelVersion,
		ServerName: e.ServerName, Firewall: e.Firewall, Driver: e.Driver,
		Architectures: e.Architectures, Clustered: e.ServerClustered,
	}
	for _, d := range e.StorageSupportedDrivers {
		out.StorageDrivers = append(out.StorageDrivers, d.Name)
	}
	for _, d := range strings.Split(e.Driver, "|") {
		switch strings.TrimSpace(d) {
		case "lxc":
			out.InstanceTypes = append(out.InstanceTypes, "container")
		case "qemu":
			out.InstanceTypes = append(out.InstanceTypes, "virtual-machine")
			out.VMSupported = true
		}
	}
	return out, nil
}

// HasExtension reports whether the daemon advertises an API extension.
func (s Server) HasExtension(name string) bool {
	for _, e := range s.APIExtensions {
		if e == name {
			return true
		}
	}
	return false
}

// ClusterMember is one member as GET /1.0/cluster/members?recursion=1 gives it.
type ClusterMember struct {
	Name   string            `json:"server_name"`
	URL    string            `json:"url"` // https://ADDRESS:PORT, the member's cluster address
	Config map[string]string `json:"config"`
}

// ClusterMembers returns the cluster's members by name, with their addresses (none on a
// standalone daemon).
func (c *Client) ClusterMembers(ctx context.Context) ([]ClusterMember, error) {
	var out []ClusterMember
	if _, err := c.get(ctx, "/1.0/cluster/members?recursion=1", &out); err != nil {
		return nil, err
	}
	slices.SortFunc(out, func(a, b ClusterMember) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}

// createOnMember defines an object of a collection on one cluster member only (POST
// ?target=MEMBER) with that member's own config keys: the pending step of a cluster-wide
// network or pool.
func (c *Client) createOnMember(ctx context.Context, collection, member string, body map[string]any, memberConfig map[string]string) error {
	if memberConfig == nil {
		memberConfig = map[string]string{}
	}
	body["config"] = memberConfig
	_, err := c.call(ctx, http.MethodPost, memberPath(collection, member), body, nil)
	return err
}

// MemberConfig returns one cluster member's own config (user.*, scheduler.*).
func (c *Client) MemberConfig(ctx context.Context, member string) (map[string]string, error) {
	var m struct {
		Config map[string]string `json:"config"`
	}
	if _, err := c.get(ctx, "/1.0/cluster/members/"+esc(member), &m); err != nil {
		return nil, err
	}
	return m.Config, nil
}

// SetMemberConfig sets one key of a cluster member's config, or removes it when value is "".
// The member is read and written back whole (PUT with its ETag, again when someone changed
// it meanwhile).
func (c *Client) SetMemberConfig(ctx context.Context, member, key, value string) error {
	path := "/1.0/cluster/members/" + esc(member)
	var err error
	for range 3 {
		var m map[string]any
		etag, gerr := c.get(ctx, path, &m)
		if gerr != nil {
			return gerr
		}
		cfg, _ := m["config"].(map[string]any)
		if cfg == nil {
			cfg = map[string]any{}
		}
		if value == "" {
			delete(cfg, key)
		} else {
			cfg[key] = value
		}
		put := map[string]any{"config": cfg}
		for _, k := range []string{"description", "roles", "failure_domain", "groups"} {
			if v, ok := m[k]; ok {
				put[k] = v
			}
		}
		if _, err = c.call(ctx, http.MethodPut, path, put, &reqOpts{etag: etag}); err == nil || !IsPreconditionFailed(err) {
			return err
		}
	}
	return err
}
